"""Metrics that say which logits they read, so a scan computes only those.

A metric is any `callable(logits) -> scalar`. Most that interpretability asks for read one
position per prompt (the next-token logit difference of IOI at each prompt's last real
token), yet a forward computes the model's head at every position: on SmolLM2 (49,152 x
576) that is as much work per position as 7 of its 30 blocks. `AtPositions` wraps such a
metric with the positions it reads; `patch_scan` and `path_patch_scan` then ask a
transformers model for those positions' logits only (its `logits_to_keep`) and hand the
metric exactly the values it would have read from the full logits. Called on full logits
it is the plain metric, so it works everywhere a metric does (`attribution_scan`,
`causal_check`, a user's own loop).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class AtPositions:
    """`metric(logits) == fn(logits[arange(B), positions])`: a metric of one position per row.

    Args:
        fn: `(B, vocab)` logits, row r taken at `positions[r]` -> a scalar tensor (or a number).
        positions: `(B,)` integer positions in [0, T) (or [-T, 0), counted from the end), one
            per row of the inputs the metric is meant for.
        name: what the errors call it ("the IOI metric").

    Calling it with `(B, T, vocab)` logits gathers the rows and calls `fn`; `kept(logits, kept)`
    does the same from `(B, len(kept), vocab)` logits computed at the positions `kept` only
    (`keep(T)`'s tensor: the distinct positions, ascending), which is how the scans use it.
    """

    def __init__(self, fn: Callable[[Tensor], Tensor], positions, name: str = "this metric"):
        if not callable(fn):
            raise TypeError(f"fn must be callable((B, vocab) logits) -> scalar; received {type(fn).__name__}")
        try:
            pos = positions if isinstance(positions, Tensor) else torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError):
            pos = None
        if pos is None or pos.dim() != 1 or pos.numel() == 0 or pos.dtype.is_floating_point or pos.dtype.is_complex \
                or pos.dtype == torch.bool:
            got = f"shape {tuple(pos.shape)} of {pos.dtype}" if pos is not None else repr(positions)[:60]
            raise ValueError(f"positions must be a non-empty 1-D tensor of integer positions, one per row; "
                             f"received {got}")
        self.fn, self.name = fn, name
        self.positions = pos.detach().to("cpu", torch.long)

    def __repr__(self) -> str:
        return f"AtPositions({getattr(self.fn, '__qualname__', self.fn)!r}, positions={self.positions.tolist()})"

    def absolute(self, T: int) -> Tensor:
        """The positions read, counted from 0, for logits of T positions `(B,)`."""
        p = self.positions
        if bool(((p < -T) | (p >= T)).any()):
            raise ValueError(f"{self.name} reads positions {p.tolist()}; the logits have {T} positions (valid: "
                             f"[-{T}, {T}))")
        return torch.where(p < 0, p + T, p)

    def _rows(self, logits: Tensor) -> Tensor:
        if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[0] != len(self.positions):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"{self.name} reads logits (B={len(self.positions)}, T, vocab), one position per row; "
                             f"received {shape}")
        return torch.arange(logits.shape[0], device=logits.device)

    def __call__(self, logits: Tensor):
        rows = self._rows(logits)
        return self.fn(logits[rows, self.absolute(logits.shape[1]).to(logits.device)])

    def keep(self, T: int) -> Tensor:
        """The distinct positions read, ascending `(P,)`: what to ask the model's head for."""
        return torch.unique(self.absolute(T))

    def kept(self, logits: Tensor, kept: Tensor, T: int):
        """The metric from `(B, P, vocab)` logits at the positions `kept` (= `keep(T)`)."""
        rows = self._rows(logits)
        where = torch.searchsorted(kept, self.absolute(T))
        return self.fn(logits[rows, where.to(logits.device)])
