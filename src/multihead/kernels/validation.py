"""Validation of the kernel's inputs: every bad input raises ValueError/TypeError naming
what was received and what is valid. `multihead.functional` calls these before any work."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from multihead.checks import check_divisible, check_positive_number, check_probability, check_same_dtype_device
from multihead.masks import MaskMod
from multihead.score_mods import ScoreMod
from multihead.score_mods import from_flex as _score_from_flex

__all__ = ["check_inputs", "check_qkv", "check_scale", "check_score_mod", "is_plain_call", "normalize_mask",
           "plain_scale", "plain_shape", "shape_str", "weight_heads"]


def shape_str(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_scale(scale) -> float | None:
    """None, or a positive finite number: a Python, NumPy or 0-d/1-element tensor scalar."""
    return check_positive_number("scale", scale, allow_none=True)


def is_plain_call(mask, scale, dropout_p, return_weights=False, score_mod=None) -> bool:
    """Whether a call asks the kernel for nothing but softmax(q k^T scale) v: no mask, no
    score mod, no weights, no dropout, and a plain scale (`plain_scale`): `functional.attend`'s
    quick accept (the decode step's and a plain prefill's); with
    `plain_shape` for the tensors it replaces the per-argument checks, which a call it
    refuses goes through (and they name what is wrong)."""
    return mask is None and score_mod is None and (return_weights is False or return_weights is None) \
        and (type(dropout_p) is float or type(dropout_p) is int) and dropout_p == 0 and plain_scale(scale)


def plain_scale(scale) -> bool:
    """Whether `check_scale` would accept `scale` unchanged: None or a positive finite Python
    float (what transformers passes). The decode path's quick accept; anything else goes
    through `check_scale`."""
    return scale is None or (type(scale) is float and 0.0 < scale < math.inf)


def plain_shape(q, k, v) -> tuple[int, int, int, int] | None:
    """`(B, H, T, S)` when `check_inputs(q, k, v, None, scale, 0.0)` would pass, else None:
    q `(B, H, T, D)`, k `(B, Hkv, S, D)`, v `(B, Hkv, S, Dv)` tensors of one floating dtype
    on one device, H a multiple of Hkv. One expression over the shapes instead of the
    per-check messages, for the calls that pay for every microsecond (a decode step runs it
    once per layer per token); None sends the caller to `check_inputs`, which names what
    is wrong."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None
    B, H, T, D = qs
    Hkv, S = ks[1], ks[2]
    dtype = q.dtype
    # (three tensors on the CPU are on one device: `is_cpu` is a flag read, `.device` builds an object per read)
    if (B == ks[0] == vs[0] and Hkv == vs[1] and Hkv != 0 and H % Hkv == 0 and S == vs[2] and D == ks[3]
            and dtype.is_floating_point and dtype == k.dtype == v.dtype
            and ((q.is_cpu and k.is_cpu and v.is_cpu) or q.device == k.device == v.device)):
        return B, H, T, S
    return None


