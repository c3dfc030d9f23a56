"""The fused tile engine: per block of queries, the contiguous range of key tiles it keeps
(`multihead.kernels.planner`) goes to torch's fused `F.scaled_dot_product_attention` in
one call, with a small dense mask (rows x kept keys) only when a tile in the range is not
full; an additive score mod (ALiBi) rides along as that call's float mask. Causal squares
run as one call of torch's causal kernel each, which skips the upper triangle itself. On
the CPU the pieces of a block run on torch's flash kernel, which returns each piece's
log-sum-exp, and merge exactly (`_MergedFused`, with its own backward); elsewhere
autograd goes through the fused calls. There, alike query blocks of a relative mask (a
sliding window's) run as a band: one call over all of them, the blocks as the kernel's
heads through strided views, so that every thread has work (`_FusedPlan.runs`). The plan
of a relative mask is kept from call to call with its blocks and masks (`planner.plan_key`),
so the Python over tiles runs once per (mask, shape), not on one thread every call; so is the
memory of its last output, reused once the caller has dropped it (`output`): a new one is
faulted in page by page. Training memory stays O(N)."""

from __future__ import annotations

import functools
import sys
import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.kernels import explicit_tiles
from multihead.kernels.common import (
    HAS_CPU_FLASH,
    acc_dtype,
    backward_lse,
    flash_lse,
    flash_lse_backward,
    lse_merge,
    mqa_splits,
)
from multihead.kernels.explicit_tiles import Tiles, needs_grad, refuse_trainable, twice
from multihead.kernels.planner import block_mask, choose_tile, combine, fold_mask, plan_key, serial_ops

__all__ = ["BANDS", "CAUSAL", "FUSED_TILE", "clear", "fused", "output"]

# None: the fused engine picks its tile per call (`planner.choose_tile`): short query blocks
# keep the key range of a local mask tight, long ones let torch's kernel use its big blocks.
FUSED_TILE: int | None = None
_ONE_CALL_SPAN = 512  # keys: below this a query block's pieces run as one masked call
# query blocks: a run of fewer blocks alike (see `_FusedPlan.runs`) goes block by block
_MIN_BAND = 2
# False: every query block its own calls, planned as such (benchmarks/masks.py compares the two)
BANDS = True
# What a kept plan's calls share (`_shared`): its blocks and runs as Python lists, its masks
_SHARED: OrderedDict = OrderedDict()
_SHARED_LOCK = threading.Lock()
_SHARED_KEPT = 32
_KEPT_MASK_BYTES = 1 << 20  # a larger mask (a GQA-folded piece's) is built per call, never kept
# A band call's output stays below this many bytes (the band split into equal calls): the kernel
# allocates its output each call, and glibc serves a block of 32 MiB or more by a fresh mmap,
# faulted in page by page as the kernel writes it (more CPU than filling a reused block), a
# smaller one, once one as large was freed, from its heap, reused. Few calls: every call's end
# waits for its slowest thread, on a busy machine a descheduled one.
_BAND_CHUNK_BYTES = 32 << 20
# False: a new output every call (benchmarks/masks.py compares the two). See `output`
KEEP_OUTPUT = True
_KEPT_OUTPUTS: OrderedDict = OrderedDict()  # (shape, dtype, device, inference) -> an alias of the last output
_KEPT_OUTPUTS_LOCK = threading.Lock()
_KEPT_OUTPUT_SLOTS = 2
_KEPT_OUTPUT_MIN_BYTES = 4 << 20  # below: glibc's heap hands back warm memory by itself
_KEPT_OUTPUT_BYTES = 256 << 20  # kept in all, at most: a larger output is made new every call
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # None: nothing is reused


def _shared(key) -> dict | None:
    """The dict that every call with the plan of `planner.plan_key` `key` shares (None: none).

    Walking a plan's rows in Python (512 x 512 tiles at N = 16384, tiles of 32) costs more
    than a thread's share of the kernel at 2 threads, and ran on one thread while the other
    waited; with a kept plan it runs once."""
    if key is None:
        return None
    with _SHARED_LOCK:
        d = _SHARED.get(key)
        if d is None:
            d = _SHARED[key] = {}
            while len(_SHARED) > _SHARED_KEPT:
                _SHARED.popitem(last=False)
        else:
            _SHARED.move_to_end(key)
        return d


