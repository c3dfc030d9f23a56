"""The "sdpa" backend: torch's fused `F.scaled_dot_product_attention`, with bottom-right
causal, GQA without copying K/V, predicates and additive score mods block-sparse
(`fused_tiles`), weights on demand from the memory-bounded weights pass over the heads
asked for (`kernels.math.weights_pass`), and exact second derivatives (`SecondOrder`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.kernels import band, fused_tiles
from multihead.kernels import math as explicit_math  # weights_pass read at call time: the tests spy on it
from multihead.kernels.common import mqa_splits
from multihead.kernels.explicit_tiles import twice
from multihead.masks import MaskMod
from multihead.masks import causal as causal_mod

__all__ = ["SecondOrder", "plain", "plain_applies", "sdpa", "twice_differentiable"]


def sdpa(q, k, v, mask, *, causal, scale, dropout_p, weight_heads, score_mod=None):
    """torch's fused kernel, with bottom-right causal and GQA without copying K/V.

    Predicates and additive score mods run block-sparse (`kernels.fused_tiles`); so does
    bottom-right causal with 1 < T != S, which torch's `is_causal` would align top-left.
    """
    B, H, T, _ = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    if causal and mask is None and 1 < T != S:
        mask, causal = causal_mod(), False
    if isinstance(mask, MaskMod) or score_mod is not None:
        def fused(qq, kk, vv):
            return fused_tiles.fused(qq, kk, vv, mask, causal=causal, scale=scale, dropout_p=dropout_p,
                                     score_mod=score_mod)

        out = None
        rel = mask & causal_mod() if causal and isinstance(mask, MaskMod) else mask  # (attend folds it already)
        if band.applies(q, k, v, rel, score_mod, dropout_p):  # multihead's own kernel, where it is the faster
            out = band.run(q, k, v, rel, scale, fused)
        if out is None:
            out = fused(q, k, v)
        weights = None
        if weight_heads is not None:
            weights = explicit_math.weights_pass(q, k, mask, causal, scale, weight_heads, score_mod=score_mod)
        return twice_differentiable(out, q, k, v, mask, causal, scale, dropout_p, score_mod), weights
    is_causal = False
    attn_mask = mask
    if causal:
        if T == S and mask is None:
            is_causal = True  # top-left == bottom-right when T == S
        elif T == 1 and S >= 1:
            pass  # the one query sits at the last position and sees every key
        else:
            allowed, _ = explicit_math.rows_mask(None, True, 0, T, T, S, q.device)
            allowed = allowed[None, None]  # (1, 1, T, S)
            if mask is None:
                attn_mask = allowed
            elif mask.dtype == torch.bool:
                attn_mask = mask & allowed
            else:
                attn_mask = mask.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)

    def call(qq, mm, kk=k, vv=v):
        return F.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=mm, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )

    if G == 1:
        out = call(q, attn_mask)
    elif not is_causal and (attn_mask is None or attn_mask.shape[1] == attn_mask.shape[2] == 1):
        # Fold each group's query heads into the query length: (B, Hkv, G*T, D). A mask
        # that varies by neither head nor query broadcasts over the folded length.
        P = mqa_splits(B, Hkv, G, q.device)
        if P == 1:
            out = call(q.reshape(B, Hkv, G * T, -1), attn_mask)
        else:
            # torch's CPU kernel parallelises over (B, heads) only: MQA folded into one
            # head would run on one core. Split the folded queries over P heads that all
            # read the one K/V head through a stride-0 view (no copy).
            out = call(q.reshape(B, P, G // P * T, -1), attn_mask,
                       k.expand(B, P, S, k.shape[-1]), v.expand(B, P, S, Dv))
        out = out.view(B, H, T, Dv)
    elif is_causal and attn_mask is None and dropout_p == 0 and not (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # Causal GQA without a mask or gradient: torch's CPU kernel reads each K/V head for
        # its G query heads itself (no copy; the same bits as the loop below, one call
        # instead of G, faster on a prefill). Its
        # backward sums the group in another order, so a recorded graph keeps the loop.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # The mask or causality depends on the query row: one fused call per position in
        # the group, each reading K/V once, still without a copy of them.
        out = q.new_empty(B, H, T, Dv)
        q5 = q.unflatten(1, (Hkv, G))  # (B, Hkv, G, T, D)
        out5 = out.unflatten(1, (Hkv, G))  # (B, Hkv, G, T, Dv)
        m5 = None
        if attn_mask is not None and attn_mask.shape[1] == H:
            m5 = attn_mask.unflatten(1, (Hkv, G))
        for g in range(G):
            mg = attn_mask if m5 is None else m5[:, :, g]
            out5[:, :, g] = call(q5[:, :, g], mg)
    weights = None
    if weight_heads is not None:
        weights = explicit_math.weights_pass(q, k, mask, causal, scale, weight_heads)
    return twice_differentiable(out, q, k, v, mask, causal, scale, dropout_p, None), weights


def plain(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False) -> Tensor:
    """`sdpa(q, k, v, None, causal=causal, scale=scale, dropout_p=0.0, weight_heads=None)[0]`
    for the calls `plain_applies` accepts, on non-empty inputs `functional.attend` has
    checked: the same calls of torch's kernel, the same bits, without `sdpa`'s branches for
    masks, mods and weights. A decode step runs it once per layer per token, a prefill once
    per layer, where every Python line and torch op shows."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if causal and T > 1:  # T == S: torch's top-left causality is multihead's bottom-right
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=Hkv != H)
    elif Hkv == H:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    else:
        P = mqa_splits(B, Hkv, H // Hkv, q.device) if Hkv == 1 else 1
        if P == 1:
            out = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv * T, D), k, v, scale=scale)
        else:  # MQA on more threads than batch rows: see `sdpa`
            S, Dv = k.shape[2], v.shape[-1]
            out = F.scaled_dot_product_attention(q.reshape(B, P, H // P * T, D), k.expand(B, P, S, D),
                                                 v.expand(B, P, S, Dv), scale=scale)
        out = out.view(B, H, T, v.shape[-1])
    if out.requires_grad:
        return twice_differentiable(out, q, k, v, None, causal, scale, 0.0, None)
    return out


def plain_applies(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> bool:
    """Whether `plain` computes this call as `sdpa` would (no mask, score mod, weights or
    dropout): causality changes nothing (`causal` False, or one query, which sees every key),
    or T == S, where `sdpa` hands torch's kernel `is_causal` as it is, except GQA under
    autograd, which `sdpa` runs one group position at a time for the gradients' order."""
    T = q.shape[2]
    if not causal or T == 1:
        return True
    return T == k.shape[2] and (q.shape[1] == k.shape[1] or not (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))


class SecondOrder(torch.autograd.Function):
    """Identity on a fused kernel's output, so that a second differentiation is exact.

    torch's fused kernels have backwards that are not differentiable again. A plain backward
    passes the gradient through to the kernel's own backward; under create_graph=True (a
    gradient penalty, Hessian-vector products) the gradients of q, k, v (and of a float mask
    that requires grad) come instead from the written-out path recomputed with the graph,
    and the kernel's node gets none. Costs one autograd node, no memory (q, k, v and the
    mask are saved by the kernel's node already).
    """

    @staticmethod
    def forward(ctx, out, q, k, v, mask, info):
        ctx.save_for_backward(q, k, v, mask)
        ctx.info = info
        # a view, no copy; an in-place edit of the result is refused by autograd, as it already was
        # for the fused kernels, which save their output for the backward
        return out.view_as(out)

    @staticmethod
    def backward(ctx, d_out):
        if not torch.is_grad_enabled():  # the usual backward: the fused kernel's
            return d_out, None, None, None, None, None
        q, k, v, grad_mask = ctx.saved_tensors
        mask, causal, scale, dropout_p, score_mod = ctx.info
        if dropout_p > 0:
            raise ValueError(f"backend 'sdpa' cannot differentiate twice (create_graph=True) with dropout "
                             f"(dropout_p={dropout_p}): torch's kernel draws its dropout inside; backends that "
                             f"can: 'tiles', 'math'")

        def recompute(qq, kk, vv, mm):
            return explicit_math.chunked(qq, kk, vv, mask if mm is None else mm, causal=causal, scale=scale,
                                         dropout_p=0.0, weight_heads=None, score_mod=score_mod)[0]

        # per-slot partial derivatives, exact when q, k, v (or the mask) are one tensor or views of one
        grads = twice(ctx.needs_input_grad[1:5], (q, k, v, grad_mask), d_out, recompute)
        return (None, *grads, None)


def twice_differentiable(out, q, k, v, mask, causal, scale, dropout_p, score_mod):
    """`out` through `SecondOrder` when autograd records the call (skipped under torch.compile)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or not out.requires_grad:
        return out
    grad_mask = mask if isinstance(mask, Tensor) and mask.is_floating_point() and mask.requires_grad else None
    return SecondOrder.apply(out, q, k, v, grad_mask, (mask, causal, scale, dropout_p, score_mod))
