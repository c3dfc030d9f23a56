"""The tile planner of the block-sparse engines: the score matrix `(T, S)` is cut into
tiles of bq queries x bk keys, and a mask predicate (`multihead.masks`) classifies every
tile as empty (skipped), full (run without a mask) or partial (run with the dense mask of
that tile only), analytically for the built-in predicates and by evaluating one strip of
rows at a time for any other; nothing of size `(T, S)` is ever built. It also finds the
"causal squares" (rows that attend exactly causally among themselves: plain causal, each
packed document of `document & causal`), which run as one causal kernel call each, and
builds each block's small mask."""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager

import torch
from torch import Tensor

from multihead.kernels.common import index
from multihead.kernels.machine import machine_plan
from multihead.masks import MaskMod, and_masks
from multihead.masks import causal as causal_mod

__all__ = ["band_rows", "block_mask", "choose_tile", "clear_plans", "combine", "fold_mask", "plan_key",
           "serial_ops", "shared_differences", "slice_dense", "tile_plan", "tile_sizes"]

_FUSED_CANDIDATES = (64, 128, 256, 512, 1024)  # tile edges the fused engine's plan chooses from
_MIN_SEGMENT = 64  # documents shorter than this on average run as tiles, not a call each
_BAND_CANDIDATE = 32  # the extra tile edge of an engine that runs bands (see `choose_tile`)
# The tile cost model's two constants (`MachinePlan.flops_per_thread` and `.call_seconds`,
# visible and replaceable there) were fitted together at D = 64, so a pair's 4 D flops are
# counted at that D whatever the call's D: the real D made the plan pick slower tiles at small
# D (docs/kernel.md). torch's CPU kernel's time per pair is about proportional to D, so the
# per-call term is what is off at small D; refitting both per D would let the real D in.
_COST_HEAD_DIM = 64
# Plans kept (`plan_key`): a model's layers and steps repeat a handful of (mask, shape)s; a plan
# at N = 16384 holds two (512, 512) bool grids. 0: none kept, every call plans (benchmarks/masks.py)
_PLANS_KEPT = 32
# A relative predicate whose allowed differences change more often than this is planned each call
_KEY_EDGES = 64
_PLANS: OrderedDict = OrderedDict()
_PLANS_LOCK = threading.Lock()
_COMPUTE = object()  # choose_tile's `key` default: compute `plan_key` itself


def tile_sizes(T: int, S: int, tile: int) -> tuple[int, int]:
    return max(1, min(T, tile)), max(1, min(S, tile))


def combine(mask, causal: bool) -> tuple[MaskMod | None, Tensor | None]:
    """Split a kernel mask into (predicate, dense tensor) and fold `causal` into the predicate."""
    pred = mask if isinstance(mask, MaskMod) else None
    dense = mask if isinstance(mask, Tensor) else None
    if causal:
        pred = causal_mod() if pred is None else and_masks(pred, causal_mod())
    return pred, dense


