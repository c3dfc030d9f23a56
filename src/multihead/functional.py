"""The attention kernel: `scaled_dot_product_attention` (the output), `attend` (the output
and, when asked, the weights) and their backend registry.

softmax(Q K^T * scale + mask) V, for q `(B, H, T, D)` and k, v `(B, Hkv, S, D|Dv)` with
H a multiple of Hkv (GQA; Hkv == 1 is MQA). Every backend is a plain function with one
signature (`kernels.registry.Backend`): "math" (written out, `kernels/math.py`), "sdpa"
(torch's fused kernel, block-sparse for predicates), "chunked" (math over blocks of
queries), "tiles" (FlashAttention-2 style, any score mod, O(N) memory) and the opt-in
"flex". This module is their public face: the input checks, "auto", empty inputs, the
plain call's short way and the NaN rule; the backends are registered by
`kernels/backends.py`. The rules every backend keeps (masks, the NaN rule, the gradient
rule, aliasing, empty problems): docs/kernel.md, "The rules every backend keeps".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import multihead.kernels.backends  # noqa: F401  (registers the built-in backends: math, sdpa, chunked, tiles, flex)
from multihead.kernels import band as _band
from multihead.kernels import math as explicit_math  # weights_pass read at call time: the tests spy on it
from multihead.kernels import native as _native
from multihead.kernels.common import index
from multihead.kernels.decode import step as _decode_step
from multihead.kernels.math import block_rows as _block_rows
from multihead.kernels.math import rows_mask as _rows_mask
from multihead.kernels.registry import (
    BACKENDS,
    Backend,
    available_backends,
    check_backend_name,
    register_backend,
    resolve_backend,
)
from multihead.kernels.registry import get_backend as _get_backend
from multihead.kernels.sdpa import plain_applies as _plain_applies
from multihead.kernels.sdpa import sdpa as _sdpa_backend
from multihead.kernels.validation import check_inputs as _check_inputs
from multihead.kernels.validation import check_scale as _check_scale
from multihead.kernels.validation import check_score_mod as _check_score_mod
from multihead.kernels.validation import is_plain_call as _is_plain_call
from multihead.kernels.validation import plain_shape as _plain_shape
from multihead.kernels.validation import weight_heads as _weight_heads
from multihead.masks import MaskMod, and_masks
from multihead.masks import causal as causal_mod
from multihead.score_mods import ScoreMod

__all__ = [
    "Backend",
    "attend",
    "attention_weights",
    "available_backends",
    "check_backend_name",
    "clear_caches",
    "decode_step",
    "register_backend",
    "resolve_backend",
    "scaled_dot_product_attention",
]


def clear_caches() -> dict:
    """Drop what the engines keep from call to call, for memory or a clean timing: the block-sparse
    engine's plans, their masks and the memory of its last outputs (up to 2 of 4-128 MiB, reused
    by the next call of their shape once the caller has dropped them), and the "flex" backend's
    block masks and score functions (its compiled kernels stay in torch's cache). Nothing a caller
    holds is touched: an output still referenced stays the caller's.

    Returns `{"plans": n, "outputs": n, "output_bytes": bytes given back now}`; the next calls
    plan and allocate afresh (the first call of a long sliding window plans for ~20 ms).
    """
    import sys

    from multihead.kernels import fused_tiles, planner

    outputs, freed = fused_tiles.clear()
    plans = planner.clear_plans()
    flex = sys.modules.get("multihead.kernels.flex")  # not imported: nothing of it is kept
    if flex is not None:
        flex.clear_cache()
    return {"plans": plans, "outputs": outputs, "output_bytes": freed}


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | MaskMod | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    score_mod: ScoreMod | Callable | None = None,
) -> Tensor:
    """Multi-head scaled dot-product attention with GQA/MQA, masks and score mods.

    Returns out `(B, H, T, Dv)`, always a tensor; `attend` takes the same arguments and
    `return_weights`, and returns `(out, weights)`. Arguments as in `attend`.
    """
    return attend(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, backend=backend,
                  score_mod=score_mod)[0]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | MaskMod | Callable | None = None, *,
           causal: bool = False, scale: float | None = None, dropout_p: float = 0.0,
           return_weights: bool | Sequence[int] = False, backend: str = "auto",
           score_mod: ScoreMod | Callable | None = None,
           sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Multi-head scaled dot-product attention with GQA/MQA, masks, score mods and weights.

    Args:
        q: queries `(B, H, T, D)`.
        k: keys `(B, Hkv, S, D)`, H a multiple of Hkv.
        v: values `(B, Hkv, S, Dv)`.
        mask: bool (True = may attend) or float (added to the scores) tensor
            broadcastable to `(B, H, T, S)`; 1-D is read as `(S,)`, 2-D as `(T, S)`;
            3-D is refused as ambiguous. Or a predicate: a `multihead.masks` MaskMod
            (q_idx bottom-right aligned), or a flex_attention `mask_mod(b, h, q_idx,
            kv_idx)` callable (q_idx from the top-left, as flex reads it); predicates
            run block-sparse, never building `(T, S)`.
        causal: query i may attend key j <= i + S - T (bottom-right aligned, as decoding
            with a cache needs). Combined with `mask` by logical and.
        scale: multiplies the scores; default 1 / sqrt(D).
        dropout_p: dropout on the attention probabilities, applied whenever > 0 (the
            modules pass 0 in eval mode).
        return_weights: False; True for the weights of every head; or a sequence of
            query-head indices, whose weights alone are computed. Weights are for
            looking at: from "auto"/"sdpa"/"tiles" they come from a separate no-grad pass
            and carry no gradient; backend="math" or "chunked" returns differentiable
            weights (for a loss on the attention pattern).
        backend: "auto" or a name from `available_backends()`.
        score_mod: `score_mod(score, b, h, q_idx, kv_idx) -> score` applied to the scaled
            scores before the mask (flex_attention's signature; see
            `multihead.score_mods` for softcap and ALiBi).
        sinks: attention sinks (GPT-OSS): one more logit per row, with no value; `(H,)` or
            broadcastable to `(B, H, T, 1)`; on "math" and "chunked" ("auto": "math").

    Returns:
        `(out, weights)`, always a pair: out `(B, H, T, Dv)`; weights `(B, h, T, S)` for
        the h heads asked (the softmax probabilities before dropout), None when
        return_weights is False. Rows with no key to attend are zero in both.
    """
    impl = shape = None
    if sinks is None and _is_plain_call(mask, scale, dropout_p, return_weights, score_mod) \
            and (shape := _plain_shape(q, k, v)) is not None:
        # The plain call (a decode step or a causal prefill: no mask, mod, weights, dropout or
        # sinks), the general path's checks folded into two expressions: what it resolves to
        # is the same ("auto" is "sdpa" here), so is the result, bit for bit, but where a long
        # step runs on an engine the machine timed faster, the GEMMs or the native kernel
        # (`kernels.decode.engine`): equal to rounding there, and bit for bit again with the
        # plan's decode_engine "flash".
        impl = BACKENDS.get("sdpa" if backend == "auto" else backend)
        weight_heads, causal = None, bool(causal)
        if impl is not None and impl.fn is _sdpa_backend and 0 not in shape \
                and (shape[2] == 1 or _plain_applies(q, k, v, causal)):  # (one query: no causality to apply)
            # ... and on the built-in "sdpa", its plain form, with the keys split over the
            # threads where they would idle (`kernels.decode`)
            return _plain(impl, q, k, v, scale, causal), None
    if impl is None:
        scale = _check_scale(scale)
        mask = _check_inputs(q, k, v, mask, scale, dropout_p)
        score_mod = _check_score_mod(score_mod, q, k)
        sinks = _check_sinks(sinks, q)
        weight_heads = _weight_heads(return_weights, q.shape[1])
        causal = bool(causal)
        if isinstance(mask, MaskMod) and causal:
            mask, causal = and_masks(mask, causal_mod()), False
        shape = (*q.shape[:3], k.shape[2])  # (B, H, T, S)
        name = backend
        if backend == "auto":
            name = resolve_backend(want_weights=weight_heads is not None, dropout_p=dropout_p, score_mod=score_mod,
                                   device=q.device, queries=q.shape[2], shape=shape, sinks=sinks is not None)
        impl = _get_backend(name, want_weights=weight_heads is not None, dropout_p=dropout_p, score_mod=score_mod,
                            sinks=sinks is not None)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if 0 in shape:
        out, weights = _empty(q, k, v, weight_heads)
    else:
        out, weights = _run(impl, q, k, v, mask, causal, scale, dropout_p, weight_heads, score_mod, sinks)
        if not torch.compiler.is_compiling() and _any_nan(q, k, v, out):
            out, weights = _nan_rule(impl, q, k, v, mask, causal, scale, dropout_p, weight_heads, score_mod, sinks)
    return out, weights


def _plain(impl: Backend, q: Tensor, k: Tensor, v: Tensor, scale: float | None, causal: bool) -> Tensor:
    """The plain call on the built-in "sdpa" (`impl`): `kernels.decode.step`, and the NaN rule
    where the look at the output's rows (`_nan_or_zero_row`) and the sums say it may act."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, seen = _decode_step(q, k, v, scale, causal)  # seen: what holds every row the kernel made, None: looked at
    if seen is not None and not torch.compiler.is_compiling() and _nan_or_zero_row(seen) \
            and _not_finite(q, k, v, seen):
        out, _ = _nan_rule(impl, q, k, v, None, causal, scale, 0.0, None, None)
    return out


def decode_step(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor | None:
    """`attend(q, k, v, scale=scale)[0]` for one query (T = 1) with nothing else asked (no mask,
    score mod, weights, dropout or sinks; backend "auto"), which the caller knows: the same
    checks, kernel and answer without `attend`'s argument handling, for a caller that pays
    for every microsecond of every layer of every token (the HF attention function's decode
    step). `scale` must pass `validation.plain_scale`. None where the tensors are not such a
    step (a shape, dtype or device `attend` would name, T != 1, an empty dim, "sdpa"
    registered anew): the caller then calls `attend`, which answers or says what is wrong."""
    shape = _plain_shape(q, k, v)
    if shape is None or shape[2] != 1 or 0 in shape:
        return None
    impl = BACKENDS.get("sdpa")
    if impl is None or impl.fn is not _sdpa_backend:
        return None
    return _plain(impl, q, k, v, scale, False)


def _run(impl: Backend, q, k, v, mask, causal, scale, dropout_p, weight_heads, score_mod, sinks=None):
    """Call a backend with only the keywords it declared."""
    if isinstance(mask, MaskMod) and not impl.predicates:
        B, H, T, _ = q.shape
        mask = mask.to_dense(B, H, T, k.shape[2], device=q.device)
    kw = {} if impl.score_mods == "none" else {"score_mod": score_mod}
    if sinks is not None:
        kw["sinks"] = sinks
    return impl.fn(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, weight_heads=weight_heads, **kw)


def _check_sinks(sinks, q: Tensor) -> Tensor | None:
    """Sink logits broadcastable to `(B, H, T, 1)`: a per-head `(H,)` (GPT-OSS) or a 4-D tensor."""
    if sinks is None:
        return None
    B, H, T, _ = q.shape
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a tensor (H,) or (B, H, T, 1); received {type(sinks).__name__}")
    if sinks.dim() == 1 and sinks.shape[0] == H:
        return sinks.view(1, H, 1, 1)
    if sinks.dim() == 4 and sinks.shape[-1] == 1 and all(n in (1, m) for n, m in zip(sinks.shape[:3], (B, H, T))):
        return sinks
    raise ValueError(f"sinks must have shape (H,) = ({H},) or broadcast to (B, H, T, 1) = ({B}, {H}, {T}, 1); "
                     f"received {tuple(sinks.shape)}")


def _empty(q, k, v, weight_heads):
    """B, H, T or S is 0: empty outputs, or zeros (S = 0: no key to attend), of the right shape.

    The result stays connected to q, k and v (through a sum over nothing) so that a
    backward through it gives zero gradients instead of an error.
    """
    B, H, T, _ = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    tie = q.flatten()[:0].sum() + k.flatten()[:0].sum() + v.flatten()[:0].sum()  # 0, with a grad_fn
    out = q.new_zeros(B, H, T, Dv) + tie
    weights = None if weight_heads is None else q.new_zeros(B, len(weight_heads), T, S) + tie
    return out, weights


_NAN_CHECK_ROWS = 16  # from this many queries on, the general path's NaN check reads K and V too
_NAN_CHECK_LIST = 64  # up to this many rows of `out`, the row check reads their sums back as a list


def _any_nan(q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> bool:
    """Whether the NaN rule may have to act, read from the inputs, never from what the fused
    kernel did with a NaN (torch's CPU kernel zeroes a row whose every score is NaN: a NaN
    query on some CPUs, a NaN in every key a row sees on all).

    From 16 queries on: q, k, v and out are summed and any sum that is not finite acts
    (`_not_finite`). Fewer (decoding, with a mask), where reading K and V would cost as much
    as the attention: the rows of `out` first (`_nan_or_zero_row`), then, only if one is NaN
    or zero (a NaN, a row the mask leaves empty, or, rarely, a row whose values cancel), the
    sums. A plain call (no mask: no row is empty) reads the rows at every length.
    """
    if _band.looked_clean(out):  # the native band kernel looked at every row of it itself
        return False
    if q.shape[2] < _NAN_CHECK_ROWS and not _nan_or_zero_row(out):
        return False
    return _not_finite(q, k, v, out)


def _nan_or_zero_row(out: Tensor) -> bool:
    """Whether a row of `out` (along its last dim) holds a NaN or is exactly zero: a row whose
    every score is NaN comes out of any kernel NaN or exactly zero, and a NaN survives any
    sum, so False means the rule has nothing to do where every row may attend some key;
    True sends the caller to `_not_finite`. Read in memory order (torch's CPU kernel writes
    a prefill's out `(B, T, H, Dv)`), with one reduction and one read-back: up to 64 rows,
    their sums as a Python list (a C loop finds a zero or a NaN in it; the sum over the 2-D
    rows costs half the same sum over a 4-D view inside `generate`, where every op runs with
    cold caches: benchmarks/hf_generate.py); more, the sum of all (a NaN anywhere) and the
    count of nonzero first elements (a zero row has a zero first element): a reduction
    along rows of 64 costs more than the two together. float32 rows on the CPU, where the
    native library is built (`kernels.native`), are read in C instead: a row not finite or
    zero throughout, with no tensor op's dispatch, which was most of what a decode step's check cost
    (docs/benchmarks.md, "The native decode engine")."""
    o = out.detach() if out.requires_grad else out
    if not o.is_contiguous() and o.dim() == 4:
        t = o.transpose(1, 2)  # the same rows, in the order they lie: a view
        o = t if t.is_contiguous() else o
    if o.dtype == torch.float32 and o.is_cpu and o.is_contiguous() and (n := o.shape[-1]) \
            and (lib := _native.library()) is not None:  # the same look in C, with no op to dispatch
        return bool(lib.mh_bad_rows(o.data_ptr(), o.numel() // n, n, n))
    rows = o.flatten(0, -2)  # (rows, Dv)
    if len(rows) <= _NAN_CHECK_LIST:
        sums = rows.sum(-1).tolist()  # NaN: a NaN in the row; 0: zero
        total = sum(sums)
        return total != total or 0.0 in sums  # (NaN != NaN)
    if rows.shape[-1] == 0:
        return True
    total = float(rows.sum())
    return total != total or int(torch.count_nonzero(rows[:, 0])) < len(rows)


def _not_finite(q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> bool:
    """Whether a sum of q, k, v or out is not finite: NaN always survives a sum; an infinity
    too, or turns into NaN: an input holding one takes the exact recomputation, as a key
    scoring -inf must where a split kernel would weigh it. One host sync."""
    acc = torch.promote_types(q.dtype, torch.float32)
    return not bool(torch.stack([t.sum(dtype=acc) for t in (q, out, k, v)]).isfinite().all())


def _nan_rule(impl, q, k, v, mask, causal, scale, dropout_p, weight_heads, score_mod, sinks=None):
    """Recompute with NaNs replaced by 0, then make NaN exactly the rows the rule names.

    Rows (b, h, t) that may attend some key and whose query, or an attended key (or, for
    the output, value), holds a NaN. Rare and only on bad data, so written for clarity.
    """
    B, H, T, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    nan_q = torch.isnan(q).any(-1)  # (B, H, T)
    nan_k = torch.isnan(k).any(-1).repeat_interleave(G, dim=1)  # (B, H, S)
    nan_v = torch.isnan(v).any(-1).repeat_interleave(G, dim=1)
    clean = [torch.where(torch.isnan(t), 0.0, t) for t in (q, k, v)]
    out, weights = _run(impl, *clean, mask, causal, scale, dropout_p, weight_heads, score_mod, sinks)
    sees_k = torch.zeros(B, H, T, dtype=torch.bool, device=q.device)
    sees_v, sees_any = sees_k.clone(), sees_k.clone()
    rows = _block_rows(B, H, S)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        allowed, bias = _rows_mask(mask, causal, t0, t1, T, S, q.device, index(B, 0, q.device),
                                   index(H, 1, q.device))
        ok = torch.ones(1, 1, t1 - t0, S, dtype=torch.bool, device=q.device)
        if allowed is not None:
            ok = ok & allowed
        if bias is not None:
            ok = ok & ~torch.isneginf(bias)
        ok = ok.expand(B, H, t1 - t0, S)
        sees_any[:, :, t0:t1] = ok.any(-1)
        sees_k[:, :, t0:t1] = (ok & nan_k[:, :, None, :]).any(-1)
        sees_v[:, :, t0:t1] = (ok & nan_v[:, :, None, :]).any(-1)
    nan = torch.tensor(float("nan"), dtype=out.dtype, device=out.device)
    out = torch.where((sees_any & (nan_q | sees_k | sees_v))[..., None], nan, out)
    if weights is not None:
        w_rows = (sees_any & (nan_q | sees_k))[:, list(weight_heads)]
        weights = torch.where(w_rows[..., None], nan, weights)
    return out, weights


def attention_weights(
    q: Tensor,
    k: Tensor,
    mask: Tensor | MaskMod | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    heads: Sequence[int] | None = None,
) -> Tensor:
    """softmax(Q K^T * scale + mask) for the query heads in `heads` (default all).

    Computed head by head over blocks of queries, so the memory used beyond the
    result `(B, len(heads), T, S)` stays bounded whatever T and S are.
    """
    H = q.shape[1] if q.dim() == 4 else 0
    scale = _check_scale(scale)
    mask = _check_inputs(q, k, None, mask, scale, 0.0)
    heads = _weight_heads(True if heads is None else heads, H)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if min(q.shape[0], q.shape[2], k.shape[2]) == 0:
        return q.new_zeros(q.shape[0], len(heads), q.shape[2], k.shape[2])
    return explicit_math.weights_pass(q, k, mask, bool(causal), scale, heads)
