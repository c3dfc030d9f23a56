"""Ring attention: exact attention over a sequence sharded across P processes (Liu et
al., 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context").

Each rank keeps its shard of the queries and passes its shard of K/V to the next rank
P - 1 times, the next block's transfer overlapping the block in hand; each block's partial
output and log-sum-exp are merged exactly (`kernels.common.lse_merge_into`). The backward
recomputes each block's probabilities from the final lse and sends dK/dV around the ring
with their block. Memory per rank is O(N/P), never a score matrix over the whole sequence.
The per-block kernel: torch's fused CPU flash kernel with its log-sum-exp
(`kernels.common.flash_lse`) where it exists, else `kernels.common.block_attention`.
The method in full: docs/distributed.md, "How ring attention works".
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.checks import check_positive_number
from multihead.distributed._group import (
    GroupRef,
    agree,
    check_device,
    check_layout,
    chunk_ids,
    dtype_code,
    float_code,
    layout_code,
    resolve_group,
)
from multihead.kernels.common import (
    HAS_CPU_FLASH,
    acc_dtype,
    backward_lse,
    block_attention,
    causal_triangle,
    flash_lse,
    flash_lse_backward,
    fold_scores,
    lse_merge_into,
    masked_scores,
    probs_from_lse,
)
from multihead.kernels.math import block_rows
from multihead.kernels.validation import check_qkv

__all__ = ["ring_attention"]

# ------------------------------------------------------------------ block kernels


def _rows_with_keys(keep: Tensor | None, diag: bool, t: int) -> Tensor | None:
    """(B, 1, t) True where a query row has at least one key to attend in the block."""
    if keep is None:
        return None
    if diag:  # row i sees keys 0..i of the block
        return (keep.cumsum(-1) > 0)[:, None, :t]
    return keep.any(-1)[:, None, None].expand(keep.shape[0], 1, t)


def _flash_mask(keep: Tensor | None, dtype) -> Tensor | None:
    if keep is None:
        return None
    B, s = keep.shape
    return torch.zeros(B, 1, 1, s, dtype=dtype, device=keep.device).masked_fill(~keep[:, None, None], float("-inf"))


class _Flash:
    """torch's fused CPU kernel (`kernels.common.flash_lse`): (out, lse) forward and a
    backward that takes a given lse."""

    @staticmethod
    def forward(q, k, v, keep, diag, scale):
        rows = _rows_with_keys(keep, diag, q.shape[2])
        return flash_lse(q, k, v, causal=diag, scale=scale, mask=_flash_mask(keep, q.dtype),
                         empty=None if rows is None else ~rows)

    @staticmethod
    def backward(dout, q, k, v, out, lse, keep, diag, scale):
        return flash_lse_backward(dout, q, k, v, out, lse, causal=diag, scale=scale, mask=_flash_mask(keep, q.dtype))


class _Explicit:
    """The block attention of `kernels.common` (scores and values with the G query heads
    of a K/V head folded, so K/V are never repeated; float32 at least) over blocks of
    query rows within `kernels.math`'s budget of scores; the backward's probabilities
    from the final lse, read through `kernels.common.backward_lse`."""

    @staticmethod
    def _allowed(keep, diag, t0, t1, s, device):
        allowed = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, s)
        if diag:  # a square block (t == s) on the diagonal: bottom-right is top-left
            tri = causal_triangle(t0, t1, s, s, device)  # (t1 - t0, s)
            allowed = tri if allowed is None else allowed & tri  # (.., t, s)
        return allowed

    @staticmethod
    def forward(q, k, v, keep, diag, scale):
        B, H, t, _ = q.shape
        s = k.shape[2]
        acc = acc_dtype(q.dtype)
        ka, va = k.to(acc), v.to(acc)
        outs, lses = [], []
        step = block_rows(B, H, s)
        for t0 in range(0, t, step):
            t1 = min(t, t0 + step)
            allowed = _Explicit._allowed(keep, diag, t0, t1, s, q.device)
            out, lse = block_attention(q[:, :, t0:t1], ka, va, scale, allowed)  # (B, H, t, Dv), (B, H, t)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)

    @staticmethod
    def backward(dout, q, k, v, out, lse, keep, diag, scale):
        B, H, t, _ = q.shape
        Hkv, s = k.shape[1], k.shape[2]
        G, acc = H // Hkv, acc_dtype(q.dtype)
        ka, va = k.to(acc), v.to(acc)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dk, dv = torch.zeros_like(ka), torch.zeros_like(va)
        step = block_rows(B, H, s)
        for t0 in range(0, t, step):
            t1 = min(t, t0 + step)
            n = G * (t1 - t0)
            scores = fold_scores(q[:, :, t0:t1], ka, scale)  # (B, H, t, s)
            allowed = _Explicit._allowed(keep, diag, t0, t1, s, q.device)
            scores = masked_scores(scores, allowed)
            probs = probs_from_lse(scores, lse[:, :, t0:t1, None].to(acc)).view(B, Hkv, n, s)  # the final softmax
            dob = dout[:, :, t0:t1].to(acc)  # (B, H, t, Dv)
            dof = dob.reshape(B, Hkv, n, -1)  # (B, Hkv, G*t, Dv)
            dv += probs.transpose(-2, -1) @ dof
            dp = dof @ va.transpose(-2, -1)  # (B, Hkv, G*t, s)
            delta = (dob * out[:, :, t0:t1].to(acc)).sum(-1, keepdim=True).reshape(B, Hkv, n, 1)
            ds = probs * (dp - delta) * scale
            dq[:, :, t0:t1] = (ds @ ka).view(B, H, t1 - t0, -1)
            dk += ds.transpose(-2, -1) @ q[:, :, t0:t1].to(acc).reshape(B, Hkv, n, -1)
        return dq, dk, dv


_FLASH_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _pick_kernel(q: Tensor, kernel: str | None):
    """The fused CPU kernel where this torch has both its ops (`HAS_CPU_FLASH`) and takes
    q's dtype, the explicit blocks otherwise."""
    flash = HAS_CPU_FLASH and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES
    if kernel == "explicit" or not flash:
        return _Explicit
    return _Flash


