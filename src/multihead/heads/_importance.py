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

from multihead.heads._engine import Engine, Handler, check_grad_mode, check_model


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


def importance(model, batches: Iterable, loss: Callable, normalize: bool = True) -> Tensor:
    """Michel et al. (2019) head importance, `(layers, heads)` float32.

    Args:
        model: a transformers model on attn_implementation="multihead", or a module built
            from multihead's Attention/LatentAttention.
        batches: an iterable of batches, each passed to `loss`.
        loss: `loss(model, batch)` -> a scalar tensor (it runs the model itself).
        normalize: divide each layer's scores by their L2 norm.

    The model's parameters get no gradients (only the head mask is differentiated).
    NaN pads layers with fewer heads than the widest.
    """
    check_model(model)
    if not callable(loss):
        raise TypeError(f"loss must be callable(model, batch) -> scalar tensor; received {type(loss).__name__}")
    check_grad_mode("importance")
    handler = _HeadMask()
    total: dict[int, Tensor] = {}
    n = 0
    with Engine(model, handler).installed(), torch.enable_grad():
        for batch in batches:
            value = loss(model, batch)
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
            for i, g in zip(layers, grads):
                g = torch.zeros(handler.H[i]) if g is None else g.detach().abs().float()
                total[i] = total[i] + g if i in total else g
            n += 1
    if n == 0:
        raise ValueError("batches is empty: importance needs at least one batch")
    width = max(handler.H.values())
    out = torch.full((len(total), width), math.nan)
    for i, s in total.items():
        if normalize:
            s = s / s.norm().clamp_min(1e-20)
        out[i, :s.shape[0]] = s
    return out