def output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised tensor of `shape` for a forward to fill every element of: the memory of
    the last output of this shape when nothing holds that output any more, else a new one.

    A new output of 32 MiB or more is a new mapping that the copies into it fault in page by
    page (8,192 faults, ~11 ms of CPU at N = 16384, 8 heads of 64: 7% of a sliding-window call
    at 1 thread); a caller that has dropped its last result (a model's next layer, a loop of
    calls) gets warm pages instead. What is kept is an alias of the output (`detach`: its own
    tensor, not a view that would hold the output itself). Every tensor or view of the memory
    adds to its storage's use count, a storage object held adds to that object's references
    (torch keeps one object per storage, which counts once), so both read as an unheld alias's
    (`_unheld`) exactly when nothing but the alias refers to the memory: then no one can see
    it being overwritten.
    """
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if not KEEP_OUTPUT or _STORAGE_USE_COUNT is None or device.type != "cpu" \
            or not _KEPT_OUTPUT_MIN_BYTES <= nbytes <= _KEPT_OUTPUT_BYTES // _KEPT_OUTPUT_SLOTS:
        return torch.empty(shape, dtype=dtype, device=device)
    # an inference tensor (made under inference_mode) must not come back outside it, nor the reverse
    key = (tuple(shape), dtype, device, torch.is_inference_mode_enabled())
    with _KEPT_OUTPUTS_LOCK:
        kept = _KEPT_OUTPUTS.pop(key, None)
    # the storage still holds the whole output (a caller may have resized it before dropping it)
    # and is this process's alone (moved to shared memory, another process may map it: it was
    # sent through torch.multiprocessing)
    if kept is not None and _holders(kept) == _unheld() and kept.untyped_storage().nbytes() >= nbytes \
            and not kept.untyped_storage().is_shared():
        out = kept.detach()
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
    del kept
    with _KEPT_OUTPUTS_LOCK:
        _KEPT_OUTPUTS[key] = out.detach()
        while len(_KEPT_OUTPUTS) > _KEPT_OUTPUT_SLOTS:
            _KEPT_OUTPUTS.popitem(last=False)
    return out


def clear() -> tuple[int, int]:
    """Drop what the engine keeps between calls: its plans' blocks and masks (`_shared`) and the
    memory of its last outputs (`output`). Returns (outputs dropped, the bytes of those that
    nothing else held: given back now)."""
    with _SHARED_LOCK:
        _SHARED.clear()
    with _KEPT_OUTPUTS_LOCK:
        kept = list(_KEPT_OUTPUTS.values())
        _KEPT_OUTPUTS.clear()
    freed = sum(t.untyped_storage().nbytes() for t in kept if _holders(t) == _unheld())
    return len(kept), freed


def _holders(alias: Tensor) -> tuple[int, int]:
    """(the storage's use count, its storage object's Python references) as read through `alias`."""
    storage = alias.untyped_storage()
    return _STORAGE_USE_COUNT(storage._cdata), sys.getrefcount(storage)


@functools.cache
def _unheld() -> tuple[int, int]:
    """`_holders` of an alias that is all there is of its memory: what a kept output reads when
    the caller holds nothing of it."""
    made = torch.empty(1)
    alias = made.detach()
    del made
    return _holders(alias)


def _fused_call(q, k, v, m, scale, dropout_p):
    """F.scaled_dot_product_attention on a block, GQA folded, K/V never copied."""
    B, H, t, D = q.shape
    Hkv, s, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    if G == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout_p, scale=scale)
    qf = q.reshape(B, Hkv, G * t, D)  # (B, Hkv, G*t, D)
    mf = fold_mask(m, B, Hkv, G, t)
    P = mqa_splits(B, Hkv, G, q.device)  # MQA: the one folded head split over the CPU threads
    if P > 1:
        qf = qf.reshape(B, P, G // P * t, D)  # (B, P, G/P*t, D)
        if mf is not None and mf.shape[2] > 1:
            mf = mf.reshape(mf.shape[0], P, G // P * t, mf.shape[3])
        k, v = k.expand(B, P, s, D), v.expand(B, P, s, Dv)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf, dropout_p=dropout_p, scale=scale)
    return out.reshape(B, H, t, Dv)


def _public_squares(q: Tensor, k: Tensor) -> bool:
    """Whether the public-sdpa engine runs causal squares as whole causal calls: only where
    torch's fused kernels take any length in O(N) memory. Not on the CPU, where this engine
    runs only what the CPU flash kernel refuses (dropout, D != Dv: torch's math path, which
    would build a square's whole (t, t) scores), nor for GQA (enable_gqa has no memory-
    efficient kernel everywhere); there the square's blocks run as pieces, bounded in memory."""
    return q.device.type != "cpu" and k.shape[1] == q.shape[1]