def check_score_mod(score_mod, q: Tensor, k: Tensor) -> ScoreMod | None:
    if score_mod is None:
        return None
    mod = _score_from_flex(score_mod)
    mod.check(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return mod


def check_inputs(q, k, v, mask, scale, dropout_p) -> Tensor | MaskMod | None:
    """Validate user input; return the mask as None, a 4-D tensor or a checked predicate.
    `v` is None where no values are involved (`attention_weights`)."""
    check_qkv(q, k, v)
    check_probability("dropout_p", dropout_p)
    return normalize_mask(mask, q, k)


def check_qkv(q, k, v) -> None:
    """q `(B, H, T, D)`, k `(B, Hkv, S, D)`, v `(B, Hkv, S, Dv)` (or None): floating tensors
    of one dtype on one device, Hkv dividing H. Every engine that takes q, k, v (`attend`,
    `ring_attention`) checks them here, so a mistake raises one exception with one message."""
    named = [("q", q, "(B, H, T, D)"), ("k", k, "(B, Hkv, S, D)")]
    if v is not None:
        named.append(("v", v, "(B, Hkv, S, Dv)"))
    for name, t, layout in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layout}; received {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout}; received shape {shape_str(t)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor; received dtype {t.dtype}")
    B, H, T, D = q.shape
    v = k if v is None else v  # only q and k to compare
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"batch sizes differ: q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}; dim 0 must match"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads Hkv; received k {shape_str(k)}, v {shape_str(v)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same key length S; received k {shape_str(k)}, v {shape_str(v)}")
    if k.shape[3] != D:
        raise ValueError(f"q and k must have the same head dim D; received q {shape_str(q)}, k {shape_str(k)}")
    Hkv = k.shape[1]
    check_divisible("query heads H", H, "key/value heads Hkv", Hkv)
    # compared here first: the shared check builds its message, which a good call never needs
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        check_same_dtype_device(q=q, k=k, **({} if v is k else {"v": v}))


def normalize_mask(mask, q: Tensor, k: Tensor) -> Tensor | None:
    B, H, T, _ = q.shape
    S = k.shape[2]
    if mask is None:
        return None
    if not isinstance(mask, (Tensor, MaskMod)) and callable(mask):
        mask = MaskMod(mask, getattr(mask, "__name__", "mask_mod"), top_left=True)  # flex's convention
    if isinstance(mask, MaskMod):
        mask.check(B, H, T, S)
        return mask
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"mask must be a bool or float tensor, a multihead.masks predicate, a mask_mod callable, "
            f"or None; received {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = may attend) or floating point (added to the scores); "
            f"received dtype {mask.dtype}. For a 0/1 integer mask use mask.bool()"
        )
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}; move it to {q.device}")
    if mask.dim() == 3:
        raise ValueError(
            f"a 3-D mask {shape_str(mask)} is ambiguous: (B, T, S) or (H, T, S)? Pass it 4-D: "
            f"mask[:, None] for (B, 1, T, S) or mask[None] for (1, H, T, S)"
        )
    if mask.dim() == 2 and B == T and B > 1 and tuple(mask.shape) == (T, S):
        raise ValueError(
            f"a 2-D mask {shape_str(mask)} is ambiguous when B == T ({B}): a (T, S) attention mask "
            f"or a (B, S) key-padding mask? Pass mask[None, None] for (T, S), or "
            f"multihead.masks.padding(keep=mask) for a (B, S) keep-mask"
        )
    if mask.dim() > 4 or mask.dim() == 0:
        raise ValueError(f"mask must have 1, 2 or 4 dims broadcastable to (B, H, T, S) = "
                         f"({B}, {H}, {T}, {S}); received shape {shape_str(mask)}")
    mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    try:
        shape = torch.broadcast_shapes(mask4.shape, (B, H, T, S))
    except RuntimeError:
        shape = None
    if shape != (B, H, T, S):
        hint = ""
        if mask.dim() == 2 and mask.shape[0] == B:
            hint = "; if this is a (B, S) key-padding mask, use multihead.masks.padding(keep=mask)"
        raise ValueError(
            f"mask of shape {shape_str(mask)} is not broadcastable to (B, H, T, S) = "
            f"({B}, {H}, {T}, {S}){hint}"
        )
    if mask4.is_floating_point() and mask4.dtype != q.dtype:
        mask4 = mask4.to(q.dtype)
    return mask4


def weight_heads(return_weights, H: int) -> tuple[int, ...] | None:
    if return_weights is False or return_weights is None:
        return None
    if return_weights is True:
        return tuple(range(H))
    if isinstance(return_weights, (str, bytes)) or not isinstance(return_weights, Sequence):
        if isinstance(return_weights, Tensor) and return_weights.dim() <= 1:
            return_weights = return_weights.reshape(-1).tolist()
        else:
            raise TypeError(
                f"return_weights must be a bool or a sequence of head indices; "
                f"received {type(return_weights).__name__}"
            )
    heads = []
    for h in return_weights:
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"weight head indices must be ints; received {h!r}")
        if not -H <= h < H:
            raise ValueError(f"weight head index {h} out of range; valid: 0..{H - 1} (H = {H})")
        heads.append(h % H)
    if not heads:
        raise ValueError("return_weights is an empty sequence; pass False for no weights")
    return tuple(heads)
