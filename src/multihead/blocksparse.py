"""Block-sparse attention: time and memory follow the pairs a mask allows, not T x S.

The score matrix `(T, S)` is cut into tiles of bq queries x bk keys. A mask predicate
(`multihead.masks`) classifies every tile as empty (skipped), full (run without a mask)
or partial (run with the dense mask of that tile only), analytically for the built-in
predicates and by evaluating one strip of rows at a time for any other. Nothing of
size `(T, S)` is ever built. Two engines run the kept tiles:

- `fused`: per block of queries, the contiguous range of key tiles it keeps goes to
  torch's fused `F.scaled_dot_product_attention` in one call, with a small dense mask
  (rows x kept keys) only when a tile in the range is not full; an additive score mod
  (ALiBi) rides along as that call's float mask. Autograd goes through the fused
  calls, so training memory stays O(N). Rows that attend exactly causally among
  themselves (plain causal; each packed document of `document & causal`) are found
  first and run as one call of torch's causal kernel each ("causal squares"), which
  skips the upper triangle itself: no pieces, no merges.
- `explicit`: any score mod (softcap) and dropout, tile by tile with an online softmax
  (FlashAttention-2, Dao 2023). A custom autograd Function saves only q, k, v, the
  output and the per-row log-sum-exp, and its backward recomputes each kept tile's
  probabilities from the log-sum-exp; dropout keeps are regenerated from a per-tile
  seed. Training memory: O(N) plus one tile.

GQA never copies K/V: the G query heads sharing a K/V head are folded into the query
rows of a block, `(B, H, t, D) -> (B, Hkv, G*t, D)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.kernels.common import acc_dtype, index, lse_merge, mqa_splits
from multihead.masks import MaskMod, and_masks
from multihead.masks import causal as causal_mod

__all__ = ["explicit", "fused", "plan", "tile_sizes"]

# Tile edges. None: the fused engine picks its tile per call (`_choose_tile`): short
# query blocks keep the key range of a local mask tight, long ones let torch's kernel
# use its big blocks. The explicit engine: 256 measured fastest for softcap at N = 4096
# (128: 5% slower, 512 and 1024: 8-15%), its (B, H, 256, 256) temporaries staying in cache.
FUSED_TILE: int | None = None
EXPLICIT_TILE = 256
_FUSED_CANDIDATES = (64, 128, 256, 512, 1024)
_ONE_CALL_SPAN = 512  # keys: below this a query block's pieces run as one masked call
_MIN_SEGMENT = 64  # documents shorter than this on average run as tiles, not a call each


def tile_sizes(T: int, S: int, tile: int) -> tuple[int, int]:
    return max(1, min(T, tile)), max(1, min(S, tile))


def _combine(mask, causal: bool) -> tuple[MaskMod | None, Tensor | None]:
    """Split a kernel mask into (predicate, dense tensor) and fold `causal` into the predicate."""
    pred = mask if isinstance(mask, MaskMod) else None
    dense = mask if isinstance(mask, Tensor) else None
    if causal:
        pred = causal_mod() if pred is None else and_masks(pred, causal_mod())
    return pred, dense


def plan(pred: MaskMod | None, B: int, H: int, T: int, S: int, bq: int, bk: int, device) -> tuple[Tensor, Tensor]:
    """Per tile, over all batches and heads: (kept, full) bool `(nq, nk)` on the CPU.

    A tile is kept when some (b, h) may attend a pair in it, and full when every (b, h)
    may attend every pair in it.
    """
    nq, nk = -(-T // bq), -(-S // bk)
    if pred is None:
        ones = torch.ones(nq, nk, dtype=torch.bool)
        return ones, ones
    any_, all_ = pred.tiles(B, H, T, S, bq, bk, device)
    any_ = any_.expand(-1, -1, nq, nk).flatten(0, 1).any(0)
    all_ = all_.expand(-1, -1, nq, nk).flatten(0, 1).all(0)
    return any_.cpu(), all_.cpu()


def _kernel_efficiency(rows: int) -> float:
    """Relative speed of torch's CPU flash kernel by query rows per call: it splits queries
    in blocks of 32 below 192 rows, 64 below 768, 256 above (measured ~0.55 : 0.8 : 1)."""
    return 0.55 if rows < 192 else 0.8 if rows < 768 else 1.0


def _choose_tile(pred, B, H, T, S, G, tile, device, squares: bool = True):
    """(bq, bk, kept, full, squares): a fixed tile, or the candidate of least estimated kernel time.

    Estimated time = pairs computed (rows x kept keys, tile-granular) / kernel efficiency
    at that many (GQA-folded) rows, plus a cost per call; a causal square (see
    `_causal_squares`) is one call at full efficiency over half its pairs. Only analytic
    predicates are planned more than once: planning a generic predicate evaluates it
    over all pairs. `squares=False`: the engine cannot run squares (a score mod, a dense
    mask, or torch's math path behind it), so none are looked for or costed.
    """
    find = _causal_squares if squares else lambda *args: {}
    segments = _segment_squares(pred, B, H, T, S, device) if pred is not None and squares else {}
    if segments or tile is not None or pred is None or not pred.analytic:
        bq, bk = tile_sizes(T, S, tile or (256 if segments else 128))
        kept, full = plan(pred, B, H, T, S, bq, bk, device)
        return bq, bk, kept, full, segments or find(pred, B, H, T, S, bq, bk, kept, full, device)
    best = None
    threads = max(1, torch.get_num_threads())
    for c in _FUSED_CANDIDATES if T > _FUSED_CANDIDATES[0] else (256,):  # decoding: one plan, one block
        bq, bk = tile_sizes(T, S, c)
        kept, full = plan(pred, B, H, T, S, bq, bk, device)
        found = find(pred, B, H, T, S, bq, bk, kept, full, device)
        in_square = torch.zeros(kept.shape[0], dtype=torch.bool)
        pairs, calls = 0.0, 0
        for r0, r1 in found.items():
            in_square[r0 // bq:-(-r1 // bq)] = True
            pairs, calls = pairs + (r1 - r0) * (r1 - r0 + 1) / 2, calls + 1
        rest = kept[~in_square]
        # seconds at ~20 GFLOP/s per thread and head, plus ~0.5 ms per call (mask, merge, dispatch)
        pairs += float(rest.sum()) * bq * bk / _kernel_efficiency(G * bq)
        calls += int((~in_square).sum())
        cost = pairs * H * 4 * 64 / 20e9 / threads + calls * 5e-4
        if best is None or cost < best[0] * 0.97:
            best = (cost, bq, bk, kept, full, found)
        if bq == T and bk == S or bool(in_square.all()):  # all causal squares: the tile no longer matters
            break
    return best[1:]


def _and_leaves(pred: MaskMod) -> list[MaskMod]:
    if pred._op == "and":
        return [leaf for part in pred._parts for leaf in _and_leaves(part)]
    return [pred]


def _over_differences(leaf: MaskMod, n: int, B: int, H: int, device) -> tuple[Tensor, Tensor]:
    """(allowed `(B*H or 1, 2n - 1)`, lower `(2n - 1,)`): a function of d = q - kv alone
    (`leaf.relative`) at every d of an n x n block on the diagonal, -(n - 1) .. n - 1, and
    where the causal triangle has it (d >= 0). O(n) evaluations instead of n^2."""
    d = torch.arange(-(n - 1), n, device=device)
    at = torch.full((1, 1, 1, 1), n - 1, device=device)
    allowed = leaf.evaluate(index(B, 0, device), index(H, 1, device), at + d.view(1, 1, -1, 1), at, 0)
    return allowed.reshape(-1, d.numel()), d >= 0


def _diagonal_tril(pred: MaskMod, B: int, H: int, T: int, bq: int, device) -> Tensor | None:
    """(nq,) bool: the diagonal tile (i, i) of `pred` (S == T, square tiles) is exactly
    lower-triangular for every batch and head; None when that cannot be told cheaply.

    Told without evaluating every diagonal tile: `pred` is an `&` of parts of which one
    is a function of q - kv alone that is lower-triangular on a diagonal tile (causal;
    a sliding window at least a tile wide), and the others are full on that tile.
    """
    leaves = _and_leaves(pred)
    nq = -(-T // bq)
    by_d = {leaf: _over_differences(leaf, bq, B, H, device)[0]
            for leaf in leaves if leaf.relative and not leaf.top_left}  # (B*H or 1, 2bq - 1)
    lower = torch.arange(-(bq - 1), bq, device=device) >= 0
    for leaf, m in by_d.items():
        if not bool((m == lower).all()):  # not exactly the lower triangle
            continue
        ok = torch.ones(nq, dtype=torch.bool)
        for other in leaves:
            if other is leaf:
                continue
            if other in by_d:  # holds the triangle (a second causal, a wide window)?
                ok &= bool((by_d[other] | ~lower).all())
            elif other.analytic:
                all_ = other.tiles(B, H, T, T, bq, bq, device)[1]
                ok &= all_.expand(-1, -1, nq, nq).flatten(0, 1).all(0).diagonal().cpu()
            else:
                return None
        return ok
    return None


def _causal_squares(pred, B, H, T, S, bq, bk, kept, full, device) -> dict[int, int]:
    """Runs of query blocks that attend exactly causally among themselves: {first row: end row}.

    Block rows a..e-1 form a square when each row i keeps exactly the key tiles a..i,
    those left of the diagonal full and the diagonal one exactly lower-triangular. Rows
    a*bq..e*bq then attend keys a*bq..e*bq causally: one call of torch's causal kernel,
    which skips the upper half itself, replaces 2 (e - a) pieces and their merges. Plain
    causal is one square; packed documents & causal one square per document (when the
    documents start on tile edges).
    """
    if pred is None or T != S or bq != bk or T < 2:
        return {}
    diag = _diagonal_tril(pred, B, H, T, bq, device)
    if diag is None or not bool(diag.any()):
        return {}
    nq = kept.shape[0]
    cols = torch.arange(kept.shape[1])
    # per row: first kept tile, kept tiles, full tiles left of the diagonal, diagonal kept and tril
    first = torch.where(kept, cols, kept.shape[1]).amin(1).tolist()
    n_kept = kept.sum(1).tolist()
    n_full = (full & (cols < torch.arange(nq)[:, None])).sum(1).tolist()
    on_diag = (kept[:, :nq].diagonal() & diag).tolist() if kept.shape[1] >= nq else [False] * nq
    squares, i = {}, 0
    while i < nq:
        a = i  # row i keeps exactly tiles a..i, full left of the diagonal:
        while i < nq and on_diag[i] and first[i] == a and n_kept[i] == i - a + 1 and n_full[i] == i - a:
            i += 1
        if i > a:
            squares[a * bq] = min(T, i * bq)
        else:
            i += 1
    return squares


def _segment_squares(pred: MaskMod, B: int, H: int, T: int, S: int, device) -> dict[int, int]:
    """Packed documents & causal, documents anywhere (not only on tile edges): {start: end}
    rows of each document, which attends exactly causally within itself: one causal call
    per document, the time of the pairs allowed. Empty unless `pred` is an `&` of one
    predicate that knows its segments (`document` with contiguous runs of ids, the same in
    every batch) and functions of q - kv that give exactly the causal triangle over the
    longest document (causal; a sliding window at least that long), and S == T.
    """
    if T != S or T < 2:
        return {}
    leaves = _and_leaves(pred)
    runs = [leaf for leaf in leaves if leaf._segments is not None]
    if len(runs) != 1 or any(not (leaf.relative and not leaf.top_left) for leaf in leaves if leaf is not runs[0]):
        return {}
    segments = runs[0]._segments(T, S)
    if not segments or len(segments) > max(1, T // _MIN_SEGMENT):
        return {}  # no runs, or many short documents: tiles do better than a call per document
    L = max(e - a for a, e in segments)  # over the longest document
    by_d = [_over_differences(leaf, L, B, H, device)[0] for leaf in leaves if leaf is not runs[0]]
    lower = torch.arange(-(L - 1), L, device=device) >= 0
    if not any(bool((m == lower).all()) for m in by_d) or not all(bool((m | ~lower).all()) for m in by_d):
        return {}
    return dict(segments)


def _slice_dense(dense: Tensor, r0: int, r1: int, c0: int, c1: int) -> Tensor:
    rows = slice(r0, r1) if dense.shape[2] > 1 else slice(None)
    cols = slice(c0, c1) if dense.shape[3] > 1 else slice(None)
    return dense[:, :, rows, cols]


def _block_mask(pred, dense, score_mod, B, H, T, S, r0, r1, c0, c1, need_pred, dtype, device):
    """The mask of one block (rows r0..r1, keys c0..c1): None, bool, or float (additive)."""
    b, h = index(B, 0, device), index(H, 1, device)
    rows, kv = index(r1 - r0, 2, device, r0), index(c1 - c0, 3, device, c0)
    allowed = bias = None
    if pred is not None and need_pred:
        allowed = pred.evaluate(b, h, rows, kv, S - T)
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    if dense is not None:
        d = _slice_dense(dense, r0, r1, c0, c1)
        if d.dtype == torch.bool:
            allowed = d if allowed is None else allowed & d
        else:
            bias = d
    if score_mod is not None:
        sb = score_mod.bias_tile(b, h, rows, kv, S - T, dtype)
        sb = sb.reshape((1,) * (4 - sb.dim()) + tuple(sb.shape))
        bias = sb if bias is None else bias + sb
    if bias is None:
        if allowed is None:
            return None
        # torch's CPU kernel runs a float mask faster than a bool one (measured 1.3-1.6x)
        bias = torch.zeros((), dtype=dtype, device=device).expand(allowed.shape)
    bias = bias.to(dtype)
    return bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))


def _fold_mask(m: Tensor | None, B: int, Hkv: int, G: int, t: int) -> Tensor | None:
    """A block mask `(Bm, Hm, t|1, s)` laid out for queries folded as `(B, Hkv, G*t, D)`."""
    if m is None or G == 1:
        return m
    Bm, Hm, tm, s = m.shape
    if Hm == 1 and tm == 1:
        return m  # broadcasts over the folded rows
    if Hm == 1:
        return m.expand(Bm, G, t, s).reshape(Bm, 1, G * t, s)  # (Bm, 1, G*t, s)
    return m.expand(Bm, Hm, t, s).reshape(Bm, Hkv, G * t, s)  # (Bm, Hkv, G*t, s)


def _fused_call(q, k, v, m, scale, dropout_p):
    """F.scaled_dot_product_attention on a block, GQA folded, K/V never copied."""
    B, H, t, D = q.shape
    Hkv, s, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    if G == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout_p, scale=scale)
    qf = q.reshape(B, Hkv, G * t, D)  # (B, Hkv, G*t, D)
    mf = _fold_mask(m, B, Hkv, G, t)
    P = mqa_splits(B, Hkv, G, q.device)  # MQA: the one folded head split over the CPU threads
    if P > 1:
        qf = qf.reshape(B, P, G // P * t, D)  # (B, P, G/P*t, D)
        if mf is not None and mf.shape[2] > 1:
            mf = mf.reshape(mf.shape[0], P, G // P * t, mf.shape[3])
        k, v = k.expand(B, P, s, D), v.expand(B, P, s, Dv)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf, dropout_p=dropout_p, scale=scale)
    return out.reshape(B, H, t, Dv)


def refuse_trainable(score_mod, q: Tensor, S: int, engine: str) -> None:
    """Raise when autograd records the call and the mod captures tensors that require grad
    (a learned bias, ALiBi slopes being trained), or cannot be probed for them: `engine`
    (which applies the mod outside autograd) would silently leave them without a gradient."""
    if not torch.is_grad_enabled():
        return
    trainable = score_mod.trainable(q.device, q.shape, S)
    if trainable is False:
        return
    why = "holds tensors that require grad" if trainable else \
        "raised on a probe of its first 2 x 2 scores, so whether it holds tensors that require grad is unknown"
    raise ValueError(f"score mod {score_mod.name} {why}; {engine} would not train them; backends that can: "
                     f"'chunked', 'math' (what 'auto' picks for such a mod)")


def _needs_grad(dense: Tensor | None) -> bool:
    """A float mask autograd must differentiate (a learned bias), in a call that records grads."""
    return dense is not None and dense.is_floating_point() and dense.requires_grad and torch.is_grad_enabled()


def _twice(ctx, saved, d_out, recompute):
    """The backward when autograd records it (create_graph=True: a gradient penalty, double
    backward): the attention recomputed with differentiable ops (`_Tiles.recompute`) from the
    saved inputs, and its gradient taken with the graph, so the second-order terms are exact.
    The fast backwards write into buffers with no graph, which would drop them silently."""
    wanted = [i for i, x in enumerate(saved) if x is not None and ctx.needs_input_grad[i]]
    out = recompute(*saved)
    if not out.requires_grad:  # every row empty: no gradient anywhere
        return [None] * len(saved)
    grads = torch.autograd.grad(out, [saved[i] for i in wanted], d_out, create_graph=True, allow_unused=True)
    result = [None] * len(saved)
    for i, g in zip(wanted, grads):
        result[i] = g
    return result


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
    pred, dense = _combine(mask, causal)
    # a float mask that requires grad (T5's position bias) gets its gradient from autograd through
    # the public kernel's calls; the LSE engine's backward has no mask gradient
    lse_engine = _CPU_FLASH is not None and q.device.type == "cpu" and dropout_p == 0 and q.shape[-1] == Dv \
        and not torch.compiler.is_compiling() and not _needs_grad(dense)
    # a square is one causal call: no room for a score mod's or a dense mask's bias
    runs_squares = dense is None and score_mod is None and (lse_engine or _public_squares(q, k))
    bq, bk, kept, full, squares = _choose_tile(pred, B, H, T, S, q.shape[1] // k.shape[1], tile or FUSED_TILE,
                                               q.device, squares=runs_squares)
    if lse_engine:
        fp = _FusedPlan(q, k, v, pred, dense, score_mod, scale, bq, bk, kept, full, squares)
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
        m = _block_mask(pred, dense, score_mod, B, H, T, S, r0, r1, c0, c1, need_pred, q.dtype, q.device)
        outs.append(_fused_call(q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], m, scale, dropout_p))
        i = i1
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# ------------------------------------------- fused pieces merged by log-sum-exp (CPU)

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
if _CPU_FLASH_BWD is None:
    _CPU_FLASH = None


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

    def __init__(self, q, k, v, pred, dense, score_mod, scale, bq, bk, kept, full, squares):
        self.squares = squares  # {first row: end row} of the causal squares (none with a mod or dense mask)
        self.B, self.H, self.T, self.D = q.shape
        self.Hkv, self.S, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = self.H // self.Hkv
        self.pred, self.dense, self.score_mod, self.scale = pred, dense, score_mod, scale
        self.bq, self.bk, self.kept, self.full = bq, bk, kept, full
        self.dtype, self.device = q.dtype, q.device
        self._cache = {}
        self.P = mqa_splits(self.B, self.Hkv, self.G, q.device)  # MQA: P stride-0 heads, one per thread

    def blocks(self):
        """(r0, r1, [(c0, c1, partial), ...]) per query block; empty blocks have no pieces.

        A causal square is one block with the one piece `(r0, r1, CAUSAL)`.
        """
        nq, nk = self.kept.shape
        i = 0
        while i < nq:
            if i * self.bq in self.squares:
                r = i * self.bq
                while r in self.squares:  # squares of documents may end off the tile edges
                    yield r, self.squares[r], [(r, self.squares[r], CAUSAL)]
                    r = self.squares[r]
                i = -(-r // self.bq)
                continue
            pieces, j = [], 0
            row_kept, row_full = self.kept[i].tolist(), self.full[i].tolist()
            while j < nk:
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
                while i1 < nq and torch.equal(self.kept[i1], self.kept[i]) \
                        and torch.equal(self.full[i1], self.full[i]) and (i1 + 1 - i) * self.bq * span <= 1 << 22:
                    i1 += 1
            if len(pieces) > 1 and pieces[-1][1] - pieces[0][0] <= _ONE_CALL_SPAN:
                # a short range: one masked call costs less than a call per piece
                pieces = [(pieces[0][0], pieces[-1][1], True)]
            yield i * self.bq, min(self.T, i1 * self.bq), pieces
            i = i1

    def piece_mask(self, r0, r1, c0, c1, partial):
        """(float mask laid out for the folded queries or None, is_causal, rows-empty or None).

        A mask that depends on q - kv only (causal, sliding windows) is the same for every
        piece at the same offset from the diagonal: built once, for forward and backward.
        """
        key = None
        if self.pred is not None and self.pred.relative and self.score_mod is None and self.dense is None:
            key = (r0 + self.S - self.T - c0, r1 - r0, c1 - c0, partial)
            if key in self._cache:
                return self._cache[key]
        result = self._piece_mask(r0, r1, c0, c1, partial)
        if key is not None and len(self._cache) < 64:
            self._cache[key] = result
        return result

    def _piece_mask(self, r0, r1, c0, c1, partial):
        t, s = r1 - r0, c1 - c0
        m = _block_mask(self.pred, self.dense, self.score_mod, self.B, self.H, self.T, self.S, r0, r1, c0, c1,
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
        m = _fold_mask(m, self.B, self.Hkv, self.G, t)
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
            o, lp = _CPU_FLASH(*fp.fold_squares(n, q, k, v), 0.0, True, scale=fp.scale)
            out, lse = o.view(B, H, T, Dv), lp.reshape(B, H, T).to(acc)
        else:
            out = q.new_empty(B, H, T, Dv)
            lse = torch.full((B, H, T), float("-inf"), dtype=acc, device=q.device)
        for r0, r1, pieces in fp.blocks() if not n else ():
            if not pieces:
                out[:, :, r0:r1] = 0
                continue
            if pieces[0][2] is CAUSAL:
                o, lp = _CPU_FLASH(*fp.square(q, k, v, r0, r1), 0.0, True, scale=fp.scale)
                out[:, :, r0:r1] = o.reshape(B, H, r1 - r0, Dv)
                lse[:, :, r0:r1] = lp.reshape(B, H, r1 - r0)
                continue
            t = r1 - r0
            qf = fp.fold(q[:, :, r0:r1], t)
            parts = []
            for c0, c1, partial in pieces:
                m, is_causal, empty = fp.piece_mask(r0, r1, c0, c1, partial)
                o, lp = _CPU_FLASH(qf, fp.kv(k, c0, c1), fp.kv(v, c0, c1), 0.0, is_causal, attn_mask=m,
                                   scale=fp.scale)
                lp = lp[..., None].to(acc)  # (B, Hkv*P, G/P*t, 1)
                if empty is not None:
                    lp = lp.masked_fill(empty, float("-inf"))  # the kernel reports 0 for a row with no key
                parts.append((o, lp))
            o, lp = lse_merge(parts, acc, q.dtype)
            out[:, :, r0:r1] = o.reshape(B, H, t, Dv)
            lse[:, :, r0:r1] = lp.reshape(B, H, t)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.fp = fp
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        fp: _FusedPlan = ctx.fp
        if torch.is_grad_enabled():  # create_graph: differentiable recomputation (see `_twice`)
            def recompute(qq, kk, vv):
                tiles = _Tiles(qq, kk, vv, fp.pred, fp.dense, fp.score_mod, fp.scale, 0.0, EXPLICIT_TILE, 0)
                return tiles.recompute(qq, kk, vv, fp.dense)

            return (*_twice(ctx, (q, k, v), d_out, recompute), None)
        acc = acc_dtype(q.dtype)
        d_out = d_out.to(q.dtype)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        n = ctx.n
        if n:  # every row in a causal square: one backward call, no accumulators
            lf = lse.reshape(fp.B, fp.H * n, fp.T // n).to(lse_dtype)
            gq, gk, gv = _CPU_FLASH_BWD(*fp.fold_squares(n, d_out, q, k, v, out), lf, 0.0, True, scale=fp.scale)
            return (gq.reshape(q.shape).to(q.dtype), gk.reshape(k.shape).to(k.dtype),
                    gv.reshape(v.shape).to(v.dtype), None)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # rows with no key: P = 0, no gradient
        for r0, r1, pieces in fp.blocks():
            if pieces and pieces[0][2] is CAUSAL:
                qs, ks, vs = fp.square(q, k, v, r0, r1)
                gs, os_ = fp.square_rows(d_out, r0, r1), fp.square_rows(out, r0, r1)
                ls = fp.square_rows(lse[..., None], r0, r1)[..., 0].to(lse_dtype)
                gq, gk, gv = _CPU_FLASH_BWD(gs, qs, ks, vs, os_, ls, 0.0, True, scale=fp.scale)
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
                gq, gk, gv = _CPU_FLASH_BWD(gf, qf, fp.kv(k, c0, c1), fp.kv(v, c0, c1), of, lf, 0.0, is_causal,
                                            attn_mask=m, scale=fp.scale)
                dq[:, :, r0:r1] += gq.reshape(fp.B, fp.H, t, -1)
                dk[:, :, c0:c1] += gk.sum(1, keepdim=True) if fp.P > 1 else gk
                dv[:, :, c0:c1] += gv.sum(1, keepdim=True) if fp.P > 1 else gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# ------------------------------------------------------------- the explicit engine


class _Tiles:
    """What both directions of the explicit engine share: shapes, the plan, tile buffers.

    Queries are folded as in the fused engine, `(B*Hkv, G*t, D)`, so a tile's scores are one
    batched matmul `(B*Hkv, G*t, s)`, seen as `(B, H, t, s)` by masks and score mods. The
    tile temporaries live in buffers allocated once per call: a fresh multi-MiB tensor per
    tile costs page faults that matter as much as the arithmetic (measured 2x on q k^T).
    """

    def __init__(self, q, k, v, pred, dense, score_mod, scale, dropout_p, tile, seed):
        self.B, self.H, self.T, self.D = q.shape
        self.Hkv, self.S, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = self.H // self.Hkv
        self.pred, self.dense, self.score_mod = pred, dense, score_mod
        self.scale, self.dropout_p, self.seed = scale, dropout_p, seed
        self.bq, self.bk = tile_sizes(self.T, self.S, tile)
        if self.bq < tile:  # few queries (decoding): longer key tiles of the same area, fewer steps
            self.bk = min(self.S, tile * tile // self.bq)
        self.kept, self.full = plan(pred, self.B, self.H, self.T, self.S, self.bq, self.bk, q.device)
        self.acc = acc_dtype(q.dtype)
        self.device = q.device
        # a mod with an in-place form takes its scores times `input_scale`, folded into q
        self.inplace = score_mod is not None and score_mod._inplace is not None
        self.q_scale = scale * (score_mod.input_scale if self.inplace else 1.0)
        self._buffers = {}

    def tiles(self):
        """(i, r0, r1, [(j, c0, c1, full), ...]) for every query block."""
        nq, nk = self.kept.shape
        for i in range(nq):
            r0, r1 = i * self.bq, min(self.T, (i + 1) * self.bq)
            cols = [(j, j * self.bk, min(self.S, (j + 1) * self.bk), bool(self.full[i, j]))
                    for j in range(nk) if self.kept[i, j]]
            yield i, r0, r1, cols

    def buffer(self, name: str, t: int, s: int) -> Tensor:
        """A `(B*Hkv, G*t, s)` scratch tensor, reusing one allocation per name."""
        n = self.B * self.H * t * s
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n:
            buf = self._buffers[name] = torch.empty(self.B * self.H * self.bq * max(self.bk, self.Dv),
                                                    dtype=self.acc, device=self.device)
        return buf[:n].view(self.B * self.Hkv, self.G * t, s)

    def fold_q(self, x: Tensor, r0: int, r1: int, times: float = 1.0) -> Tensor:
        """Rows r0..r1 of a `(B, H, T, X)` tensor as `(B*Hkv, G*t, X)` in the accumulation dtype."""
        x = x[:, :, r0:r1].to(self.acc)
        x = x * times if times != 1.0 else x
        return x.reshape(self.B * self.Hkv, self.G * (r1 - r0), x.shape[-1])

    def kv(self, x: Tensor, c0: int, c1: int) -> Tensor:
        """Keys c0..c1 of a `(B, Hkv, S, X)` tensor as `(B*Hkv, s, X)` (a view when x is acc-typed)."""
        return x[:, :, c0:c1].to(self.acc).reshape(self.B * self.Hkv, c1 - c0, x.shape[-1])

    def indices(self, r0, r1, c0, c1):
        return (index(self.B, 0, self.device), index(self.H, 1, self.device),
                index(r1 - r0, 2, self.device, r0), index(c1 - c0, 3, self.device, c0))

    def modded(self, s: Tensor, r0, r1, c0, c1) -> Tensor:
        """The score mod on a tile of `(B, H, t, s)` raw scores (times q_scale / scale): in place
        when the mod has an in-place form, else a new tensor (autograd may record it)."""
        if self.score_mod is None:
            return s
        if self.inplace and not s.requires_grad:
            return self.score_mod._inplace(s)
        return self.score_mod.apply(s, *self.indices(r0, r1, c0, c1), self.S - self.T)

    def dense_tile(self, r0, r1, c0, c1, dense: Tensor | None = None) -> Tensor | None:
        dense = self.dense if dense is None else dense
        return None if dense is None else _slice_dense(dense, r0, r1, c0, c1)

    def recompute(self, q: Tensor, k: Tensor, v: Tensor, dense: Tensor | None) -> Tensor:
        """The forward written with differentiable ops, one query block of kept tiles at a time
        (memory: one block's scores), the same dropout keeps: what autograd differentiates
        twice (see `_twice`). The fast paths never run it."""
        B, H, G, Hkv, Dv, acc = self.B, self.H, self.G, self.Hkv, self.Dv, self.acc
        outs = []
        for i, r0, r1, cols in self.tiles():
            t = r1 - r0
            if not cols:
                outs.append(q.new_zeros(B, H, t, Dv))
                continue
            qf = self.fold_q(q, r0, r1)  # (B*Hkv, G*t, D)
            parts = []
            for _, c0, c1, full in cols:
                x = torch.bmm(qf, self.kv(k, c0, c1).mT).view(B, H, t, c1 - c0) * self.scale
                if self.score_mod is not None:
                    x = self.score_mod.apply(x, *self.indices(r0, r1, c0, c1), self.S - self.T)
                d = self.dense_tile(r0, r1, c0, c1, dense)
                if d is not None and d.dtype != torch.bool:
                    x = x + d.to(acc)
                hide = self.hidden(r0, r1, c0, c1, full)
                parts.append(x if hide is None else x.masked_fill(hide, float("-inf")))
            x = torch.cat(parts, -1)  # (B, H, t, kept keys)
            empty = torch.isneginf(x).all(-1, keepdim=True)  # nothing to attend: zeros, not NaN
            p = torch.softmax(x.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
            if self.dropout_p > 0:
                p = p * torch.cat([self.keep(i, j, torch.empty(B, H, t, c1 - c0, dtype=acc, device=self.device))
                                   for j, c0, c1, _ in cols], -1)
            vs = torch.cat([self.kv(v, c0, c1) for _, c0, c1, _ in cols], 1)  # (B*Hkv, kept keys, Dv)
            o = torch.bmm(p.reshape(B * Hkv, G * t, -1), vs)
            outs.append(o.view(B, H, t, Dv).to(q.dtype))
        return torch.cat(outs, 2)

    def hidden(self, r0, r1, c0, c1, full) -> Tensor | None:
        """Bool `(.., t, s)`, True where the mask hides a pair of the tile; None: nothing hidden."""
        hide = None
        d = self.dense_tile(r0, r1, c0, c1)
        if d is not None and d.dtype == torch.bool:
            hide = ~d
        if self.pred is not None and not full:
            allowed = self.pred.evaluate(*self.indices(r0, r1, c0, c1), self.S - self.T)
            hide = ~allowed if hide is None else hide | ~allowed
        return hide

    def keep(self, i, j, out: Tensor) -> Tensor:
        """Tile (i, j)'s dropout keep-mask as 0 or 1 / (1 - p), written into `out`; the same
        in forward and backward (a generator seeded per tile)."""
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 1_000_003 + i * 65_537 + j) % (2 ** 63))
        torch.rand(out.shape, generator=g, device=self.device, dtype=out.dtype, out=out)
        return out.ge_(self.dropout_p).mul_(1.0 / (1.0 - self.dropout_p))


class _ExplicitTiles(torch.autograd.Function):
    """Online-softmax forward over kept tiles; backward recomputes tiles from the LSE."""

    @staticmethod
    def forward(ctx, q, k, v, dense, tiles: _Tiles):
        """`dense`: the float mask when it requires grad (its gradient is returned), else None."""
        B, H, T, Dv, G, Hkv = tiles.B, tiles.H, tiles.T, tiles.Dv, tiles.G, tiles.Hkv
        acc = tiles.acc
        out = q.new_zeros(B, H, T, Dv)
        lse = torch.full((B, H, T), float("-inf"), dtype=acc, device=q.device)
        with torch.no_grad():
            for i, r0, r1, cols in tiles.tiles():
                if not cols:
                    continue
                t = r1 - r0
                qf = tiles.fold_q(q, r0, r1, tiles.q_scale)  # (B*Hkv, G*t, D)
                m = torch.full((B, H, t, 1), float("-inf"), dtype=acc, device=q.device)
                l_ = torch.zeros(B, H, t, 1, dtype=acc, device=q.device)
                o = torch.zeros(B * Hkv, G * t, Dv, dtype=acc, device=q.device)
                for j, c0, c1, full in cols:
                    s_ = c1 - c0
                    s = torch.bmm(qf, tiles.kv(k, c0, c1).mT, out=tiles.buffer("s", t, s_))  # (B*Hkv, G*t, s)
                    s4 = tiles.modded(s.view(B, H, t, s_), r0, r1, c0, c1)  # (B, H, t, s)
                    d = tiles.dense_tile(r0, r1, c0, c1)
                    if d is not None and d.dtype != torch.bool:
                        s4 = s4.add_(d.to(acc))
                    hide = tiles.hidden(r0, r1, c0, c1, full)
                    if hide is not None:
                        s4 = s4.masked_fill_(hide, float("-inf"))
                    m_new = torch.maximum(m, s4.amax(-1, keepdim=True))
                    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows with nothing yet
                    p = s4.sub_(m_safe).exp_()  # in place: the scores are not needed again
                    alpha = torch.exp(m - m_safe)
                    l_ = l_ * alpha + p.sum(-1, keepdim=True)
                    if tiles.dropout_p > 0:
                        p = p.mul_(tiles.keep(i, j, tiles.buffer("r", t, s_).view(B, H, t, s_)))
                    pv = torch.bmm(p.view(B * Hkv, G * t, s_), tiles.kv(v, c0, c1), out=tiles.buffer("pv", t, Dv))
                    o = o.view(B, H, t, Dv).mul_(alpha).add_(pv.view(B, H, t, Dv))
                    m = m_new
                o = o.view(B, H, t, Dv)
                seen = l_ != 0  # NaN rows stay NaN (the kernel's NaN rule then applies)
                out[:, :, r0:r1] = torch.where(seen, o / torch.where(seen, l_, 1.0), 0.0).to(q.dtype)
                lse[:, :, r0:r1] = torch.where(seen, m + torch.log(torch.where(seen, l_, 1.0)),
                                               float("-inf"))[..., 0]
        ctx.save_for_backward(q, k, v, out, lse, dense)
        ctx.tiles = tiles
        return out

    @staticmethod
    def backward(ctx, d_out):
        """Per tile (FlashAttention-2): z = mod(q k^T * scale), P = exp(z + bias - lse) on the
        allowed pairs, dV += P_drop^T dO, dS = P (dP - rowsum(dO O)) with dP = (dO V^T) * keep,
        dS *= dz/dx (the mod's derivative), dQ += dS K * scale, dK += dS^T Q * scale."""
        q, k, v, out, lse, dense = ctx.saved_tensors
        tiles: _Tiles = ctx.tiles
        if torch.is_grad_enabled():  # create_graph: differentiable recomputation (see `_twice`)
            return (*_twice(ctx, (q, k, v, dense), d_out, tiles.recompute), None)
        B, H, G, Hkv, Dv = tiles.B, tiles.H, tiles.G, tiles.Hkv, tiles.Dv
        acc, mod = tiles.acc, tiles.score_mod
        d_dense = None if dense is None else torch.zeros(dense.shape, dtype=acc, device=q.device)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        delta = (d_out.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # (B, H, T, 1): rowsum(dO * O)
        for i, r0, r1, cols in tiles.tiles():
            if not cols:
                continue
            t = r1 - r0
            qf = tiles.fold_q(q, r0, r1, tiles.q_scale)  # (B*Hkv, G*t, D), as in the forward
            q_raw = tiles.fold_q(q, r0, r1)
            do = tiles.fold_q(d_out, r0, r1)  # (B*Hkv, G*t, Dv)
            dq_i = torch.zeros_like(q_raw)
            lse_i = lse[:, :, r0:r1, None]
            lse_i = torch.where(torch.isneginf(lse_i), float("inf"), lse_i)  # empty rows: p = 0
            delta_i = delta[:, :, r0:r1]
            for j, c0, c1, full in cols:
                s_ = c1 - c0
                kj, vj = tiles.kv(k, c0, c1), tiles.kv(v, c0, c1)
                x = torch.bmm(qf, kj.mT, out=tiles.buffer("s", t, s_)).view(B, H, t, s_)
                if mod is not None and not tiles.inplace:
                    x = x.clone().requires_grad_()  # a mod without a derivative: autograd's, on this tile
                    with torch.enable_grad():
                        z = tiles.modded(x, r0, r1, c0, c1)
                else:
                    z = tiles.modded(x, r0, r1, c0, c1)
                p = tiles.buffer("p", t, s_).view(B, H, t, s_)
                d = tiles.dense_tile(r0, r1, c0, c1)
                if d is not None and d.dtype != torch.bool:
                    torch.add(z.detach(), d.to(acc), out=p).sub_(lse_i)
                else:
                    torch.sub(z.detach(), lse_i, out=p)
                p = p.exp_()
                hide = tiles.hidden(r0, r1, c0, c1, full)
                if hide is not None:
                    p = p.masked_fill_(hide, 0.0)
                dp = torch.bmm(do, vj.mT, out=tiles.buffer("dp", t, s_)).view(B, H, t, s_)
                p_drop = p
                if tiles.dropout_p > 0:
                    keep = tiles.keep(i, j, tiles.buffer("r", t, s_).view(B, H, t, s_))
                    dp = dp.mul_(keep)
                    p_drop = keep.mul_(p)
                dv[:, :, c0:c1].view(B * Hkv, s_, Dv).baddbmm_(p_drop.view(B * Hkv, G * t, s_).mT, do)
                ds = dp.sub_(delta_i).mul_(p)  # (B, H, t, s): d loss / d z, and / d of the float mask
                if d_dense is not None:  # summed over the dims the mask broadcasts along
                    dims = [a for a in range(4) if dense.shape[a] == 1 and ds.shape[a] != 1]
                    g = ds.sum(dims, keepdim=True) if dims else ds
                    _slice_dense(d_dense, r0, r1, c0, c1).add_(g)
                if mod is not None and tiles.inplace:
                    ds = mod.inplace_grad(z, ds)  # dz/dx from z (overwritten)
                elif mod is not None:
                    ds = torch.autograd.grad(z, x, ds)[0]
                ds = ds.reshape(B * Hkv, G * t, s_)
                dq_i.baddbmm_(ds, kj, alpha=tiles.scale)
                dk[:, :, c0:c1].view(B * Hkv, s_, -1).baddbmm_(ds.mT, q_raw, alpha=tiles.scale)
            dq[:, :, r0:r1] = dq_i.view(B, H, t, -1)
        d_dense = None if d_dense is None else d_dense.to(dense.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_dense, None


def explicit(q: Tensor, k: Tensor, v: Tensor, mask, *, causal: bool, scale: float, dropout_p: float,
             score_mod=None, tile: int | None = None) -> Tensor:
    """softmax(score_mod(q k^T * scale) + mask) v over kept tiles, O(N) memory in training."""
    if score_mod is not None:
        refuse_trainable(score_mod, q, k.shape[2], "the 'tiles' backend's recomputing backward")
    pred, dense = _combine(mask, causal)
    seed = int(torch.randint(0, 2 ** 62, (1,)).item()) if dropout_p > 0 else 0
    tiles = _Tiles(q, k, v, pred, dense, score_mod, scale, dropout_p, tile or EXPLICIT_TILE, seed)
    return _ExplicitTiles.apply(q, k, v, dense if _needs_grad(dense) else None, tiles)

