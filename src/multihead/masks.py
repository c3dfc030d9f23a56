"""Attention masks as predicates, the way torch.nn.attention.flex_attention writes them.

A mask is a function `mask_mod(b, h, q_idx, kv_idx) -> bool tensor`, True where query
`q_idx` of batch `b`, head `h` may attend key `kv_idx`. Predicates combine with `&`,
`|` (or `and_masks` / `or_masks`) and are materialised by `to_dense` only at the shape
they are used with, broadcasting over the dimensions they ignore: `causal()` becomes
`(1, 1, T, S)`, `padding(lengths)` becomes `(B, 1, 1, S)`.

Query positions are aligned bottom-right: a predicate sees `q_idx` as the absolute
position of the query among the S keys, `q_idx = i + (S - T)` for query row i, so the
same `causal()` is right for a full forward (S == T) and for decoding over a cache
(S > T). `multihead.scaled_dot_product_attention` accepts a predicate as its `mask`.

nn.MultiheadAttention's masks use the opposite convention (True = ignore); convert
them here with `from_key_padding_mask` / `from_torch_attn_mask` and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "MaskMod",
    "and_masks",
    "causal",
    "from_key_padding_mask",
    "from_torch_attn_mask",
    "or_masks",
    "padding",
    "sliding_window",
    "to_dense",
]


class MaskMod:
    """A named mask predicate `(b, h, q_idx, kv_idx) -> bool tensor` (True = may attend)."""

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], name: str):
        self.fn = fn
        self.name = name

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx)

    def __and__(self, other: MaskMod) -> MaskMod:
        return and_masks(self, other)

    def __or__(self, other: MaskMod) -> MaskMod:
        return or_masks(self, other)

    def __repr__(self) -> str:
        return f"MaskMod({self.name})"

    def to_dense(self, B: int, H: int, T: int, S: int, device=None) -> Tensor:
        return to_dense(self, B, H, T, S, device=device)


def _check_mods(mods, what):
    if not mods:
        raise ValueError(f"{what} needs at least one mask; received none")
    for m in mods:
        if not isinstance(m, MaskMod):
            raise TypeError(f"{what} combines multihead.masks predicates; received {type(m).__name__}")


def and_masks(*mods: MaskMod) -> MaskMod:
    """May attend where every mask allows."""
    _check_mods(mods, "and_masks")

    def fn(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out & m(b, h, q, kv)
        return out

    return MaskMod(fn, " & ".join(m.name for m in mods))


def or_masks(*mods: MaskMod) -> MaskMod:
    """May attend where any mask allows."""
    _check_mods(mods, "or_masks")

    def fn(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out | m(b, h, q, kv)
        return out

    return MaskMod(fn, "(" + " | ".join(m.name for m in mods) + ")")


def causal() -> MaskMod:
    """Query at position p sees keys at positions <= p (bottom-right aligned)."""
    return MaskMod(lambda b, h, q, kv: kv <= q, "causal")


def sliding_window(window: int) -> MaskMod:
    """Causal, and at most `window` keys back including the query's own position
    (Mistral / Gemma-2 local layers): 0 <= q - kv < window."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int; received {window!r}")
    return MaskMod(lambda b, h, q, kv: (kv <= q) & (q - kv < window), f"sliding_window({window})")


