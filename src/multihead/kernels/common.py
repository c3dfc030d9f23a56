"""The pieces every attention engine shares, written once: the accumulation dtype, flex's
index tensors, the MQA split over CPU threads, the bottom-right causal triangle, the
masked softmax over scores (with its log-sum-exp for an engine that merges blocks, and
the log-sum-exp as a backward reads it), the log-sum-exp merge of attentions over
disjoint key sets (FlashAttention's rescaling), and the softcap formula. The online
softmax, a tile loop of its own, lives in its engine (explicit_tiles.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["acc_dtype", "backward_lse", "causal_triangle", "index", "lse_merge", "lse_merge_into", "mqa_splits",
           "softcap", "softmax", "softmax_lse"]


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


def softmax(scores: Tensor, allowed: Tensor | None = None, bias: Tensor | None = None,
            hidden: bool = False) -> Tensor:
    """Masked softmax over the last dim; a row with nothing to attend is all zeros.

    `allowed`: bool, True = may attend; `bias`: added to the scores. Without the guard a
    row with nothing to attend is softmax(-inf, ..., -inf) = NaN, and its NaN flows into
    every gradient through the shared K and V. `hidden`: the scores may hold -inf already
    (a score mod may hide pairs too, `where(q_idx == 0, -inf, s)` hides a whole row; or
    the caller filled the hidden pairs), so rows are checked even without a mask.
    """
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if allowed is None and bias is None and not hidden:
        return torch.softmax(scores, dim=-1)
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
    return probs.masked_fill(empty, 0.0)


def softmax_lse(scores: Tensor, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`softmax` of one block of keys and the log-sum-exp of its scores, for an engine that
    merges blocks (`lse_merge`, `lse_merge_into`): probs = exp(scores - lse), lse `(..)`
    without the trailing 1. A row with nothing to attend in the block has zeros and lse
    -inf (so a merge weighs it 0)."""
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row with no key
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    return probs, lse


def backward_lse(lse: Tensor) -> Tensor:
    """The forward's log-sum-exp as a backward reads it to recompute probabilities,
    exp(scores - lse): a row with no key (-inf) becomes +inf, so its probabilities, and
    every gradient through them, are 0 (never NaN from -inf - -inf)."""
    return lse.masked_fill(torch.isneginf(lse), float("inf"))


def lse_merge(parts: Sequence[tuple[Tensor, Tensor]], acc: torch.dtype, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Attention over the union of disjoint key sets from each set's (out, lse `(.., 1)`):
    out = sum_p exp(lse_p - lse) out_p, lse = logsumexp_p lse_p. A row no part attends
    (lse -inf everywhere) is 0 with lse -inf. Returns (out in `dtype`, lse in `acc`)."""
    if len(parts) == 1:
        o, lp = parts[0]
        return o.masked_fill(torch.isneginf(lp), 0.0), lp
    lp = torch.logsumexp(torch.cat([p[1] for p in parts], -1), -1, keepdim=True)
    safe = lp.masked_fill(torch.isneginf(lp), 0.0)
    return sum(p[0].to(acc) * torch.exp(p[1] - safe) for p in parts).to(dtype), lp


def lse_merge_into(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """`lse_merge`'s running form, for parts that arrive one at a time (ring attention): fold
    (out_b, lse_b) into (out, lse) in place, lse `(..)` without the trailing 1, `out` in the
    accumulation dtype; no temporary of the part's size. A row neither attends stays 0, -inf."""
    new = torch.logaddexp(lse, lse_b)
    dead = torch.isneginf(new)
    w_old = torch.exp(lse - new).masked_fill(dead, 0.0)[..., None]
    w_new = torch.exp(lse_b - new).masked_fill(dead, 0.0)[..., None]
    out.mul_(w_old).addcmul_(out_b.to(out.dtype), w_new)
    lse.copy_(new)


def softcap(scores: Tensor, cap: float) -> Tensor:
    """cap * tanh(scores / cap): Gemma 2's logit soft-capping (scores squashed into (-cap, cap))."""
    return torch.tanh(scores / cap) * cap
