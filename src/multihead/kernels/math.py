"""The explicit paths: matmul, softmax, matmul written out ("math": all queries at once;
"chunked": blocks of queries, memory bounded by one block of scores), and the weights
pass (the softmax of the heads asked for, head by head, blocks of queries) that the
fused backends use to return weights. The readable twin the fused paths are tested
against. The masked softmax they apply is `kernels.common.softmax`, shared with the tile
engines."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.kernels.common import acc_dtype, causal_triangle, fold_scores, fold_values, index, softmax
from multihead.masks import MaskMod

__all__ = ["BLOCK_ELEMENTS", "attend_rows", "block_rows", "chunked", "math_backend", "rows_mask", "weights_pass"]

# Scores kept in memory at once by the block-wise paths (elements of the accumulation
# dtype). 2**24 float32 = 64 MiB.
BLOCK_ELEMENTS = 1 << 24


def rows_mask(mask: Tensor | MaskMod | None, causal: bool, t0: int, t1: int, T: int, S: int,
              device, b: Tensor | None = None, h: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """The (allowed, bias) pair for query rows t0..t1: bool (.., t, S) and float (.., t, S).

    A predicate is evaluated for these rows only, at batch indices `b` and head indices
    `h` (4-D index tensors; all batches / heads of `mask` when None).
    """
    allowed = bias = None
    if isinstance(mask, MaskMod):
        allowed = mask.evaluate(b, h, index(t1 - t0, 2, device, t0), index(S, 3, device), S - T)
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    elif mask is not None:
        rows = mask[..., t0:t1, :] if mask.shape[-2] == T else mask
        if rows.dtype == torch.bool:
            allowed = rows
        else:
            bias = rows
    if causal:
        tri = causal_triangle(t0, t1, T, S, device)  # (t, S)
        allowed = tri if allowed is None else allowed & tri
    return allowed, bias


def block_rows(B: int, H: int, S: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, B * H * S))


def attend_rows(q, k, v, mask, *, causal, scale, dropout_p, weight_heads, block_rows, score_mod=None, sinks=None):
    """matmul-softmax-matmul over blocks of `block_rows` queries (all at once for math).

    GQA: the G query heads that share a K/V head are folded into the query length,
    `(B, H, t, D) -> (B, Hkv, G*t, D)`, so K/V are used as they are, never repeated
    (`kernels.common.fold_scores`, `fold_values`). `sinks`: attention sinks, one logit
    per row broadcastable to `(B, H, T, 1)` (`kernels.common.softmax`).
    """
    B, H, T, _ = q.shape
    S = k.shape[2]
    acc = acc_dtype(q.dtype)
    ka, va = k.to(acc), v.to(acc)  # converted once for all blocks
    b_idx, h_idx, kv_idx = index(B, 0, q.device), index(H, 1, q.device), index(S, 3, q.device)
    outs, weights = [], []
    for t0 in range(0, T, block_rows):
        t1 = min(T, t0 + block_rows)
        t = t1 - t0
        scores = fold_scores(q[:, :, t0:t1], ka, scale)  # (B, H, t, S)
        if score_mod is not None:
            scores = score_mod.apply(scores, b_idx, h_idx, index(t, 2, q.device, t0), kv_idx, S - T)
        allowed, bias = rows_mask(mask, causal, t0, t1, T, S, q.device, b_idx, h_idx)
        sink = None if sinks is None else sinks[..., t0:t1, :] if sinks.shape[-2] == T else sinks
        probs = softmax(scores, allowed, bias, score_mod is not None, sink)  # (B, H, t, S)
        if weight_heads is not None:
            w = probs if weight_heads == tuple(range(H)) else probs[:, list(weight_heads)]
            weights.append(w.to(q.dtype))
        if dropout_p > 0:
            probs = F.dropout(probs, p=dropout_p, training=True)
        outs.append(fold_values(probs, va).to(q.dtype))  # (B, H, t, Dv)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    if weight_heads is None:
        return out, None
    return out, weights[0] if len(weights) == 1 else torch.cat(weights, dim=2)


def math_backend(q, k, v, mask, *, causal, scale, dropout_p, weight_heads, score_mod=None, sinks=None):
    return attend_rows(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p,
                       weight_heads=weight_heads, block_rows=max(1, q.shape[2]), score_mod=score_mod, sinks=sinks)


def chunked(q, k, v, mask, *, causal, scale, dropout_p, weight_heads, score_mod=None, sinks=None):
    B, H, _, _ = q.shape
    return attend_rows(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p,
                       weight_heads=weight_heads, block_rows=block_rows(B, H, k.shape[2]), score_mod=score_mod,
                       sinks=sinks)


def weights_pass(q, k, mask, causal, scale, heads, *, score_mod=None):
    """Weights of the query heads in `heads` only, one head at a time, blocks of queries."""
    B, H, T, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    acc = acc_dtype(q.dtype)
    rows = block_rows(B, 1, S)
    result = q.new_empty(B, len(heads), T, S)
    b_idx, kv_idx = index(B, 0, q.device), index(S, 3, q.device)
    with torch.no_grad():
        for i, h in enumerate(heads):
            kt = k[:, h // G].to(acc).transpose(-2, -1)  # (B, D, S)
            h_idx = index(1, 1, q.device, h)
            mh = mask
            if isinstance(mask, Tensor):
                mh = mask[:, h if mask.shape[1] == H else 0]  # (B|1, T|1, S|1)
                mh = mh[:, None]
            for t0 in range(0, T, rows):
                t1 = min(T, t0 + rows)
                scores = (q[:, h, t0:t1].to(acc) @ kt)[:, None] * scale  # (B, 1, t, S)
                if score_mod is not None:
                    scores = score_mod.apply(scores, b_idx, h_idx, index(t1 - t0, 2, q.device, t0), kv_idx, S - T)
                allowed, bias = rows_mask(mh, causal, t0, t1, T, S, q.device, b_idx, h_idx)
                result[:, i, t0:t1] = softmax(scores, allowed, bias, score_mod is not None)[:, 0].to(q.dtype)
    return result