def padding(lengths: Tensor | None = None, *, keep: Tensor | None = None) -> MaskMod:
    """Key padding: batch b attends only keys `kv < lengths[b]`, or where `keep[b, kv]`.

    Give exactly one of `lengths` (int tensor `(B,)`) or `keep` (bool tensor `(B, S)`,
    True = a real token). For nn.MultiheadAttention's inverted `key_padding_mask`
    use `from_key_padding_mask`.
    """
    if (lengths is None) == (keep is None):
        raise ValueError("padding takes exactly one of lengths=(B,) or keep=(B, S); "
                         f"received lengths={'set' if lengths is not None else None}, "
                         f"keep={'set' if keep is not None else None}")
    if lengths is not None:
        if not isinstance(lengths, Tensor) or lengths.dim() != 1 or lengths.is_floating_point() \
                or lengths.dtype == torch.bool:
            got = f"shape {tuple(lengths.shape)} {lengths.dtype}" if isinstance(lengths, Tensor) \
                else type(lengths).__name__
            raise ValueError(f"lengths must be a 1-D integer tensor (B,); received {got}")
        if (lengths < 0).any():
            raise ValueError(f"lengths must be >= 0; received {lengths.tolist()}")
        return MaskMod(lambda b, h, q, kv: kv < lengths[b], "padding(lengths)")
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
        got = f"shape {tuple(keep.shape)} {keep.dtype}" if isinstance(keep, Tensor) else type(keep).__name__
        raise ValueError(f"keep must be a 2-D bool tensor (B, S), True = real token; received {got}")

    def fn(b, h, q, kv):
        if kv.shape[-1] != keep.shape[1]:
            raise ValueError(f"keep-mask has S = {keep.shape[1]} keys but attention has {kv.shape[-1]}")
        return keep[b, kv]

    return MaskMod(fn, "padding(keep)")


def to_dense(mask_mod: MaskMod, B: int, H: int, T: int, S: int, device=None) -> Tensor:
    """Materialise a predicate as a bool tensor broadcastable to `(B, H, T, S)`.

    Dimensions the predicate ignores stay of size 1: `causal()` gives `(1, 1, T, S)`.
    """
    if not isinstance(mask_mod, MaskMod):
        raise TypeError(f"to_dense takes a multihead.masks predicate; received {type(mask_mod).__name__}")
    for name, n in (("B", B), ("H", H), ("T", T), ("S", S)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int; received {n!r}")
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = torch.arange(T, device=device).view(1, 1, T, 1) + (S - T)  # bottom-right positions
    kv = torch.arange(S, device=device).view(1, 1, 1, S)
    out = mask_mod(b, h, q, kv)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        raise TypeError(f"mask predicate {mask_mod.name} must return a bool tensor")
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))


def from_key_padding_mask(key_padding_mask: Tensor) -> Tensor:
    """nn.MultiheadAttention's `key_padding_mask` `(B, S)` -> a multihead mask `(B, 1, 1, S)`.

    torch's bool form means True = *ignore*; multihead's means True = may attend, so the
    bool form is inverted. A float form is added to the scores in both, so it is kept.
    """
    kpm = key_padding_mask
    if not isinstance(kpm, Tensor) or kpm.dim() != 2:
        got = f"shape {tuple(kpm.shape)}" if isinstance(kpm, Tensor) else type(kpm).__name__
        raise ValueError(f"key_padding_mask must be a 2-D tensor (B, S); received {got}")
    if kpm.dtype == torch.bool:
        return (~kpm)[:, None, None, :]
    if kpm.is_floating_point():
        return kpm[:, None, None, :]
    raise TypeError(f"key_padding_mask must be bool (True = ignore) or float; received {kpm.dtype}")


def from_torch_attn_mask(attn_mask: Tensor, n_heads: int | None = None) -> Tensor:
    """nn.MultiheadAttention's `attn_mask` -> a multihead mask.

    `(T, S)` becomes `(1, 1, T, S)`; the 3-D `(B * n_heads, T, S)` form becomes
    `(B, n_heads, T, S)` (pass n_heads). Bool is inverted (torch: True = ignore).
    """
    m = attn_mask
    if not isinstance(m, Tensor):
        raise TypeError(f"attn_mask must be a tensor; received {type(m).__name__}")
    if m.dtype == torch.bool:
        m = ~m
    elif not m.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = ignore) or float; received {m.dtype}")
    if m.dim() == 2:
        return m[None, None]
    if m.dim() == 3:
        if n_heads is None or m.shape[0] % n_heads:
            raise ValueError(f"a 3-D attn_mask {tuple(m.shape)} is (B * n_heads, T, S); pass n_heads "
                             f"dividing {m.shape[0]}; received n_heads={n_heads}")
        return m.view(m.shape[0] // n_heads, n_heads, *m.shape[1:])
    raise ValueError(f"attn_mask must be 2-D (T, S) or 3-D (B * n_heads, T, S); received {tuple(m.shape)}")