# ------------------------------------------------------------------------ the ring


class _Ring:
    """This rank's neighbours in `group` and the one operation the ring needs."""

    def __init__(self, group):
        self._group = GroupRef(group)  # kept by the autograd graph: never the group itself
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    @property
    def group(self):
        return self._group.get()

    def shift(self, tensors: list[Tensor]):
        """Start sending `tensors` to the next rank and receiving as many from the previous.

        Returns a handle; `wait(handle)` gives the received tensors and empties the handle,
        so the sent tensors are freed as soon as nothing else holds them.
        """
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        group = self.group
        ops = [dist.P2POp(dist.isend, t, self.next, group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, group) for t in recvs]
        return [dist.batch_isend_irecv(ops), sends, recvs]

    @staticmethod
    def wait(handle: list) -> list[Tensor]:
        works, _, recvs = handle
        for work in works:
            work.wait()
        handle.clear()
        return recvs


def _blocks(q_chunks: list[int], kv_chunks: list[int], c: int, causal: bool, T: int, S: int):
    """The (query rows, key rows, diagonal) blocks to compute for one pair of shards.

    Chunk ids are global and every chunk holds c tokens. Under causality a key chunk
    before the query chunk is attended wholly, the same chunk is the causal diagonal
    and a later one is skipped. One kernel call per (query chunk, key chunk): the
    backward's dK/dV of a call then span one chunk, not the shard, which keeps the
    peak memory down.
    """
    if not causal:
        return [((0, T), (0, S), False)]
    blocks = []
    for i, a in enumerate(q_chunks):
        for j, b in enumerate(kv_chunks):
            if b <= a:
                blocks.append(((i * c, (i + 1) * c), (j * c, (j + 1) * c), b == a))
    return blocks


