"""The attention formula's one home: the pieces every engine, ring, decode, the stream and
the tiles' recompute call instead of writing their own. `eager` is the formula itself, the
readable twin every engine is tested against. Here: the accumulation dtype, flex's index
tensors, the MQA split over CPU threads, the bottom-right causal triangle, the scores and
values with the G query heads of a K/V head folded (K/V never repeated), the masked scores,
the masked softmax (with attention sinks) and its entropy, the online softmax, the
attention of one block of keys with its log-sum-exp, the probabilities from a log-sum-exp
(as a backward reads it), torch's fused CPU kernel with its log-sum-exp, one log-sum-exp
merge of attentions over disjoint key sets (`merge_two`, FlashAttention's rescaling; in
place and list forms), MLA's one-query step and the softcap formula."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["HAS_CPU_FLASH", "NEG", "acc_dtype", "backward_lse", "block_attention", "cap_scores", "causal_triangle",
           "eager", "flash_lse", "flash_lse_backward", "fold_scores", "fold_values", "index", "lse_merge",
           "lse_merge_into", "masked_scores", "merge_two", "mqa_splits", "one_query_shared_keys", "online_result",
           "online_softmax", "probs_from_lse", "softmax", "softmax_entropy", "with_sinks"]


#: The score of a hidden key where a log-softmax must stay finite: exp(NEG - max) is 0 and p log p = 0 * NEG is 0.
NEG = -1e30


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax are accumulated in float32 at least (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def index(n: int, dim: int, device, start: int = 0) -> Tensor:
    """arange(start, start + n) laid along `dim` of a 4-D index tensor (flex's b, h, q_idx, kv_idx)."""
    shape = [1, 1, 1, 1]
    shape[dim] = n
    return torch.arange(start, start + n, device=device).view(shape)


def mqa_splits(B: int, Hkv: int, G: int, device) -> int:
    """Heads to split a folded MQA call `(B, 1, G*t, D)` over so that every CPU thread has one
    (1: none). torch's CPU kernel parallelises over (B, heads) only, so MQA folded into one
    head would run on one core; the P heads read the one K/V head through a stride-0 view."""
    if Hkv != 1 or torch.device(device).type != "cpu" or torch.compiler.is_compiling():
        return 1
    threads = torch.get_num_threads()
    if B >= threads:
        return 1
    return next((p for p in range(2, G + 1) if G % p == 0 and B * p >= threads), G)


def causal_triangle(t0: int, t1: int, T: int, S: int, device) -> Tensor:
    """Bool `(t1 - t0, S)`: query rows t0..t1 of T may attend key j <= i + S - T (bottom-right)."""
    q_pos = torch.arange(t0, t1, device=device)[:, None] + (S - T)  # absolute positions
    return torch.arange(S, device=device)[None, :] <= q_pos  # (t, S)


def fold_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scores `(B, H, t, S)` in the accumulation dtype of q `(B, H, t, D)` against k
    `(B, Hkv, S, D)`: the G = H / Hkv query heads of a K/V head are folded into the query
    length, `(B, Hkv, G*t, D) @ (B, Hkv, D, S)`, so K is used as it is, never repeated.
    (`.to` is free for a k already in the accumulation dtype: a caller looping over blocks
    of queries converts it once.)"""
    B, H, t, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    scores = q.to(acc).reshape(B, Hkv, (H // Hkv) * t, D) @ k.to(acc).transpose(-2, -1)  # (B, Hkv, G*t, S)
    return scores.view(B, H, t, S) * scale


def fold_values(probs: Tensor, v: Tensor) -> Tensor:
    """probs `(B, H, t, S)` times v `(B, Hkv, S, Dv)` -> `(B, H, t, Dv)` in probs' dtype,
    the G query heads folded as in `fold_scores`."""
    B, H, t, S = probs.shape
    Hkv, Dv = v.shape[1], v.shape[-1]
    out = probs.view(B, Hkv, (H // Hkv) * t, S) @ v.to(probs.dtype)  # (B, Hkv, G*t, Dv)
    return out.view(B, H, t, Dv)


def masked_scores(scores: Tensor, allowed: Tensor | None = None, bias: Tensor | None = None, *,
                  inplace: bool = False) -> Tensor:
    """The scores a softmax reads: `bias` added (a float mask, T5's position bias), -inf where
    `allowed` (bool, True = may attend) is False; every engine's masked softmax starts here.
    `inplace`: `scores` is the caller's own buffer, written over."""
    if bias is not None:
        scores = scores.add_(bias.to(scores.dtype)) if inplace else scores + bias.to(scores.dtype)
    if allowed is not None:
        scores = scores.masked_fill_(~allowed, float("-inf")) if inplace else \
            scores.masked_fill(~allowed, float("-inf"))
    return scores


def with_sinks(scores: Tensor, sinks: Tensor) -> Tensor:
    """The logits of a softmax with attention sinks: one more column, the sink's logit (no value)."""
    return torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)  # (.., S + 1)


def eager(q: Tensor, k: Tensor, v: Tensor, scale: float, allowed: Tensor | None = None, bias: Tensor | None = None,
          sinks: Tensor | None = None, cap: float | None = None) -> tuple[Tensor, Tensor]:
    """The formula, written out once: what every backend computes (HF's `eager_attention_forward`).

    q `(B, H, T, D)`, k `(B, Hkv, S, D)`, v `(B, Hkv, S, Dv)`; `allowed` bool and `bias`
    float broadcastable to `(B, H, T, S)`; `sinks` `(.., T|1, 1)`; `cap`: Gemma 2's softcap on
    the scores. Returns (out `(B, H, T, Dv)`, probs `(B, H, T, S)`), a row with nothing to
    attend all zeros in both."""
    scores = fold_scores(q, k, scale)  # (B, H, T, S): q k^T * scale, each K/V head read by its G query heads
    if cap is not None:
        scores = cap_scores(scores, cap)  # cap * tanh(scores / cap)
    probs = softmax(scores, allowed, bias, sinks=sinks)  # + bias, -inf where not allowed, softmax; empty rows 0
    return fold_values(probs, v).to(q.dtype), probs.to(q.dtype)  # probs @ v, (B, H, T, Dv)


def softmax(scores: Tensor, allowed: Tensor | None = None, bias: Tensor | None = None,
            hidden: bool = False, sinks: Tensor | None = None) -> Tensor:
    """The masked softmax over the last dim every engine applies; a row with nothing to attend
    is all zeros.

    `allowed`: bool, True = may attend; `bias`: added to the scores (`masked_scores`). Without
    the guard a row with nothing to attend is softmax(-inf, ..., -inf) = NaN, and its NaN flows
    into every gradient through the shared K and V. `hidden`: the scores may hold -inf already
    (a score mod may hide pairs too, `where(q_idx == 0, -inf, s)` hides a whole row; or
    the caller filled the hidden pairs), so rows are checked even without a mask.
    `sinks`: attention sinks (GPT-OSS), one extra logit per row broadcastable to
    `(.., t, 1)` in the softmax's denominator, with no value: its probability is dropped.
    """
    scores = masked_scores(scores, allowed, bias)
    if sinks is not None:
        return torch.softmax(with_sinks(scores, sinks), dim=-1)[..., :-1]  # never an empty row: the sink is finite
    if allowed is None and bias is None and not hidden:
        return torch.softmax(scores, dim=-1)
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # rows with no key: 0, not NaN
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
    return probs.masked_fill(empty, 0.0)


def softmax_entropy(scores: Tensor, allowed: Tensor | None = None, bias: Tensor | None = None, hidden: bool = False,
                    sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`softmax` and each row's entropy -sum_j p log p `(..)`, from one log-softmax: p = exp(log p),
    the entropy a dot product of the two, never a log of p (the stream's per-head summaries).
    Arguments as `softmax`; `scores` is the caller's own buffer, written over. Hidden keys
    become the finite `NEG` before the log-softmax, so that p = 0 and p log p = 0 * NEG = 0
    there, not NaN; a row with nothing to attend is zeros with entropy 0."""
    if bias is not None:
        scores = scores + bias.to(scores.dtype)  # a new buffer: the caller's scores stay as they are
    empty = None
    if allowed is not None or bias is not None or hidden:
        scores = masked_scores(scores, allowed, inplace=True)
        if sinks is None:
            empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (.., 1)
        scores = scores.clamp_min_(NEG)
    w = scores.shape[-1]
    if sinks is not None:
        logp = torch.log_softmax(with_sinks(scores, sinks), dim=-1)[..., :w]  # the sink's share dropped
    else:
        logp = torch.log_softmax(scores, dim=-1)
    probs = logp.exp()
    entropy = logp.mul_(probs).sum(-1).neg_()  # in place, no third block-sized buffer
    if empty is not None:
        probs.masked_fill_(empty, 0.0)
        entropy.masked_fill_(empty[..., 0], 0.0)
    return probs, entropy


def probs_from_lse(scores: Tensor, lse: Tensor, out: Tensor | None = None) -> Tensor:
    """exp(scores - lse): the probabilities of the softmax whose log-sum-exp is `lse` (`(.., 1)`,
    as `backward_lse` gives it: a row with no key +inf, so its probabilities are 0). What a block
    engine and every backward recompute from the forward's log-sum-exp; `out`: a buffer to fill."""
    return torch.sub(scores, lse, out=out).exp_()


def online_softmax(scores: Tensor, m: Tensor, l_: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One block of masked scores `(.., s)` into a running softmax (FlashAttention-2, the online
    softmax): the running max `m` and sum `l_` `(.., 1)` (-inf and 0 before the first block).
    Returns (p = exp(scores - new max), written over `scores`; alpha = exp(m - new max), what the
    running output and sum are rescaled by; the new max; the new sum). A row with no key yet
    keeps max -inf and sum 0 (its exp taken against 0, never -inf - -inf)."""
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows with nothing yet
    p = scores.sub_(m_safe).exp_()  # in place: the scores are not needed again
    alpha = torch.exp(m - m_safe)
    return p, alpha, m_new, l_ * alpha + p.sum(-1, keepdim=True)


def online_result(o: Tensor, m: Tensor, l_: Tensor) -> tuple[Tensor, Tensor]:
    """The online softmax's end: (out = o / l_, lse = m + log l_ `(..)`) from the running output
    `o` and (max, sum) `(.., 1)`; a row that saw no key is 0 with lse -inf. A NaN row stays NaN
    (the NaN rule then applies)."""
    seen = l_ != 0
    out = torch.where(seen, o / torch.where(seen, l_, 1.0), 0.0)
    return out, torch.where(seen, m + torch.log(torch.where(seen, l_, 1.0)), float("-inf"))[..., 0]


def block_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                    allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q `(B, H, t, D)` over one block of keys `(B, Hkv, s, D)`, values
    `(B, Hkv, s, Dv)`, for an engine that merges blocks: (out `(B, H, t, Dv)` and lse
    `(B, H, t)`, both in the accumulation dtype). `allowed`: bool broadcastable to
    `(B, H, t, s)`; a row with no key in the block is 0 with lse -inf."""
    scores = masked_scores(fold_scores(q, k, scale), allowed)  # (B, H, t, s)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, t): -inf for a row with no key
    return fold_values(probs_from_lse(scores, backward_lse(lse)[..., None]), v), lse


def one_query_shared_keys(q: Tensor, keys: Tensor, value_width: int, scale: float,
                          cap: float | None = None) -> Tensor:
    """One query per head `(B, H, 1, W)` over keys every head shares `(B, S, W)` whose first
    `value_width` features are the values (MLA's absorbed decode step: the latent is both):
    out `(B, H, 1, value_width)`. The H queries are the columns of one tall-skinny GEMM,
    `(B, S, W) @ (B, W, H)`, so the keys stream through once; softmax over the S keys in
    the accumulation dtype; `cap`: softcap on the scores. No mask: the one query sits at
    the last position and sees every key it is given."""
    B, H, _, W = q.shape
    scores = keys @ q.view(B, H, W).transpose(1, 2) * scale  # (B, S, H)
    if cap is not None:
        scores = cap_scores(scores, cap)
    probs = torch.softmax(scores, dim=1, dtype=acc_dtype(scores.dtype))  # (B, S, H)
    out = probs.to(keys.dtype).transpose(1, 2) @ keys[..., :value_width]  # (B, H, value_width)
    return out[:, :, None]  # (B, H, 1, value_width)


# torch's fused CPU flash kernel (absent from some builds): (out, lse) forward and a backward
# that takes a given lse, which the public scaled_dot_product_attention does not expose.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
HAS_CPU_FLASH = _CPU_FLASH is not None and _CPU_FLASH_BWD is not None  # flash_lse and its backward both run


def flash_lse(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, mask: Tensor | None = None,
              empty: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """torch's fused CPU kernel with its log-sum-exp: out `(B, h, t, Dv)` and lse `(B, h, t)`
    (float32, float64 for float64). `mask`: float, added to the scores. `empty`: bool
    broadcastable to lse, True where a row has no key to attend: the kernel reports lse 0
    there; it is -inf, so a merge weighs the row 0."""
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    if empty is not None:
        lse = lse.masked_fill(empty, float("-inf"))
    return out, lse


def flash_lse_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool,
                       scale: float, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`flash_lse`'s backward from a given lse (the final one of a merge): (dq, dk, dv)."""
    return _CPU_FLASH_BWD(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def backward_lse(lse: Tensor) -> Tensor:
    """The forward's log-sum-exp as a backward reads it to recompute probabilities,
    exp(scores - lse): a row with no key (-inf) becomes +inf, so its probabilities, and
    every gradient through them, are 0 (never NaN from -inf - -inf)."""
    return lse.masked_fill(torch.isneginf(lse), float("inf"))


def merge_two(o0: Tensor, o1: Tensor, lse0: Tensor, lse1: Tensor, *, inplace: bool = False) -> Tensor:
    """Attention over the union of two disjoint key sets from each set's output and log-sum-exp
    `(..)` (FlashAttention's rescaling): lerp(o0, o1, w) with w = sigmoid(lse1 - lse0) =
    exp(lse1) / (exp(lse0) + exp(lse1)), the second set's share of the softmax's mass; one
    pass over the outputs and three small ops, the form the per-token decode step needs. A row
    neither set attends (both lse -inf) is NaN: `lse_merge_into` weighs it 0. `inplace`: into o0."""
    w = torch.sigmoid(lse1 - lse0).unsqueeze(-1)  # (.., 1)
    return o0.lerp_(o1, w) if inplace else torch.lerp(o0, o1, w)


def lse_merge_into(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """`merge_two` in place, with the merged log-sum-exp, for parts that arrive one at a time
    (ring attention): fold (out_b, lse_b) into (out, lse), lse `(..)` without the trailing 1,
    `out` in the accumulation dtype; no temporary of the part's size. A row neither attends
    stays 0, -inf."""
    # lse -inf (no key yet) raised to the lowest finite value: against a part with no key either,
    # lse_b - lse is then -inf (weight 0, the row stays 0), not -inf - -inf = NaN; a NaN stays NaN
    merge_two(out, out_b.to(out.dtype), lse.clamp_min(torch.finfo(lse.dtype).min), lse_b, inplace=True)
    torch.logaddexp(lse, lse_b, out=lse)


def lse_merge(parts: Sequence[tuple[Tensor, Tensor]], acc: torch.dtype, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`lse_merge_into` over a list of parts, each (out, lse `(.., 1)`): attention over the union
    of disjoint key sets, lse = logsumexp_p lse_p. A row no part attends (lse -inf everywhere)
    is 0 with lse -inf. Returns (out in `dtype`, lse `(.., 1)` in `acc`)."""
    o, lp = parts[0]
    if len(parts) == 1:
        return o.masked_fill(torch.isneginf(lp), 0.0), lp
    out, lse = o.to(acc, copy=True), lp[..., 0].to(acc, copy=True)
    for o_b, l_b in parts[1:]:
        lse_merge_into(out, lse, o_b, l_b[..., 0])
    return out.to(dtype), lse[..., None]


def cap_scores(scores: Tensor, cap: float) -> Tensor:
    """cap * tanh(scores / cap): Gemma 2's logit soft-capping (scores squashed into (-cap, cap))."""
    return torch.tanh(scores / cap) * cap
