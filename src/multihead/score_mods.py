"""Score modifications: functions of the scaled score, in flex_attention's signature.

A score mod is `score_mod(score, b, h, q_idx, kv_idx) -> score`, applied to the scaled
scores `q . k * scale` before the mask and the softmax, exactly where
`torch.nn.attention.flex_attention` applies it. The kernel calls it on whole tiles with
broadcastable index tensors (b `(B, 1, 1, 1)`, h `(1, H, 1, 1)`, q_idx `(1, 1, t, 1)`,
kv_idx `(1, 1, 1, s)`), so an element-wise definition written for flex works unchanged.

Shipped: `softcap(cap)` (Gemma 2 report, 2024) and `alibi(slopes)` (Press et al., 2022,
"Train Short, Test Long"), with their float64 NumPy twins in `multihead.reference`.

Details: docs/kernel.md, "The score mods shipped, and how the kernel runs them".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from multihead.checks import check_positive_int, check_positive_number
from multihead.kernels.common import cap_scores
from multihead.named_mod import NamedMod

__all__ = ["ScoreMod", "alibi", "alibi_slopes", "from_flex", "softcap"]


class ScoreMod(NamedMod):
    """A named score mod `(score, b, h, q_idx, kv_idx) -> score`.

    `bias(b, h, q_idx, kv_idx) -> float tensor`, when given, says the mod is
    `score + bias(...)` with a bias independent of the score (it may then run on the
    fused kernel as an additive mask). `top_left`: index convention, as in `MaskMod`.

    For the tile engine, an element-wise mod may also come in a fast form: `inplace(x)`
    overwrites `x = score * input_scale` (the factor rides on the q k^T matmul) with the
    modded scores, and `inplace_grad(z, ds)` returns `ds * dz/dscore` given the modded
    scores z (which it may overwrite), so the backward needs no autograd per tile.
    """

    def __init__(self, fn: Callable, name: str, *, bias: Callable | None = None, top_left: bool = False,
                 check: Callable | None = None, inplace: Callable | None = None, input_scale: float = 1.0,
                 inplace_grad: Callable | None = None):
        if (inplace is None) != (inplace_grad is None):
            raise ValueError("a score mod's in-place form needs both inplace and inplace_grad")
        super().__init__(fn, name, top_left=top_left, check=check,
                         signature="a score mod must be callable (score, b, h, q_idx, kv_idx) -> score")
        self.bias = bias
        self._inplace = inplace  # the same mod overwriting its input: the kernel's temporaries only
        self.input_scale = float(input_scale)
        self.inplace_grad = inplace_grad

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(score, b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"ScoreMod({self.name})"

    @property
    def inplace(self) -> Callable | None:
        """The mod's in-place form `inplace(x)` (see the class docstring), or None."""
        return self._inplace

    def trainable(self, device=None, shape: Sequence[int] | None = None, S: int | None = None) -> bool | None:
        """Whether the mod captures tensors that require grad (a learned bias): probed on scores
        that do not, at the first 2 x 2 pairs of every batch and head of a `shape` = (B, H, T, ..)
        attention over S keys (one pair at index 0 without a shape). Such a mod needs a backend
        whose backward is autograd's. None: the probe raised, so it cannot tell (the real call
        will say why; "auto" then picks an autograd backend, which stays exact either way)."""
        if shape is None or S is None:
            B = H = t = s = 1
        else:
            B, H, t, s = shape[0], shape[1], max(1, min(shape[2], 2)), max(1, min(S, 2))
        index = [torch.arange(n, device=device).view([n if i == d else 1 for i in range(4)])
                 for d, n in enumerate((B, H, t, s))]
        try:
            with torch.enable_grad():
                out = self.fn(torch.zeros(B, H, t, s, device=device), *index)
        except Exception:  # the probe's indices mean nothing to this mod; the real call will tell
            return None
        return isinstance(out, Tensor) and out.requires_grad

    def apply(self, score: Tensor, b: Tensor, h: Tensor, rows: Tensor, kv: Tensor, shift: int) -> Tensor:
        """The mod on a tile of scores at query rows `rows` (0..T-1); shift = S - T."""
        out = self.fn(score, b, h, rows if self.top_left else rows + shift, kv)
        if not isinstance(out, Tensor):
            raise TypeError(f"score mod {self.name} must return a tensor of scores; returned {type(out).__name__}")
        if out.shape != score.shape:
            raise ValueError(f"score mod {self.name} changed the shape of the scores: received "
                             f"{tuple(score.shape)}, returned {tuple(out.shape)}; it must return one score per input")
        if not out.is_floating_point():
            raise TypeError(f"score mod {self.name} must return floating-point scores; returned {out.dtype}")
        return out.to(score.dtype)

    def bias_tile(self, b: Tensor, h: Tensor, rows: Tensor, kv: Tensor, shift: int, dtype) -> Tensor:
        """The additive term on a tile (only for mods with `bias`)."""
        return self.bias(b, h, rows if self.top_left else rows + shift, kv).to(dtype)