def fused(q: Tensor, k: Tensor, v: Tensor, mask, *, causal: bool, scale: float, dropout_p: float,
          score_mod=None, tile: int | None = None) -> Tensor:
    """softmax(q k^T * scale + mask) v on torch's fused kernel, over the kept tiles only.

    `mask`: None, a dense tensor (sliced per block) or a MaskMod; `score_mod`: None or an
    additive ScoreMod (its `bias` becomes the block's float mask).
    """
    B, H, T, _ = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    if score_mod is not None:
        refuse_trainable(score_mod, q, S, "the fused kernel takes its bias as a mask")
    pred, dense = combine(mask, causal)
    # a float mask that requires grad (T5's position bias) gets its gradient from autograd through
    # the public kernel's calls; the LSE engine's backward has no mask gradient
    lse_engine = HAS_CPU_FLASH and q.device.type == "cpu" and dropout_p == 0 and q.shape[-1] == Dv \
        and not torch.compiler.is_compiling() and not needs_grad(dense)
    # a square is one causal call: no room for a score mod's or a dense mask's bias
    runs_squares = dense is None and score_mod is None and (lse_engine or _public_squares(q, k))
    G = q.shape[1] // k.shape[1]
    bands = BANDS and lse_engine and dense is None and score_mod is None
    # a plan is kept only where it and its masks are a function of the key: no dense mask, no score mod
    key = plan_key(pred, B, H, T, S, G, tile or FUSED_TILE, q.device, runs_squares, bands) \
        if dense is None and score_mod is None else None
    bq, bk, kept, full, squares = choose_tile(pred, B, H, T, S, G, tile or FUSED_TILE, q.device,
                                               squares=runs_squares, bands=bands, key=key)
    if lse_engine:
        fp = _FusedPlan(q, k, v, pred, dense, score_mod, scale, bq, bk, kept, full, squares, _shared(key))
        # the merged log-sum-exp is for the backward alone: without one, no (B, H, T) tensor to fill
        fp.keep_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if bands and tile is None and FUSED_TILE is None and torch.is_grad_enabled() \
                and (q.requires_grad or k.requires_grad or v.requires_grad):
            # the backward runs block by block (see `_MergedFused.backward`): its own plan, planned as such
            def replan():
                key = plan_key(pred, B, H, T, S, G, None, q.device, runs_squares, False) \
                    if dense is None and score_mod is None else None
                plan = choose_tile(pred, B, H, T, S, G, None, q.device, squares=runs_squares, key=key)
                return _FusedPlan(q, k, v, pred, dense, score_mod, scale, *plan, _shared(key))

            fp.replan = replan
        return _MergedFused.apply(q, k, v, fp)
    outs = []
    i = 0
    nq = kept.shape[0]
    while i < nq:
        r0 = i * bq
        if r0 in squares:  # causal squares: torch's causal call on each (top-left within the square)
            while r0 in squares:
                r1 = squares[r0]
                outs.append(F.scaled_dot_product_attention(q[:, :, r0:r1], k[:, :, r0:r1], v[:, :, r0:r1],
                                                           is_causal=True, dropout_p=dropout_p, scale=scale))
                r0 = r1
            i = -(-r0 // bq)
            continue
        cols = kept[i].nonzero()
        if cols.numel() == 0:
            r1 = min(T, r0 + bq)
            outs.append(q.new_zeros(B, H, r1 - r0, Dv))
            i += 1
            continue
        j0, j1 = int(cols[0]), int(cols[-1]) + 1
        need_pred = not bool(full[i, j0:j1].all())
        # Consecutive query blocks with the same key range and no mask share one call.
        i1 = i + 1
        while not need_pred and i1 < nq and torch.equal(kept[i1], kept[i]) and bool(full[i1, j0:j1].all()) \
                and (i1 + 1 - i) * bq * (j1 - j0) * bk <= 1 << 22:
            i1 += 1
        r1 = min(T, i1 * bq)
        c0, c1 = j0 * bk, min(S, j1 * bk)
        m = block_mask(pred, dense, score_mod, B, H, T, S, r0, r1, c0, c1, need_pred, q.dtype, q.device)
        outs.append(_fused_call(q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], m, scale, dropout_p))
        i = i1
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# ------------------------------------------- fused pieces merged by log-sum-exp (CPU)