def _forward(q, k, v, keep, causal, layout, scale, ring: _Ring, kern):
    B, H, T, _ = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    P, r = ring.size, ring.rank
    q_chunks = chunk_ids(r, P, layout)
    c = T // len(q_chunks)
    out = torch.zeros(B, H, T, Dv, dtype=acc_dtype(q.dtype), device=q.device)
    lse = torch.full((B, H, T), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    held = [k, v] + ([] if keep is None else [keep])
    for step in range(P):
        if step < P - 1:
            incoming = ring.shift(held)  # the next block travels while this one is computed
        kb, vb = held[0], held[1]
        kp = None if keep is None else held[2]
        for (t0, t1), (s0, s1), diag in _blocks(q_chunks, chunk_ids((r - step) % P, P, layout), c, causal, T, S):
            o_b, l_b = kern.forward(q[:, :, t0:t1], kb[:, :, s0:s1], vb[:, :, s0:s1],
                                    None if kp is None else kp[:, s0:s1], diag, scale)
            lse_merge_into(out[:, :, t0:t1], lse[:, :, t0:t1], o_b, l_b)  # in place, no block-sized temporary
            del o_b, l_b
        if step < P - 1:
            held = ring.wait(incoming)
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, keep, causal, layout, scale, ring: _Ring, kern):
    B, H, T, D = q.shape
    S = k.shape[2]
    P, r = ring.size, ring.rank
    acc = acc_dtype(q.dtype)
    q_chunks = chunk_ids(r, P, layout)
    c = T // len(q_chunks)
    lse = backward_lse(lse)  # a row with no key: probabilities 0
    dq = torch.zeros(B, H, T, D, dtype=acc, device=q.device)
    held = [k, v] + ([] if keep is None else [keep])
    grads = None
    for step in range(P):
        if step == 0:
            dk = torch.zeros(k.shape, dtype=acc, device=q.device)
            dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        else:
            # The gradient of the block in hand so far, from the ranks it visited before
            # (sent at the end of their previous step). Waited for before this step's K/V
            # transfer starts and accumulated into in place, so one dK/dV pair is alive
            # during the compute instead of three (the sent, the received, the new one).
            dk, dv = ring.wait(grads)
        if step < P - 1:
            incoming = ring.shift(held)  # the next block travels while this one is computed
        kb, vb = held[0], held[1]
        kp = None if keep is None else held[2]
        for (t0, t1), (s0, s1), diag in _blocks(q_chunks, chunk_ids((r - step) % P, P, layout), c, causal, T, S):
            dq_b, dk_b, dv_b = kern.backward(
                dout[:, :, t0:t1], q[:, :, t0:t1], kb[:, :, s0:s1], vb[:, :, s0:s1], out[:, :, t0:t1],
                lse[:, :, t0:t1], None if kp is None else kp[:, s0:s1], diag, scale)
            dq[:, :, t0:t1] += dq_b
            dk[:, :, s0:s1] += dk_b
            dv[:, :, s0:s1] += dv_b
            del dq_b, dk_b, dv_b
        if step == P - 1:
            held = kb = vb = kp = None  # the last block is done with: free it before the transfer
        if P > 1:
            # After the last step the block's next stop is its owner: the gradient comes home.
            grads = ring.shift([dk, dv])
            del dk, dv
        if step < P - 1:
            held = ring.wait(incoming)
    if P > 1:
        dk, dv = ring.wait(grads)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, causal, layout, scale, ring, kern):
        out, lse = _forward(q, k, v, keep, causal, layout, scale, ring, kern)
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.args = (causal, layout, scale, ring, kern)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, keep = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, keep, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


# ------------------------------------------------------------------------- public


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"