def from_flex(fn: Callable, name: str | None = None) -> ScoreMod:
    """A flex_attention `score_mod` (top-left q_idx) as a ScoreMod."""
    if isinstance(fn, ScoreMod):
        return fn
    if not callable(fn) or isinstance(fn, Tensor):
        raise TypeError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score; "
                        f"received {type(fn).__name__}")
    return ScoreMod(fn, name or getattr(fn, "__name__", "score_mod"), top_left=True)


def _positive_number(x, what: str) -> float:
    if isinstance(x, Tensor) and x.requires_grad:
        raise ValueError(f"{what} is a tensor that requires grad; it is read as a fixed number and would never "
                         f"train: pass a float, or write the mod with the tensor (e.g. lambda s, b, h, q, kv: "
                         f"cap * torch.tanh(s / cap)) so autograd sees it")
    return check_positive_number(what, x)


# Caps for which the fast float32 form 2 cap sigmoid(2 s / cap) - cap is accurate: its error
# on the score is ~2 cap 2^-24 (1.2e-5 at 100; Gemma's caps are 30 and 50), and 2 / cap scales
# q without overflow. Outside, cancellation (cap 1e4: 6.7e-4; 1e30: every score 0) or overflow
# (cap 1e-40: 2 / cap = inf, NaN scores): there the tile loop uses tanh(s / cap) * cap.
_SIGMOID_CAPS = (1e-6, 100.0)


def softcap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap): scores squashed smoothly into (-cap, cap) (Gemma 2).

    `cap`: a positive finite number (a huge cap leaves the scores as they are, a tiny one
    flattens them); a tensor that requires grad is refused (it would not be trained).
    """
    cap = _positive_number(cap, "softcap cap")

    def fn(score, b, h, q, kv):
        return cap_scores(score, cap)

    def inplace_grad(z, ds):  # d(cap tanh(s / cap))/ds = 1 - (z / cap)^2
        return ds.addcmul_(ds, z.div_(cap).square_(), value=-1)

    if not _SIGMOID_CAPS[0] <= cap <= _SIGMOID_CAPS[1]:
        def inplace_tanh(x):  # x = score
            return x.div_(cap).tanh_().mul_(cap)

        return ScoreMod(fn, f"softcap({cap:g})", inplace=inplace_tanh, inplace_grad=inplace_grad)

    def inplace(x):  # x = score * 2 / cap
        if x.dtype == torch.float64:
            return x.mul_(0.5).tanh_().mul_(cap)
        # cap tanh(y) = 2 cap sigmoid(2y) - cap: torch's CPU sigmoid is faster than its tanh
        # (docs/kernel.md); the float32 error on the score stays below 2 cap * 2^-24 (6e-6 at cap 50)
        return x.sigmoid_().mul_(2 * cap).sub_(cap)

    return ScoreMod(fn, f"softcap({cap:g})", inplace=inplace, input_scale=2 / cap, inplace_grad=inplace_grad)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's per-head slopes `(H,)`, float32, as BLOOM builds them.

    For H a power of 2: 2^(-8 h / H), h = 1..H. Otherwise the slopes of the closest
    power of 2 below H, followed by every other slope of twice that power.
    """
    n_heads = check_positive_int("n_heads", n_heads)
    p = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(p) - 3)))
    slopes = [base ** i for i in range(1, p + 1)]
    if p != n_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * p) - 3)))
        slopes += [extra ** i for i in range(1, 2 * min(p, n_heads - p), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes: Tensor | Sequence[float] | int) -> ScoreMod:
    """ALiBi: score + slope_h * (kv - q), a linear penalty on the distance to the key.

    `slopes`: a `(H,)` tensor or sequence, one per query head; an int n_heads means
    `alibi_slopes(n_heads)`. BLOOM adds slope * kv instead, which differs by a
    constant per query row and so gives the same softmax.
    """
    if isinstance(slopes, int) and not isinstance(slopes, bool):
        slopes = alibi_slopes(slopes)
    if not isinstance(slopes, Tensor):
        try:
            slopes = torch.tensor(list(slopes), dtype=torch.float64)
        except (TypeError, ValueError):
            raise TypeError(f"slopes must be a (H,) tensor, a sequence of floats or an int n_heads; "
                            f"received {type(slopes).__name__}") from None
    if slopes.dim() != 1 or not slopes.is_floating_point() or slopes.numel() == 0:
        raise ValueError(f"slopes must be a non-empty 1-D float tensor (H,); received shape "
                         f"{tuple(slopes.shape)} {slopes.dtype}")
    H = slopes.shape[0]

    def check(B, H_, T, S):
        if H_ != H:
            raise ValueError(f"alibi has {H} slopes but the attention has H = {H_} query heads; give one per head")

    def bias(b, h, q, kv):
        s = slopes.to(device=kv.device)[h]  # (1, H, 1, 1) when h is the head index tensor
        return s * (kv - q).to(s.dtype)

    def fn(score, b, h, q, kv):
        return score + bias(b, h, q, kv).to(score.dtype)

    return ScoreMod(fn, f"alibi({H} heads)", bias=bias, check=check)