CAUSAL = "causal"  # a piece run by torch's causal kernel as a whole (a causal square)


class _FusedPlan:
    """A query block's kept key tiles as pieces: runs of full tiles (no mask), runs of
    partial tiles (a float mask of that run only; the causal diagonal as `is_causal`).

    On the CPU, torch's flash kernel returns each piece's log-sum-exp, so pieces merge
    exactly: out = sum_p exp(lse_p - lse) out_p. A mask over a block's whole key range
    costs the kernel 1.3-2x (it adds the mask to every score); pieces keep it to the
    partial tiles. The backward asks the kernel's backward for each piece's share with
    the merged out and lse (FlashAttention's dS = P (dP - rowsum(dO O)) splits over keys).
    """

    def __init__(self, q, k, v, pred, dense, score_mod, scale, bq, bk, kept, full, squares, shared=None):
        self.squares = squares  # {first row: end row} of the causal squares (none with a mod or dense mask)
        self.B, self.H, self.T, self.D = q.shape
        self.Hkv, self.S, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = self.H // self.Hkv
        self.pred, self.dense, self.score_mod, self.scale = pred, dense, score_mod, scale
        self.bq, self.bk, self.kept, self.full = bq, bk, kept, full
        self.dtype, self.device = q.dtype, q.device
        # shared: None, or the dict every call with this kept plan shares (`_shared`): lists and masks
        self.shared = shared
        self._cache = {}  # masks of this call
        self._kept = None if shared is None else shared.setdefault(("masks", self.dtype, str(self.device)), {})
        self.replan = None  # None, or a zero-argument callable: the plan the backward runs instead
        self.keep_lse = True  # False: the forward fills no lse (no backward will read it)
        self.rows_contiguous = all(x.stride(-1) == 1 for x in (q, k, v))  # the kernel reads rows of a band's views
        self.P = mqa_splits(self.B, self.Hkv, self.G, q.device)  # MQA: P stride-0 heads, one per thread

    def blocks(self):
        """(r0, r1, [(c0, c1, partial), ...]) per query block; empty blocks have no pieces.

        A causal square is one block with the one piece `(r0, r1, CAUSAL)`.
        """
        if self.shared is None:
            return self._blocks()
        key = ("blocks", _ONE_CALL_SPAN)
        if key not in self.shared:
            self.shared[key] = list(self._blocks())
        return self.shared[key]

    def planned_runs(self):
        """`runs(blocks())`, a list kept with the plan where there is one (`shared`)."""
        if self.shared is None:
            return list(self.runs(self.blocks()))
        key = ("runs", BANDS, _MIN_BAND, _ONE_CALL_SPAN, self.rows_contiguous)
        if key not in self.shared:
            self.shared[key] = list(self.runs(self.blocks()))
        return self.shared[key]

    def _blocks(self):
        nq, nk = self.kept.shape
        if not hasattr(self, "_rows"):  # Python lists once: per-row tensor ops cost more than the rows' work
            cols = torch.arange(nk)
            with serial_ops():  # ops over tiles: see `serial_ops`
                self._rows = (self.kept.tolist(), self.full.tolist(),
                              torch.where(self.kept, cols, nk).amin(1).tolist() if nk else [0] * nq,
                              torch.where(self.kept, cols + 1, 0).amax(1).tolist() if nk else [0] * nq)
        kept_rows, full_rows, first, end = self._rows  # end: one past the last kept tile
        i = 0
        while i < nq:
            if i * self.bq in self.squares:
                r = i * self.bq
                while r in self.squares:  # squares of documents may end off the tile edges
                    yield r, self.squares[r], [(r, self.squares[r], CAUSAL)]
                    r = self.squares[r]
                i = -(-r // self.bq)
                continue
            pieces, j = [], first[i]
            row_kept, row_full = kept_rows[i], full_rows[i]
            while j < end[i]:
                if not row_kept[j]:
                    j += 1
                    continue
                j1 = j
                while j1 < nk and row_kept[j1] and row_full[j1] == row_full[j]:
                    j1 += 1
                pieces.append((j * self.bk, min(self.S, j1 * self.bk), not row_full[j]))
                j = j1
            # query blocks whose pieces are all full and alike share one call (no bias to slice)
            i1 = i + 1
            if pieces and not any(p[2] for p in pieces) and self.score_mod is None and self.dense is None:
                span = sum(c1 - c0 for c0, c1, _ in pieces)
                while i1 < nq and kept_rows[i1] == row_kept and full_rows[i1] == row_full \
                        and (i1 + 1 - i) * self.bq * span <= 1 << 22:
                    i1 += 1
            if len(pieces) > 1 and pieces[-1][1] - pieces[0][0] <= _ONE_CALL_SPAN:
                # a short range: one masked call costs less than a call per piece
                pieces = [(pieces[0][0], pieces[-1][1], True)]
            yield i * self.bq, min(self.T, i1 * self.bq), pieces
            i = i1

    def runs(self, blocks):
        """The plan's blocks, with runs of alike blocks as bands: ("band", r0, n, pieces) for
        n >= `_MIN_BAND` query blocks of bq rows from r0 whose pieces sit at the same offsets
        from their first row, pieces `(c0 - r0, c1 - r0, partial)`; ("block", r0, r1, pieces)
        for the rest, as `blocks` gave them.

        A relative mask (a function of q - kv alone: sliding windows, causal) has the same
        mask on every block of a band, so the band runs as one call per piece with its
        blocks as the kernel's heads (`band_view`): torch's CPU kernel splits a call over
        batch x heads x query blocks, and one call of thousands of work items keeps every
        thread busy where hundreds of calls of 8 heads each wait on each other at every
        call's end.
        """
        can = BANDS and self.pred is not None and self.pred.relative and self.score_mod is None \
            and self.dense is None and self.rows_contiguous
        pending = []  # a band in the making: [(r0, rel)]

        def flush():
            if len(pending) >= _MIN_BAND:
                yield "band", pending[0][0], len(pending), pending[0][1]
            else:
                for r0, rel in pending:
                    yield "block", r0, r0 + self.bq, [(r0 + a, r0 + e, p) for a, e, p in rel]
            pending.clear()

        for r0, r1, pieces in blocks:
            if not can or r1 - r0 != self.bq or not pieces or pieces[0][2] is CAUSAL:
                yield from flush()
                yield "block", r0, r1, pieces
                continue
            rel = [(c0 - r0, c1 - r0, p) for c0, c1, p in pieces]
            if pending and (rel != pending[-1][1] or r0 != pending[-1][0] + self.bq):
                yield from flush()
            pending.append((r0, rel))
        yield from flush()

    def band_mask(self, r0, a, e, partial):
        """(float mask `(1, 1, bq, e - a)` or None, is_causal, rows-empty `(1, 1, bq)` or None) of
        any block of a band: keys r0 + a .. r0 + e of rows r0 .. r0 + bq, the GQA heads unfolded."""
        key = ("band", r0 + self.S - self.T, a, e, partial)  # relative: the same for every block
        found = self._recall(key)
        if found is not None:
            return found
        t, s = self.bq, e - a
        m = block_mask(self.pred, None, None, self.B, self.H, self.T, self.S, r0, r0 + t, r0 + a, r0 + e,
                       partial, self.dtype, self.device)
        if m is None:
            result = None, False, None
        elif t == s and t > 1 and torch.equal(~torch.isneginf(m[0, 0]),
                                              torch.ones(t, s, dtype=torch.bool, device=self.device).tril()):
            result = None, True, None  # a band on the diagonal: torch's own causal kernel
        else:
            empty = torch.isneginf(m).all(-1) if partial else None
            result = m, False, empty if empty is not None and bool(empty.any()) else None
        self._remember(key, result)
        return result

    def _recall(self, key):
        """A mask `_remember`ed under key, of this call or kept with the plan; None if none."""
        found = self._cache.get(key)
        if found is None and self._kept is not None:
            found = self._kept.get(key)
        return found

    def _remember(self, key, result):
        """Keep a (mask, is_causal, empty) for this call, and with the plan (`shared`) when small."""
        if len(self._cache) < 64:
            self._cache[key] = result
        size = sum(x.numel() * x.element_size() for x in (result[0], result[2]) if x is not None)
        if self._kept is not None and size <= _KEPT_MASK_BYTES and len(self._kept) < 64:
            self._kept[key] = result

    def band_batches(self, *xs):
        """The batch indices to run a band's calls over: (None,) when every tensor's batch and
        heads are laid out one after another (one call takes them all), else each b."""
        if self.B == 1 or all(x.stride(0) == x.shape[1] * x.stride(1) for x in xs):
            return (None,)
        return tuple(range(self.B))

    def band_view(self, x, b, g, r0, n, width):
        """(B, h, L, X) -> `(h/G, n, width, X)` (b None: `(B*h/G, n, width, X)`): a view of `width`
        rows from r0 + i*bq for each block i of a band, heads g, g + G, .. (G: the GQA group for
        queries, 1 for keys). Keys overlap from block to block: a strided view, never a copy.

        Heads in the kernel's batch, blocks as its heads: its work items run in that order, so
        a thread's next item is the next block of the same head, whose keys are mostly the
        ones it just read (measured 117-121 vs 135-142 ms of CPU for the band at N = 16384,
        tiles of 32, 1 thread; 128-134 vs 144-158 at 2)."""
        G = self.G if x.shape[1] == self.H else 1
        s0, s1, s2, s3 = x.stride()
        offset = x.storage_offset() + g * s1 + r0 * s2
        heads = x.shape[1] // G
        if b is None:
            return x.as_strided((self.B * heads, n, width, x.shape[3]), (G * s1, self.bq * s2, s2, s3), offset)
        return x.as_strided((heads, n, width, x.shape[3]), (G * s1, self.bq * s2, s2, s3), offset + b * s0)

    def band(self, q, k, v, out, lse, r0, n, pieces, acc):
        """Forward of a band (see `runs`): per GQA group position and piece one kernel call over
        its blocks (in equal calls of less than `_BAND_CHUNK_BYTES` of output), pieces merged by
        log-sum-exp, written into out and lse (None: not kept)."""
        lse4 = None if lse is None else lse[..., None]  # (B, H, T, 1): viewed like out
        masks = [self.band_mask(r0, a, e, partial) for a, e, partial in pieces]  # the same for every block
        empties = any(m[2] is not None for m in masks)
        batches = self.band_batches(q, k, v)
        heads = (self.B if batches == (None,) else 1) * (self.H // self.G)
        calls = n * heads * self.bq * self.Dv * out.element_size() // _BAND_CHUNK_BYTES + 1
        chunk = -(-n // calls)  # blocks per call
        for b in batches:
            for g in range(self.G):
                for j in range(0, n, chunk):
                    rj, nj = r0 + j * self.bq, min(chunk, n - j)
                    parts = []
                    for (a, e, _), (m, is_causal, empty) in zip(pieces, masks):
                        kb, vb = (self.band_view(x, b, 0, rj + a, nj, e - a) for x in (k, v))
                        o, lp = flash_lse(self.band_view(q, b, g, rj, nj, self.bq), kb, vb, causal=is_causal,
                                          scale=self.scale, mask=m, empty=empty)
                        parts.append((o, lp[..., None].to(acc)))  # (heads, nj, bq, Dv), (heads, nj, bq, 1)
                    # one piece where every row has a key: the kernel's own result (no pass to zero empty rows)
                    o, lp = parts[0] if len(parts) == 1 and not empties else lse_merge(parts, acc, q.dtype)
                    self.band_view(out, b, g, rj, nj, self.bq).copy_(o)
                    if lse4 is not None:
                        self.band_view(lse4, b, g, rj, nj, self.bq).copy_(lp)
                    # freed before the next call allocates its own: one chunk's block, reused from
                    # glibc's heap; two alive at once leave a free top that glibc returns to the
                    # system, faulted in afresh by the next call
                    del o, lp, parts

    def piece_mask(self, r0, r1, c0, c1, partial):
        """(float mask laid out for the folded queries or None, is_causal, rows-empty or None).

        A mask that depends on q - kv only (causal, sliding windows) is the same for every
        piece at the same offset from the diagonal: built once, for forward and backward.
        """
        key = None
        if self.pred is not None and self.pred.relative and self.score_mod is None and self.dense is None:
            key = (r0 + self.S - self.T - c0, r1 - r0, c1 - c0, partial)
            found = self._recall(key)
            if found is not None:
                return found
        result = self._piece_mask(r0, r1, c0, c1, partial)
        if key is not None:
            self._remember(key, result)
        return result

    def _piece_mask(self, r0, r1, c0, c1, partial):
        t, s = r1 - r0, c1 - c0
        m = block_mask(self.pred, self.dense, self.score_mod, self.B, self.H, self.T, self.S, r0, r1, c0, c1,
                        partial, self.dtype, self.device)
        if m is None:
            return None, False, None
        if self.G == 1 and t == s and m.shape[0] == m.shape[1] == 1 and t > 1 and partial \
                and self.score_mod is None and self.dense is None:
            tril = torch.ones(t, s, dtype=torch.bool, device=self.device).tril()
            if torch.equal(~torch.isneginf(m[0, 0]), tril):
                return None, True, None  # the causal diagonal tile: torch's own causal kernel
        empty = torch.isneginf(m).all(-1, keepdim=True) if partial or self.dense is not None else None
        return self.fold_mask(m, t), False, None if empty is None else self.fold_mask(empty, t)

    def equal_squares(self, q, k, v) -> int:
        """n > 0 when n causal squares of equal length cover all rows and fold into the
        heads as views (MHA, heads laid out one after another): 0 otherwise."""
        sq = self.squares
        if self.G != 1 or not sq or 0 not in sq:
            return 0
        lengths = {e - a for a, e in sq.items()}
        ends = sorted(sq.values())
        if len(lengths) != 1 or ends[-1] != self.T or sorted(sq) != [0] + ends[:-1]:
            return 0
        if any(x.stride(1) != x.shape[2] * x.stride(2) for x in (q, k, v)):
            return 0
        return len(sq)

    def fold_squares(self, n, *xs):
        """(B, H, T, X) -> (B, H*n, T/n, X): views for q, k, v (see `equal_squares`)."""
        return [x.reshape(self.B, x.shape[1] * n, self.T // n, x.shape[-1]) for x in xs]

    def square_rows(self, x, r0, r1):
        """(B, H, T, X) rows r0..r1 -> (B*Hkv, G, t, X): a K/V head's G query heads as heads."""
        return x[:, :, r0:r1].reshape(self.B * self.Hkv, self.G, r1 - r0, x.shape[-1])

    def square(self, q, k, v, r0, r1):
        """q, k, v of the causal square r0..r1 for one causal call: K/V heads become the
        batch and are read by their G query heads through a stride-0 view (no copies)."""
        t, BK = r1 - r0, self.B * self.Hkv
        ks = k[:, :, r0:r1].reshape(BK, 1, t, self.D).expand(BK, self.G, t, self.D)
        vs = v[:, :, r0:r1].reshape(BK, 1, t, self.Dv).expand(BK, self.G, t, self.Dv)
        return self.square_rows(q, r0, r1), ks, vs

    def fold_mask(self, m, t):
        m = fold_mask(m, self.B, self.Hkv, self.G, t)
        if self.P > 1 and m.shape[2] > 1:
            m = m.reshape(m.shape[0], self.P, self.G // self.P * t, m.shape[3])
        return m

    def fold(self, x, t):
        """(B, H, t, X) -> (B, Hkv*P, G/P*t, X): the G query heads of a K/V head as rows."""
        return x.reshape(self.B, self.Hkv * self.P, self.G // self.P * t, x.shape[-1])

    def kv(self, x, c0, c1):
        x = x[:, :, c0:c1]
        return x.expand(self.B, self.P, c1 - c0, x.shape[-1]) if self.P > 1 else x


class _MergedFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fp: _FusedPlan):
        B, H, T, Dv = fp.B, fp.H, fp.T, fp.Dv
        acc = acc_dtype(q.dtype)
        n = ctx.n = fp.equal_squares(q, k, v)
        if n:  # causal, or equal documents & causal: one call, the squares folded into the heads
            o, lp = flash_lse(*fp.fold_squares(n, q, k, v), causal=True, scale=fp.scale)
            out, lse = o.view(B, H, T, Dv), lp.reshape(B, H, T).to(acc) if fp.keep_lse else None
        else:
            out = output((B, H, T, Dv), q.dtype, q.device)
            lse = torch.full((B, H, T), float("-inf"), dtype=acc, device=q.device) if fp.keep_lse else None
        for kind, r0, r1, pieces in fp.planned_runs() if not n else ():
            if kind == "band":  # r1: the band's number of blocks
                fp.band(q, k, v, out, lse, r0, r1, pieces, acc)
                continue
            if not pieces:
                out[:, :, r0:r1] = 0
                continue
            if pieces[0][2] is CAUSAL:
                o, lp = flash_lse(*fp.square(q, k, v, r0, r1), causal=True, scale=fp.scale)
                out[:, :, r0:r1] = o.reshape(B, H, r1 - r0, Dv)
                if lse is not None:
                    lse[:, :, r0:r1] = lp.reshape(B, H, r1 - r0)
                continue
            t = r1 - r0
            qf = fp.fold(q[:, :, r0:r1], t)
            parts = []
            for c0, c1, partial in pieces:
                m, is_causal, empty = fp.piece_mask(r0, r1, c0, c1, partial)
                o, lp = flash_lse(qf, fp.kv(k, c0, c1), fp.kv(v, c0, c1), causal=is_causal, scale=fp.scale,
                                  mask=m, empty=None if empty is None else empty[..., 0])
                parts.append((o, lp[..., None].to(acc)))  # lse (B, Hkv*P, G/P*t, 1)
            o, lp = lse_merge(parts, acc, q.dtype)
            out[:, :, r0:r1] = o.reshape(B, H, t, Dv)
            if lse is not None:
                lse[:, :, r0:r1] = lp.reshape(B, H, t)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.fp = fp
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        fp: _FusedPlan = ctx.fp
        assert lse is not None, "the forward kept no log-sum-exp but a backward runs"
        if torch.is_grad_enabled():  # create_graph: differentiable recomputation (see `twice`)
            def recompute(qq, kk, vv):
                tiles = Tiles(qq, kk, vv, fp.pred, fp.dense, fp.score_mod, fp.scale, 0.0,
                              explicit_tiles.default_tile(), 0)
                return tiles.recompute(qq, kk, vv, fp.dense)

            return (*twice(ctx.needs_input_grad, (q, k, v), d_out, recompute), None)
        acc = acc_dtype(q.dtype)
        d_out = d_out.to(q.dtype)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        n = ctx.n
        if n:  # every row in a causal square: one backward call, no accumulators
            lf = lse.reshape(fp.B, fp.H * n, fp.T // n).to(lse_dtype)
            gq, gk, gv = flash_lse_backward(*fp.fold_squares(n, d_out, q, k, v, out), lf, causal=True, scale=fp.scale)
            return (gq.reshape(q.shape).to(q.dtype), gk.reshape(k.shape).to(k.dtype),
                    gv.reshape(v.shape).to(v.dtype), None)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        lse = backward_lse(lse)  # rows with no key: P = 0, no gradient
        # block by block, also where the forward ran bands: a band's backward call returns dk, dv per
        # block, (window + bq) / bq times the size of dk (9x at tiles of 32 under a window of 256), and
        # ran slower than these calls
        if fp.replan is not None:
            fp = fp.replan()
        for r0, r1, pieces in fp.blocks():
            if pieces and pieces[0][2] is CAUSAL:
                qs, ks, vs = fp.square(q, k, v, r0, r1)
                gs, os_ = fp.square_rows(d_out, r0, r1), fp.square_rows(out, r0, r1)
                ls = fp.square_rows(lse[..., None], r0, r1)[..., 0].to(lse_dtype)
                gq, gk, gv = flash_lse_backward(gs, qs, ks, vs, os_, ls, causal=True, scale=fp.scale)
                t = r1 - r0
                dq[:, :, r0:r1] += gq.reshape(fp.B, fp.H, t, -1)
                dk[:, :, r0:r1] += gk.sum(1).reshape(fp.B, fp.Hkv, t, -1)
                dv[:, :, r0:r1] += gv.sum(1).reshape(fp.B, fp.Hkv, t, -1)
                continue
            t = r1 - r0
            qf, of, gf = (fp.fold(x[:, :, r0:r1], t) for x in (q, out, d_out))
            lf = fp.fold(lse[:, :, r0:r1, None], t)[..., 0].to(lse_dtype)
            for c0, c1, partial in pieces:
                m, is_causal, _ = fp.piece_mask(r0, r1, c0, c1, partial)
                gq, gk, gv = flash_lse_backward(gf, qf, fp.kv(k, c0, c1), fp.kv(v, c0, c1), of, lf, causal=is_causal,
                                                scale=fp.scale, mask=m)
                dq[:, :, r0:r1] += gq.reshape(fp.B, fp.H, t, -1)
                dk[:, :, c0:c1] += gk.sum(1, keepdim=True) if fp.P > 1 else gk
                dv[:, :, c0:c1] += gv.sum(1, keepdim=True) if fp.P > 1 else gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
