"""What the attention modules (`Attention`, `LatentAttention`) share: the head split and
merge at the module boundary, the checks of the options both take, and the sliding
window combined with a caller's mask. One home, so the two modules word their errors
and lay out their heads one way; neither reaches into the other."""

from __future__ import annotations

import torch
from torch import Tensor

from multihead import masks as _masks
from multihead.checks import check_positive_int, check_positive_number, divisibility_error
from multihead.kernels.registry import check_backend_name
from multihead.kernels.validation import normalize_mask

__all__ = ["check_dtype", "check_input", "default_head_dim", "layer_options", "merge_heads", "split_heads",
           "with_window"]


def split_heads(t: Tensor, D: int) -> Tensor:
    """(B, T, h * D) -> (B, h, T, D). The head count h is read from the projection's
    output, so a tensor-parallel shard (h local heads) and empty batches both work."""
    B, T, width = t.shape
    return t.view(B, T, width // D, D).transpose(1, 2)


def merge_heads(t: Tensor) -> Tensor:
    """(B, h, T, Dv) -> (B, T, h * Dv), with explicit sizes so empty batches work."""
    B, h, T, Dv = t.shape
    return t.transpose(1, 2).reshape(B, T, h * Dv)


def check_dtype(name: str, t: Tensor, weight: Tensor) -> None:
    """An input whose dtype differs from the weights' is named here, not deep in a matmul
    (under autocast the mix is intended and allowed)."""
    if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
        raise TypeError(f"{name} is {t.dtype} but this module's weights are {weight.dtype}; cast one to "
                        f"the other ({name}.to({weight.dtype}) or module.to({t.dtype}))")


def default_head_dim(d_model: int, n_heads: int, head_dim: int | None) -> int:
    """head_dim as given (checked), else d_model // n_heads when that divides evenly."""
    if head_dim is None:
        error = divisibility_error("d_model", d_model, "n_heads", n_heads)
        if error is not None:
            raise ValueError(f"{error}; or pass head_dim explicitly")
        head_dim = d_model // n_heads
    check_positive_int("head_dim", head_dim)
    return head_dim


def check_input(name: str, t, width: int, expects: str | None = None) -> None:
    """A module's input: a batch-first tensor (B, T, width); `expects` words the width
    ("d_model = 64") where the plain number would not say which."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor (B, T, {width}); received {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D (B, T, {width}), batch first; received shape {tuple(t.shape)}")
    if t.shape[-1] != width:
        raise ValueError(f"{name} has width {t.shape[-1]}; this module expects {expects or width}")


def layer_options(causal, sliding_window, softcap, backend: str) -> tuple[bool, int | None, float | None, str]:
    """The options both attention modules keep about their scores, checked and normalised:
    (causal, a causal window W >= 1 or None, a finite cap > 0 as a float or None, the backend)."""
    check_backend_name(backend)
    if sliding_window is not None:
        check_positive_int("sliding_window", sliding_window)
        if not causal:
            raise ValueError(f"sliding_window={sliding_window} is a causal window (query p sees keys "
                             f"p - W < j <= p); set causal=True, or pass a masks predicate as mask=")
    check_positive_number("softcap", softcap, allow_none=True)
    return bool(causal), sliding_window, None if softcap is None else float(softcap), backend


def with_window(mask, window: int | None, q: Tensor, k: Tensor):
    """A caller's mask combined with a layer's sliding window: a predicate (so the kernel
    can skip the tiles outside the window), or with a tensor mask, a tensor."""
    if window is None:
        return mask
    pred = _masks.sliding_window(window)
    if mask is None:
        return pred
    if not isinstance(mask, Tensor):
        return _masks.and_masks(mask, pred)  # a predicate or a flex-style callable
    mask = normalize_mask(mask, q, k)  # checked (clear errors) and 4-D before combining
    dense = pred.to_dense(1, 1, q.shape[2], k.shape[2], device=q.device)  # (1, 1, T, S)
    return mask & dense if mask.dtype == torch.bool else mask.masked_fill(~dense, float("-inf"))
