"""`importance`: head importance scores of Michel, Levy & Neubig (2019), "Are Sixteen
Heads Really Better than One?" (section 4.1, eq. 2).

A mask xi of ones multiplies every head's output (z_h -> xi_h z_h); the importance of
head h is the expected absolute derivative of the loss with respect to xi_h,
I_h = sum over batches of |d loss / d xi_h|, which is (to first order) how much the loss
moves when the head is removed. Their code normalizes the scores of each layer by its L2
norm (`normalize=True`) before comparing heads across layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from multihead.heads._ranks import Ranks, check_group
from multihead.heads.engine import Engine, Handler, check_grad_mode, check_model


class _HeadMask(Handler):
    def __init__(self):
        self.xi: dict[int, Tensor] = {}
        self.H: dict[int, int] = {}

    def z(self, lay, z, v):
        xi = self.xi.get(lay.index)
        if xi is None:
            xi = self.xi[lay.index] = torch.ones(lay.H, dtype=z.dtype, device=z.device, requires_grad=True)
            self.H[lay.index] = lay.H
        return z * xi[:, None]  # (B, T, H, Dv) * (H, 1)


def importance(model, batches: Iterable, loss: Callable, normalize: bool = True, *, group=None) -> Tensor:
    """Michel et al. (2019) head importance, `(layers, heads)` float32.

    Args:
        model: a transformers model on attn_implementation="multihead", or a module built
            from multihead's Attention/LatentAttention.
        batches: an iterable of batches, each passed to `loss`.
        loss: `loss(model, batch)` -> a scalar tensor (it runs the model itself).
        normalize: divide each layer's scores by their L2 norm.
        group: None (one process), or a torch.distributed process group whose every rank
            makes this call with the same model and the same batches in the same order
            (a list, or a loader with the same seed: not a DistributedSampler's share).
            Rank r runs batches r, r + P, ...; the per-batch scores are gathered and
            summed in batch order, so every rank returns the one process's table, bitwise.
            An error on any rank raises on every rank.

    The model's parameters get no gradients (only the head mask is differentiated).
    NaN pads layers with fewer heads than the widest.
    """
    check_group(group)
    ranks = Ranks(group, "importance")
    handler = _HeadMask()
    scores: dict[int, dict[int, Tensor]] = {}  # batch -> layer -> |d loss / d xi| of this rank's batches
    n, error = 0, None
    try:
        check_model(model)
        if not callable(loss):
            raise TypeError(f"loss must be callable(model, batch) -> scalar tensor; received {type(loss).__name__}")
        check_grad_mode("importance")
        with Engine(model, handler).installed(), torch.enable_grad():
            for batch in batches:
                if n % ranks.size == ranks.rank:
                    scores[n] = _scores(handler, loss(model, batch))
                n += 1
    except Exception as e:
        if group is None:
            raise
        error = e  # held for settle: every rank raises together
    if group is not None:
        parts = ranks.settle(error, (scores, handler.H), n)
        for part, H in parts:
            scores.update(part)
            handler.H.update(H)
    if n == 0:
        raise ValueError("batches is empty: importance needs at least one batch")
    total: dict[int, Tensor] = {}
    for b in range(n):  # in batch order, as one process adds them
        for i, g in scores[b].items():
            total[i] = total[i] + g if i in total else g
    width = max(handler.H.values())
    out = torch.full((len(total), width), math.nan)
    for i, s in total.items():
        if normalize:
            s = s / s.norm().clamp_min(1e-20)
        out[i, :s.shape[0]] = s
    return out


def _scores(handler: _HeadMask, value) -> dict[int, Tensor]:
    """One batch's |d loss / d xi| for every layer run so far, on the CPU (settle pickles them)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"loss must return a scalar tensor; received {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(f"loss must return a scalar tensor; received shape {tuple(value.shape)}")
    if not value.requires_grad:
        raise ValueError("loss(model, batch) returned a tensor without a gradient; valid: a loss computed "
                         "from the model's output inside loss (importance differentiates it)")
    layers = sorted(handler.xi)
    if not layers:
        raise ValueError("loss(model, batch) ran no attention layer of the model")
    grads = torch.autograd.grad(value, [handler.xi[i] for i in layers], allow_unused=True)
    return {i: torch.zeros(handler.H[i]) if g is None else g.detach().abs().float().cpu()
            for i, g in zip(layers, grads)}