def tile_plan(pred: MaskMod | None, B: int, H: int, T: int, S: int, bq: int, bk: int, device) -> tuple[Tensor, Tensor]:
    """Per tile, over all batches and heads: (kept, full) bool `(nq, nk)` on the CPU.

    A tile is kept when some (b, h) may attend a pair in it, and full when every (b, h)
    may attend every pair in it.
    """
    nq, nk = -(-T // bq), -(-S // bk)
    if pred is None:
        ones = torch.ones(nq, nk, dtype=torch.bool)
        return ones, ones
    if pred.relative:
        return _relative_plan(T, S, bq, bk, _difference_sums(pred, B, H, T, S, device))
    any_, all_ = pred.tiles(B, H, T, S, bq, bk, device)
    any_ = any_.expand(-1, -1, nq, nk).flatten(0, 1).any(0)
    all_ = all_.expand(-1, -1, nq, nk).flatten(0, 1).all(0)
    return any_.cpu(), all_.cpu()


def _relative_plan(T: int, S: int, bq: int, bk: int, sums: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """`tile_plan` of a function of d = q - kv alone (causal, sliding windows): the predicate at
    each of the T + S - 1 differences once, then per tile a count of the allowed d over the
    tile's range of d (every d between its extremes is a pair of the tile), read from prefix
    sums. A handful of ops over the (nq, nk) tiles instead of each part's tile classes:
    fewer, smaller ops in the plan, made again for every (mask, shape) not kept (`plan_key`)."""
    nq, nk = -(-T // bq), -(-S // bk)
    off = S - T
    d_min = off - (S - 1)
    n_d = T + S - 1  # sums: `_difference_sums`, shared by the candidate tiles of one plan
    r_lo = torch.arange(nq) * bq
    r_hi = torch.clamp(r_lo + bq, max=T) - 1
    c_lo = torch.arange(nk) * bk
    c_hi = torch.clamp(c_lo + bk, max=S) - 1
    def classes(lo, hi):  # tiles with d from lo to hi - 1 (indices into d): (kept, full)
        return sums[0][hi] - sums[0][lo] > 0, sums[1][hi] - sums[1][lo] == hi - lo

    if bq != bk:
        return classes((r_lo[:, None] - c_hi[None, :]) + (off - d_min),  # (nq, nk): each tile's least d
                       (r_hi[:, None] - c_lo[None, :]) + (off - d_min + 1))  # one past its greatest
    # square tiles: a whole tile's class depends on m = i - j alone; one vector over m laid out as the
    # (nq, nk) grid (grid[i, j] = vec[i - j + nk - 1]: a sliding view, its columns reversed), then the
    # short last row and column, whose ranges of d are narrower, on their own
    m = torch.arange(-(nk - 1), nq)
    # an m seen only by the short row or column reaches past the d's (clamped): fixed below
    kept, full = classes((m * bq + (off - d_min) - (bq - 1)).clamp(0, n_d), (m * bq + (off - d_min + bq)).clamp(0, n_d))
    kept, full = (x.unfold(0, nk, 1).flip(1) for x in (kept, full))  # (nq, nk), each its own tensor
    if T % bq:
        kept[-1], full[-1] = classes(r_lo[-1] - c_hi + (off - d_min), r_hi[-1] - c_lo + (off - d_min + 1))
    if S % bk:
        kept[:, -1], full[:, -1] = classes(r_lo - c_hi[-1] + (off - d_min), r_hi - c_lo[-1] + (off - d_min + 1))
    return kept, full


def _differences(pred: MaskMod, B: int, H: int, T: int, S: int, device) -> Tensor:
    """Bool `(B*H or 1, T + S - 1)` on the CPU: `pred` (relative) at d = q - kv from -(T - 1) ..
    S - T + T - 1, each d evaluated once."""
    off = S - T
    d_min, d_max = off - (S - 1), T - 1 + off
    d = torch.arange(d_min, d_max + 1, device=device)
    # rows at + d - off with keys at: a bottom-right leaf reads the row + off (its position), a
    # top-left one the row itself, so each sees the pair whose bottom-right difference is d
    at = torch.full((1, 1, 1, 1), max(0, off - d_min), device=device)
    allowed = pred.evaluate(index(B, 0, device), index(H, 1, device), at + d.view(1, 1, -1, 1) - off, at, off)
    return allowed.reshape(-1, d.numel()).cpu()


def shared_differences(pred: MaskMod, B: int, H: int, T: int, S: int, device) -> Tensor | None:
    """`differences` where they are every batch row's and head's: bool `(T + S - 1,)`, one byte
    each, contiguous; None where the predicate differs by batch row or head."""
    allowed = _differences(pred, B, H, T, S, device)
    if allowed.shape[0] > 1 and not bool((allowed == allowed[:1]).all()):
        return None
    return allowed[0].contiguous()


def _difference_sums(pred: MaskMod, B: int, H: int, T: int, S: int, device) -> tuple[Tensor, Tensor]:
    """Prefix counts `(T + S,)` over d = q - kv from -(T - 1) .. S - T + T - 1 of the d that some
    (b, h) may attend and that every (b, h) may attend: the predicate evaluated once per d."""
    allowed = _differences(pred, B, H, T, S, device)  # (B*H or 1, T + S - 1)
    sums = []
    for a in (allowed.any(0), allowed.all(0)):  # kept: some (b, h) some pair; full: every (b, h) every pair
        c = torch.zeros(a.numel() + 1, dtype=torch.int64)
        torch.cumsum(a, 0, out=c[1:])
        sums.append(c)
    return sums[0], sums[1]


def plan_key(pred, B: int, H: int, T: int, S: int, G: int, tile, device, squares: bool = True,
             bands: bool = False) -> tuple | None:
    """A hashable key that fixes `choose_tile`'s result for these arguments, or None (the plan
    is made afresh each call).

    Only for an analytic relative predicate (causal, sliding windows: a function of q - kv
    alone) that is the same for every batch and head: its values at the T + S - 1
    differences d are then every pair's, and the key holds them exactly (the first value and
    the d where they change), so two predicates built apart (a model builds its mask every
    forward) share a plan when they allow the same pairs; the plan, its blocks and masks
    depend on those values alone. O(T + S) work, against the plan's dozens of ops over tile
    grids per candidate, which run on one thread (`serial_ops`) while the others wait.
    """
    if not _PLANS_KEPT or pred is None or not pred.relative or not pred.analytic or T < 1 or S < 1 \
            or torch.compiler.is_compiling():
        return None
    # a few ops over T + S - 1 values, no `serial_ops`: changing torch's thread count and back
    # costs more than they do
    a = shared_differences(pred, B, H, T, S, device)
    if a is None:
        return None  # differs by batch or head: its masks would too
    edges = torch.nonzero(a[1:] != a[:-1]).flatten()
    if edges.numel() > _KEY_EDGES:
        return None
    values = (bool(a[0]), tuple(edges.tolist()))
    return (values, B, H, T, S, G, tile, torch.device(device).type, squares, bands, torch.get_num_threads(),
            _FUSED_CANDIDATES, _BAND_CANDIDATE, machine_plan())


def _kernel_efficiency(rows: int) -> float:
    """Relative speed of torch's CPU flash kernel by query rows per call: it splits queries
    in blocks of 32 below 192 rows, 64 below 768, 256 above (measured ~0.55 : 0.8 : 1)."""
    return 0.55 if rows < 192 else 0.8 if rows < 768 else 1.0


def band_rows(kept: Tensor, full: Tensor, T: int, bq: int) -> Tensor:
    """(nq,) bool: query block i keeps and fills the tiles of block i - 1 shifted by one tile
    (square tiles), so an engine that runs alike blocks of a relative mask together (a band:
    sliding windows) runs it in the call of the block before. The last block when it is
    short, and a block whose tiles would shift off the right edge, are not."""
    nq = kept.shape[0]
    out = torch.zeros(nq, dtype=torch.bool)
    if nq < 2:
        return out
    alike = ~kept[1:, 0] & ~kept[:-1, -1] & (kept[1:, 1:] == kept[:-1, :-1]).all(1) \
        & (full[1:, 1:] == full[:-1, :-1]).all(1) & kept[1:].any(1)
    out[1:] = alike
    if T % bq:
        out[-1] = False
    return out


def choose_tile(pred, B, H, T, S, G, tile, device, squares: bool = True, bands: bool = False, key=_COMPUTE):
    """(bq, bk, kept, full, squares): a fixed tile, or the candidate of least estimated kernel time.

    Estimated time = pairs computed (rows x kept keys, tile-granular) / kernel efficiency
    at that many (GQA-folded) rows, plus a cost per call; a causal square (see
    `_causal_squares`) is one call at full efficiency over half its pairs. Only analytic
    predicates are planned more than once: planning a generic predicate evaluates it
    over all pairs. `squares=False`: the engine cannot run squares (a score mod, a dense
    mask, or torch's math path behind it), so none are looked for or costed. `bands=True`:
    the engine runs alike query blocks of a relative mask as one call (`band_rows`; the
    GQA heads unfolded, G calls), so a band costs the calls of one block and short blocks
    (32 rows, which waste fewest pairs at a window's edges) are worth a candidate.

    Plans with a `plan_key` (`key`: one the caller computed, else computed here) are kept,
    the last `_PLANS_KEPT`: the same result object again, whose tensors no caller may modify.
    """
    if key is _COMPUTE:
        key = plan_key(pred, B, H, T, S, G, tile, device, squares, bands)
    if key is not None:
        with _PLANS_LOCK:
            hit = _PLANS.get(key)
            if hit is not None:
                _PLANS.move_to_end(key)
                return hit
    result = _choose_tile(pred, B, H, T, S, G, tile, device, squares, bands)
    if key is not None:
        with _PLANS_LOCK:
            _PLANS[key] = result
            while len(_PLANS) > _PLANS_KEPT:
                _PLANS.popitem(last=False)
    return result


def clear_plans() -> int:
    """Forget the kept plans (`choose_tile`); returns how many there were."""
    with _PLANS_LOCK:
        n = len(_PLANS)
        _PLANS.clear()
    return n


def _choose_tile(pred, B, H, T, S, G, tile, device, squares, bands):
    find = _causal_squares if squares else lambda *args: {}
    segments = _segment_squares(pred, B, H, T, S, device) if pred is not None and squares else {}
    if segments or tile is not None or pred is None or not pred.analytic:
        bq, bk = tile_sizes(T, S, tile or (256 if segments else 128))
        kept, full = tile_plan(pred, B, H, T, S, bq, bk, device)
        return bq, bk, kept, full, segments or find(pred, B, H, T, S, bq, bk, kept, full, device)
    threads = max(1, torch.get_num_threads())
    with serial_ops():
        return _least_cost(pred, B, H, T, S, G, device, find, threads, bands and pred.relative)


@contextmanager
def serial_ops():
    """Torch's ops inside run on the calling thread alone (its intra-op count set to 1, then back).

    A plan's ops are over tiles, not pairs: small, and dozens per candidate. Each op over more
    than torch's grain (32,768 elements: a 512 x 512 tile grid) is a parallel region whose end
    waits for every thread; on a busy machine a thread that is not scheduled makes each wait
    last a time slice (measured: 0.4 s of such waits in one call at 2 threads, load 2, against
    0.13 s of kernel). With OpenMP (torch's CPU backend) the count is the calling thread's own.
    """
    n = torch.get_num_threads()
    if n == 1 or torch.compiler.is_compiling():  # nothing to do; no thread-count calls in a traced graph
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _least_cost(pred, B, H, T, S, G, device, find, threads, bands):
    """`choose_tile`'s search over the candidate tiles of an analytic predicate."""
    best, plan = None, machine_plan()
    candidates = (_BAND_CANDIDATE, *_FUSED_CANDIDATES) if bands else _FUSED_CANDIDATES
    sums = _difference_sums(pred, B, H, T, S, device) if pred.relative else None
    for c in candidates if T > _FUSED_CANDIDATES[0] else (256,):  # decoding: one plan, one block
        bq, bk = tile_sizes(T, S, c)
        kept, full = tile_plan(pred, B, H, T, S, bq, bk, device) if sums is None else \
            _relative_plan(T, S, bq, bk, sums)
        found = find(pred, B, H, T, S, bq, bk, kept, full, device)
        in_square = torch.zeros(kept.shape[0], dtype=torch.bool)
        pairs, calls = 0.0, 0
        for r0, r1 in found.items():
            in_square[r0 // bq:-(-r1 // bq)] = True
            pairs, calls = pairs + (r1 - r0) * (r1 - r0 + 1) / 2, calls + 1
        banded = band_rows(kept, full, T, bq) & ~in_square if bands and bq == bk else in_square & False
        solo = ~in_square & ~banded
        # seconds at the plan's flop rate per thread and head, plus its seconds per call (mask, merge, dispatch)
        pairs += float(kept[solo].sum()) * bq * bk / _kernel_efficiency(G * bq)
        pairs += float(kept[banded].sum()) * bq * bk / _kernel_efficiency(bq)
        calls += int(solo.sum()) + (G - 1) * int((banded[1:] & ~banded[:-1]).sum())  # a band's head: G calls
        cost = pairs * H * 4 * _COST_HEAD_DIM / plan.flops_per_thread / threads + calls * plan.call_seconds
        if best is None or cost < best[0] * 0.97:
            best = (cost, bq, bk, kept, full, found)
        if bq == T and bk == S or bool(in_square.all()):  # all causal squares: the tile no longer matters
            break
    return best[1:]


def _and_leaves(pred: MaskMod) -> list[MaskMod]:
    if pred.op == "and":
        return [leaf for part in pred.parts for leaf in _and_leaves(part)]
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
    runs = [leaf for leaf in leaves if leaf.segments is not None]
    if len(runs) != 1 or any(not (leaf.relative and not leaf.top_left) for leaf in leaves if leaf is not runs[0]):
        return {}
    segments = runs[0].segments(T, S)
    if not segments or len(segments) > max(1, T // _MIN_SEGMENT):
        return {}  # no runs, or many short documents: tiles do better than a call per document
    L = max(e - a for a, e in segments)  # over the longest document
    by_d = [_over_differences(leaf, L, B, H, device)[0] for leaf in leaves if leaf is not runs[0]]
    lower = torch.arange(-(L - 1), L, device=device) >= 0
    if not any(bool((m == lower).all()) for m in by_d) or not all(bool((m | ~lower).all()) for m in by_d):
        return {}
    return dict(segments)


def slice_dense(dense: Tensor, r0: int, r1: int, c0: int, c1: int) -> Tensor:
    rows = slice(r0, r1) if dense.shape[2] > 1 else slice(None)
    cols = slice(c0, c1) if dense.shape[3] > 1 else slice(None)
    return dense[:, :, rows, cols]


def block_mask(pred, dense, score_mod, B, H, T, S, r0, r1, c0, c1, need_pred, dtype, device):
    """The mask of one block (rows r0..r1, keys c0..c1): None, bool, or float (additive)."""
    b, h = index(B, 0, device), index(H, 1, device)
    rows, kv = index(r1 - r0, 2, device, r0), index(c1 - c0, 3, device, c0)
    allowed = bias = None
    if pred is not None and need_pred:
        allowed = pred.evaluate(b, h, rows, kv, S - T)
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    if dense is not None:
        d = slice_dense(dense, r0, r1, c0, c1)
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
        # a float mask, not a bool one: torch's CPU kernel runs it faster (docs/kernel.md)
        bias = torch.zeros((), dtype=dtype, device=device).expand(allowed.shape)
    bias = bias.to(dtype)
    return bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))


def fold_mask(m: Tensor | None, B: int, Hkv: int, G: int, t: int) -> Tensor | None:
    """A block mask `(Bm, Hm, t|1, s)` laid out for queries folded as `(B, Hkv, G*t, D)`."""
    if m is None or G == 1:
        return m
    Bm, Hm, tm, s = m.shape
    if Hm == 1 and tm == 1:
        return m  # broadcasts over the folded rows
    if Hm == 1:
        return m.expand(Bm, G, t, s).reshape(Bm, 1, G * t, s)  # (Bm, 1, G*t, s)
    return m.expand(Bm, Hm, t, s).reshape(Bm, Hkv, G * t, s)  # (Bm, Hkv, G*t, s)