def _check_local(q, k, v, mask, causal, layout, scale, group) -> None:
    """Raise for what is wrong with this rank's input (the caller catches it, so that the
    ranks agree before any raises): TypeError for a wrong type, ValueError for a wrong value."""
    check_qkv(q, k, v)  # the checks `attend` makes, with its messages and exception classes
    B, H, T, D = q.shape
    error = check_device(group, q, "q")
    if error:
        raise ValueError(error)
    S = k.shape[2]
    if causal and S != T:
        raise ValueError(f"causal ring attention needs this rank's keys to be the same shard as its queries "
                         f"(S == T); received T = {T}, S = {S}")
    if layout == "zigzag" and (T % 2 or S % 2):
        P = dist.get_world_size(group)
        raise ValueError(f"layout 'zigzag' gives each rank 2 of 2P chunks, so the sequence length must be "
                         f"divisible by 2P = {2 * P}; received a shard of T = {T} (S = {S}) tokens, global "
                         f"length {T * P}")
    check_positive_number("scale", scale, allow_none=True)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = type(mask).__name__ if not isinstance(mask, Tensor) else f"a {mask.dtype} tensor"
            raise TypeError(f"mask must be a bool key-padding mask (B, S) of this rank's keys (True = may "
                            f"attend) or None; received {got}")
        if mask.dim() == 4 and mask.shape[1:3] == (1, 1):
            mask = mask[:, 0, 0]
        if mask.dim() != 2 or mask.shape[1] != S or mask.shape[0] not in (1, B):
            raise ValueError(f"mask must be (B, S) = ({B}, {S}) or (B, 1, 1, S): this rank's keys in the order "
                             f"of shard_sequence; received {_shape(mask)}")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    layout: str = "contiguous",
    group=None,
    scale: float | None = None,
    mask: Tensor | None = None,
    _kernel: str | None = None,
    _agreed: bool = False,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of `group`.

    Every rank passes its shard: q `(B, H, T, D)`, k `(B, Hkv, S, D)`, v `(B, Hkv, S, Dv)`
    with T = N/P (S = N_kv/P) tokens in the order `shard_sequence(x, dim, layout)` gives,
    and receives its shard of the output `(B, H, T, Dv)`, equal to the same rows of
    attention over the whole sequence. Differentiable (the gradient of k and v comes
    back to the rank that owns them).

    Args:
        causal: query at global position i sees keys j <= i (self-attention: S == T).
            Contiguous layout skips blocks wholly in the future (rank 0 then has the
            least work, rank P-1 the most); "zigzag" balances the work.
        layout: "contiguous" or "zigzag" (rank r holds chunks r and 2P-1-r of 2P; the
            length must divide by 2P).
        group: a process group (default: the default group).
        scale: multiplies the scores; default 1 / sqrt(D).
        mask: optional bool key-padding mask `(B, S)` of this rank's keys (True = may
            attend); it travels around the ring with its keys. A query row with no key
            to attend gives zeros (and zero gradients).

    GQA/MQA: Hkv divides H; K/V are sent and read with Hkv heads, never repeated. No
    dropout (the ring is meant for long sequences, where models train without it).
    `_kernel="explicit"` forces the explicit per-block path (for tests; default: the
    fused CPU kernel on CPU where torch has it, the explicit path elsewhere). `_agreed=True`: the caller's
    ranks have agreed on every input shape and option already (context_parallel's layer),
    so the ranks' own agreement, one all_gather, is skipped.
    """
    group = resolve_group(group, "ring_attention")
    error = None
    try:
        check_layout(layout)
        _check_local(q, k, v, mask, causal, layout, scale, group)
    except (TypeError, ValueError) as e:  # kept, so that every rank can agree before any raises
        error = e
    shapes, scale_code = [0] * 8, 0
    if error is None:
        shapes = [*q.shape, k.shape[1], k.shape[2], v.shape[3], dtype_code(q.dtype)]
        scale_code = float_code(scale)
    if _agreed:  # the caller's ranks agreed on every shape already: an error here is on every rank
        if error:
            raise type(error)(f"ring_attention: {error}") from error
    else:
        agree(group, "ring_attention", error, [*shapes, int(bool(causal)), layout_code(layout), mask is not None,
                                               scale_code],
              "(B, H, T, D, Hkv, S, Dv, dtype, causal, layout, mask, scale bits)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    keep = None
    if mask is not None:
        keep = (mask[:, 0, 0] if mask.dim() == 4 else mask).expand(q.shape[0], k.shape[2]).contiguous()
    return _RingAttention.apply(q, k, v, keep, bool(causal), layout, scale, _Ring(group),
                                _pick_kernel(q, _kernel))
