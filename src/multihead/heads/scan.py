"""`patch_scan` (activation patching of every head, exactly, in few batched forwards) and
`attribution_scan` (its first-order approximation: Nanda 2023, "Attribution patching").

A variant (one head patched) differs from the corrupted run only from its layer on, so the
corrupted run is made once, keeping what each block is handed, and a scan forward carries a
few variants, each from its own block up (`_batch`); causal decoders skip the prefix clean
and corrupted share (`_prefix`), the patched layer's attention is not run for what="z" and
"pattern" (`_shortcut`), and the last block runs at the read position only (`_top`); each
is checked before it is taken and its reason given in `info=`. The state of one call is a
`_scan_state.ScanState`, the units of work are run by `_runner`. The method: docs/heads.md,
"How `patch_scan` stays exact and fast".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from multihead.heads._align import aligned, unchecked
from multihead.heads._budget import (
    MEMORY_PER_RUN,
    bytes_per_row,
    check_memory,
    head_cost,
    keep_positions,
    model_width,
    takes_logits_to_keep,
    variants_per_forward,
)
from multihead.heads._inputs import (
    call,
    check_inputs,
    check_metric,
    check_variants_per_run,
    scalar,
    takes_use_cache,
    with_keywords,
)
from multihead.heads._interventions import check_positions
from multihead.heads._prefix import causal_stack, shared_prefix
from multihead.heads._ranks import Ranks, check_group, fingerprint, pack, unpack
from multihead.heads._record import Recording, check_what, record
from multihead.heads._runner import run_units, table, to_device
from multihead.heads._scan_state import ScanState
from multihead.heads._shortcut import too_big
from multihead.heads.engine import Engine, Handler, Layer, check_grad_mode, check_model, is_hf, logits_of
from multihead.heads.metrics import AtPositions
from multihead.heads.progress import check_progress

SCANS = ("z", "k", "v", "pattern", "latent")
_SKIP_PREFIX = True  # tests turn it off to compare the two paths
_SHORTCUT = True  # the same for the shortcut (`_shortcut`)
_LAST_BLOCK = True  # ... and for the last block at the read position (`multihead.heads._top`)


def _check_scan(model, clean, corrupted, metric, what: str, positions, variants_per_run) -> tuple:
    """Every check of patch_scan's arguments before the first forward: (positions, B, variants per run)."""
    check_model(model)
    check_what(what, SCANS)
    check_metric(metric)
    pos = check_positions(positions)
    B = check_inputs(model, clean, corrupted, metric)
    return pos, B, check_variants_per_run(variants_per_run)


def _check_positions_fit(pos: list[int] | None, positions, rec: Recording, what: str) -> None:
    """Positions must exist in every layer (an encoder-decoder's decoder is shorter than its encoder)."""
    if pos is None:
        return
    for lay in rec.layers:
        t = rec[what, lay.index]
        n = t.shape[2] if what == "pattern" else t.shape[1]  # query positions of the pattern; else dim 1
        bad = [q for q in pos if not -n <= q < n]
        if bad:
            shortest = min(rec[what, la.index].shape[2 if what == "pattern" else 1] for la in rec.layers)
            raise ValueError(f"positions {bad} out of range at layer {lay.index} ({type(lay.module).__name__}), whose "
                             f"{what} has {n} positions; valid: positions in [-{shortest}, {shortest}) (every layer "
                             f"has them); received {positions!r}")


def _n_heads(lay: Layer, what: str) -> int:
    """Columns of a layer in the table: key/value heads for k/v, one latent, else query heads."""
    return lay.Hkv if what in ("k", "v") else int(lay.kind == "latent") if what == "latent" else lay.H


def _variant_order(layers: list[Layer], what: str) -> list[tuple[int, int]]:
    # head by head, layer by layer within: a run carries head h of consecutive layers, so
    # each block adds B rows and no block runs for nothing (bigger batches of one layer's
    # heads cost more per row: docs/heads.md)
    return sorted(((lay.index, h) for lay in layers for h in range(_n_heads(lay, what))), key=lambda v: (v[1], v[0]))


def _even(n: int, per_run: int) -> int:
    """At most `per_run` variants a forward, in forwards of about one size and a multiple of
    4 of them (when there are more than one): so that 2 or 4 ranks (`group=`) get equal
    shares, and one process makes the same forwards (the tables stay bitwise one)."""
    forwards = -(-n // max(1, per_run))
    if forwards > 1:
        forwards = -(-forwards // 4) * 4
    return max(1, -(-n // forwards))


def _chunks(variants: list[tuple[int, int]], per_run: int, last_stack: set[int]) -> list[list[tuple[int, int]]]:
    """Chunks of at most per_run variants, never mixing layers that join at the model's input."""
    chunks: list[list[tuple[int, int]]] = []
    for v in variants:
        if chunks and len(chunks[-1]) < per_run and (chunks[-1][0][0] in last_stack) == (v[0] in last_stack):
            chunks[-1].append(v)
        else:
            chunks.append([v])
    return chunks


def _static_refusal(model, clean, corrupted, what: str) -> tuple[int, int, str]:
    """(p, T, why not) of the prefix skip before any forward; "" when it may be tried."""
    p, T = shared_prefix(clean, corrupted)
    if not _SKIP_PREFIX:
        return p, T, "the prefix skip is turned off"
    if T == 0:
        return p, T, "the inputs' positions cannot be read off them (no (B, T) tensors of one length)"
    if p == 0:
        return p, T, "clean and corrupted differ at position 0: no shared prefix"
    if p == T:
        return p, T, "clean and corrupted are equal"
    if not is_hf(model):
        return p, T, "not a transformers model (the skip reads transformers' block inputs)"
    if what == "latent":
        return p, T, "what='latent' (MLA modules run every position)"
    return p, T, ""


@dataclass(frozen=True)
class _Prepared:
    """patch_scan's checked arguments and the inputs it runs (`aligned`'s), before any forward
    of its own: what each of its setup steps reads."""

    pos: list[int] | None
    B: int
    per_run: int | None  # variants_per_run as given
    budget: int | None  # max_memory as given (None: automatic)
    memory: int  # the bytes a forward may take (the budget, or MEMORY_PER_RUN)
    clean: object
    corrupted: object
    metric: Callable
    align_why: str
    p0: int  # the positions clean and corrupted share at the start
    T: int
    why: str  # why the prefix skip is declined before any forward ("" when it may be tried)
    lean: dict  # keywords of the recording runs ({"logits_to_keep": 1} or {})
    whats: tuple  # what the clean recording keeps
    align_check: Callable | None = None  # `_align.unchecked`'s check, not yet run (None: none, or run)


@dataclass(frozen=True)
class _Call:
    """patch_scan's arguments as given."""

    model: nn.Module
    clean: object
    corrupted: object
    metric: Callable
    what: str
    positions: object
    variants_per_run: object
    max_memory: object
    progress: object
    info: object


def _prepare(c: _Call, defer: bool = False) -> _Prepared:
    """Every check of the arguments and the inputs the scan runs (rolled by `aligned`); with
    `defer`, the rolled rows' check is not run but kept (`_Prepared.align_check`)."""
    model, what = c.model, c.what
    pos, B, per_run = _check_scan(model, c.clean, c.corrupted, c.metric, what, c.positions, c.variants_per_run)
    budget = check_memory(c.max_memory)
    check_progress(c.progress)
    if c.info is not None and not isinstance(c.info, dict):
        raise TypeError(f"info must be None or a dict to fill; received {type(c.info).__name__}")
    if defer:
        clean_, corrupted_, metric_, align_why, align_check = unchecked(model, c.clean, c.corrupted, c.metric, pos,
                                                                        _LAST_BLOCK)
    else:
        (clean_, corrupted_, metric_, align_why), align_check = aligned(model, c.clean, c.corrupted, c.metric,
                                                                       pos, _LAST_BLOCK), None
    p0, T, why = _static_refusal(model, clean_, corrupted_, what)
    if pos is not None and T and any(not -T <= q < T for q in pos):
        raise ValueError(f"positions must lie in [-{T}, {T}) for inputs of {T} positions; received {c.positions!r}")
    memory = MEMORY_PER_RUN if budget is None else budget
    return _Prepared(pos, B, per_run, budget, memory, clean_, corrupted_, metric_, align_why, p0, T, why,
                     _lean(model, clean_, memory), (what, "z") if not why and what != "z" else (what,),
                     align_check)


def _clean_run(c: _Call, a: _Prepared) -> Recording:
    rec = record(c.model, with_keywords(a.clean, a.lean), what=a.whats)
    rec.logits = None  # the scan's own recording: its logits (B, T, vocab) are not read
    return rec


def _check_rec(c: _Call, a: _Prepared, rec: Recording) -> None:
    _check_positions_fit(a.pos, c.positions, rec, c.what)
    if c.what == "latent" and not any(lay.kind == "latent" for lay in rec.layers):
        raise ValueError("what='latent' patches MLA latents (multihead LatentAttention, or a DeepSeek model after "
                         "multihead.interop.hf.use_latent_attention); this model has none")


def _corrupted_run(c: _Call, a: _Prepared, rec: Recording) -> tuple[ScanState, str]:
    model = c.model
    scan = ScanState(model, a.corrupted, rec, c.what, a.B, shortcut=_SHORTCUT, trim=_LAST_BLOCK)
    scan.lean, scan.metric, scan.aligned = a.lean, a.metric, (a.clean is not c.clean, a.align_why)
    scan.T, scan.keep = a.T, keep_positions(model, a.metric, a.T, a.B)
    scan.shortcut.early = too_big(scan.shortcut, rec, a.memory)
    why = a.why
    if not why:
        scan.stack, why = causal_stack(model, scan.layers, scan.blocks, scan.parents)
    scan.run_corrupted(a.p0 if scan.stack is not None else 0)
    return scan, why


def _decide(c: _Call, a: _Prepared, rec: Recording, scan: ScanState, why: str, deferred: list | None):
    """The rest of the setup; `deferred` (a list): the self-check forwards are not run but
    put there (name, the check), to be run as units of the scan (`_deferred`)."""
    if scan.logits is not None:
        if not a.lean:  # a metric that cannot work fails before the scan (else at its first forward)
            scalar(a.metric(scan.logits), "on the corrupted run")
        scan.vocab = scan.logits.shape[-1] if scan.logits.dim() >= 3 else 0
        scan.itemsize = scan.logits.element_size()
    scan.logits = None  # (B, T, vocab): 0.8 GB at 4,096 positions of SmolLM2; the checks read `final`
    with _deferred(scan, "self_check", deferred):
        if scan.stack is not None:
            why = scan.decide_prefix(a.p0, a.T)
    # the shortcut's check, and the last block's trim check where the scan makes one
    with _deferred(scan, "shortcut_check", deferred), _deferred(scan, "last_block_check", deferred):
        scan.shortcut_reason = scan.decide_shortcut(a.memory)
    B, T, p0 = a.B, a.T, a.p0
    width = model_width(c.model, scan.layers[0].H * scan.layers[0].Dv)
    n_pos = (T - p0 if scan.cut else T) or _positions_of(rec)
    per_row = bytes_per_row(scan.vocab, scan.itemsize, scan.inner or [c.model], width, n_pos,
                            len(scan.keep["logits_to_keep"]) if scan.keep else None)
    auto, scan.budget = variants_per_forward(per_row, B, a.budget, n_pos)
    scan.per_row = per_row
    order = _variant_order(scan.layers, c.what)
    per_run = _even(len(order), auto) if a.per_run is None else a.per_run
    chunks = _chunks(order, per_run, scan.last_stack)
    return scan, a.pos, p0, why, chunks


def _setup(c: _Call, deferred: list | None = None):
    a = _prepare(c)
    rec = _clean_run(c, a)
    _check_rec(c, a, rec)
    scan, why = _corrupted_run(c, a, rec)
    return _decide(c, a, rec, scan, why, deferred)


def _shared_setup(c: _Call, ranks: Ranks, deferred: list):
    """_setup() with the clean run on rank 0 and the corrupted run on rank 1 at once
    (`_shared_runs`), or None when that could not be done (every rank then runs _setup())."""
    made = _shared_runs(ranks, c.model, lambda: _prepare(c, defer=True), partial(_clean_run, c),
                        partial(_corrupted_run, c))
    if made is None:
        return None
    a, rec, scan, why = made
    _check_rec(c, a, rec)
    if a.align_check is not None:  # the rolled rows' check (two forwards), on one rank
        deferred.append(("align_check", a.align_check))
    return _decide(c, a, rec, scan, why, deferred)


def _agreed(c: _Call, done) -> tuple:
    """What every rank must share for the tables to be one table."""
    scan, pos, p0, why, chunks = done
    return (fingerprint(c.model, c.clean, c.corrupted), c.what, pos, p0, scan.cut, chunks)


def _note(scan: ScanState, chunks: list) -> str:
    per_run = max(len(ch) for ch in chunks)
    return (f"patch_scan: {per_run} variant(s) of {scan.B} row(s) per forward, about "
            f"{per_run * scan.B * scan.per_row / 2**20:,.0f} MiB each (budget {scan.budget / 2**20:,.0f} MiB)")


def patch_scan(model, clean, corrupted, metric: Callable[[Tensor], Tensor], what: str = "z", positions=None, *,
               variants_per_run: int | None = None, max_memory: int | None = None, progress=None,
               info: dict | None = None, group=None) -> Tensor:
    """The metric of the corrupted run with each head patched from the clean run, one at a time.

    Args:
        model: a transformers model on attn_implementation="multihead", or a module built
            from multihead's Attention/LatentAttention.
        clean, corrupted: inputs of the same shape (a tensor of input_ids or a mapping of
            keyword arguments; no labels, use_cache or past_key_values).
        metric: logits of one run (`.logits`, or the output when it is a tensor; `(B, ...)`)
            -> a scalar tensor (or a number). An `AtPositions` metric (one position per row,
            e.g. `tasks.ioi(...).metric`) on a transformers model has the model's head
            computed at those positions only; the table is the same.
        what: "z" (heads' outputs), "k", "v" (per KV head; MLA modules per head through the
            up-projection), "pattern" (z = clean pattern @ this run's values) or, for MLA
            modules, "latent" (the shared latent, one column).
        positions: None for all, or the positions to patch (each must exist in every layer).
        variants_per_run: how many patched copies of the batch one forward carries
            (default: as many as `max_memory` holds, at most 16 // B, at least 1).
        max_memory: the bytes one forward may take (its logits and activations, estimated
            by `bytes_per_row`): None for 1 GiB. What the call holds throughout is apart.
        progress: None/False (silent), True (heads done, rate and ETA on stderr when it is a
            terminal) or a callable(done, total, eta_s) (`multihead.heads.progress`).
        info: a dict to fill with how the scan ran (the table is the same either way):
            `prefix`, `skipped`, `reason` (the prefix skip), and for an `AtPositions` metric
            `aligned`, `aligned_reason`, `last_block`, `last_block_reason` (docs/heads.md).
        group: None (one process), or a torch.distributed process group whose every rank
            makes this call with the same arguments: each rank runs whole chunks of
            variants and every rank returns the whole table, bitwise the one process's; an
            error on any rank raises on every rank (docs/heads.md, "Across processes").

    Returns `(layers, heads)` float32 (NaN where a layer has fewer heads than the widest).
    Equal to TransformerLens' `get_act_patch_attn_head_out_all_pos` (and its k/v/pattern
    siblings) on the same weights.
    """
    check_group(group)
    ranks = Ranks(group, "patch_scan")
    c = _Call(model, clean, corrupted, metric, what, positions, variants_per_run, max_memory, progress, info)
    agreed = partial(_agreed, c)
    deferred: list | None = [] if ranks.size > 1 else None
    done = None
    if deferred is not None and what != "pattern":
        done = ranks.run(lambda: _shared_setup(c, ranks, deferred), lambda d: () if d is None else agreed(d))
    if done is None:
        done = ranks.run(lambda: _setup(c, deferred), agreed)
    scan, pos, p0, why, chunks = done
    head = head_cost(model, scan.inner)
    checks = [(check, _check_cost(scan, name, head)) for name, check in deferred or ()]
    results, failed = run_units(ranks, chunks, [scan.cost(ch, head) for ch in chunks],
                                lambda ch: scan.run_chunk(ch, pos, scan.metric), progress, "patch_scan",
                                note=lambda: _note(scan, chunks), checks=checks)
    if failed:  # a check the other ranks took as passed failed: the whole setup again, its checks in line
        scan, pos, p0, why, chunks = ranks.run(lambda: _setup(c), agreed)
        results, _ = run_units(ranks, chunks, [scan.cost(ch, head) for ch in chunks],
                               lambda ch: scan.run_chunk(ch, pos, scan.metric), None, "patch_scan")
    if info is not None:
        info.update(prefix=p0, skipped=scan.cut is not None, reason=why)
        if isinstance(metric, AtPositions):
            info.update(aligned=scan.aligned[0], aligned_reason=scan.aligned[1], last_block=scan.top is not None,
                        last_block_reason=scan.top_reason)
    return table([_n_heads(lay, what) for lay in scan.layers], (cell for values in results for cell in values))


@contextmanager
def _deferred(scan: ScanState, name: str, into: list | None):
    """Within: `scan.<name>()` (a self-check forward) passes without running; the real check is
    appended to `into` as (name, check) to run later, on one rank of the group, while the others
    run variants. A check that then fails makes every rank redo the setup with it in line, so
    the table is one process's either way. `into` None (one process): nothing deferred."""
    real = getattr(scan, name, None) if into is not None else None
    if real is None:
        yield
        return
    ran: list = []
    setattr(scan, name, lambda: ran.append(True) or "")
    try:
        yield
    finally:
        delattr(scan, name)  # the class's method again
    if ran:
        into.append((name, real))


def _check_cost(scan: ScanState, name: str, head: float) -> float:
    """A deferred check's forward in `ScanState.cost`'s units: the self-check runs every block (one
    variant at the first layer's cost), the shortcut's check two variants at its last layers,
    the last block's check that block alone."""
    if name == "shortcut_check" and scan.shortcut.layers:
        return scan.cost([(i, 0) for i in sorted(scan.shortcut.layers)[-2:]], head)
    if name == "last_block_check":  # one variant's last block and head
        return scan.cost([(scan.layers[-1].index, 0)], head)
    if name == "align_check":  # two forwards of the corrupted rows, every block
        return 2 * scan.cost([(scan.layers[0].index, 0)], head)
    return scan.cost([(scan.layers[0].index, 0)], head)


def _shared_runs(ranks: Ranks, model, prepare, clean_run, corrupted_run):
    """(a, rec, scan, why) of `patch_scan`'s setup with its two recording forwards on two ranks
    at once: rank 0 records the clean run, rank 1 makes the corrupted run against a stand-in
    of that recording (`_stand_in`: the clean run's layers and tensor shapes, from a one-row,
    one-position forward), then each sends what it made (`_ranks.pack`) and every rank rebuilds
    the same state from those bytes, with the stand-in's tensors replaced by the clean ones.
    None (every rank then runs the setup itself) when a rank failed, the stand-in was not
    the clean run's shape, or what the corrupted run made does not travel: an error is then
    raised by that setup, in its own words, on every rank."""
    a = mine = None
    try:
        a = prepare()
        if ranks.rank == 0:
            mine = pack(clean_run(a), model)
        elif ranks.rank == 1 and a.T:
            stand = _stand_in(model, a)
            scan, why = corrupted_run(a, stand)
            refs = _refs(a, stand)
            shapes = [(k, tuple(t.shape), t.dtype) for k, t in stand.data.items()]
            mine = pack((vars(scan), why, shapes, [_layer_key(lay) for lay in stand.layers]), model, refs)
    except Exception:  # the setup on every rank raises it (or passes: then this was only the stand-in)
        mine = None
    parts = ranks.share(mine)
    made, ok = None, a is not None and parts[0] is not None and parts[1] is not None
    if ok:
        try:
            rec = unpack(parts[0], model)
            state, why, shapes, layers = unpack(parts[1], model, _refs(a, rec))
            ok = layers == [_layer_key(lay) for lay in rec.layers] and all(
                k in rec and tuple(rec[k].shape) == s and rec[k].dtype == d for k, s, d in shapes)
            if ok:
                scan = ScanState.__new__(ScanState)
                scan.__dict__.update(state)
                made = (a, rec, scan, why)
        except Exception:  # a key or module name the receiver lacks: it runs the setup itself
            ok = False
    return made if all(ranks.settle(None, ok)) else None


def _refs(a: _Prepared, rec: Recording) -> dict:
    """What every rank holds in its own right, sent by name: the call's inputs and metric, and
    the clean recording (its stand-in on the sending rank, the clean one on arrival)."""
    return {"clean": a.clean, "corrupted": a.corrupted, "metric": a.metric, "rec": rec, "layers": rec.layers,
            **{("layer", i): lay for i, lay in enumerate(rec.layers)}, **{("rec", k): t for k, t in rec.data.items()}}


def _layer_key(lay: Layer) -> tuple:
    return (lay.index, lay.module, lay.kind, lay.H, lay.Hkv, lay.D, lay.Dv)


def _stand_in(model, a: _Prepared) -> Recording:
    """The clean recording as the corrupted run reads it before the clean run is made: its
    layers (from a forward of one row and one position) and, for every tensor it will hold, an
    empty one of its shape (B, T, ...) and dtype on the meta device (any arithmetic with it
    raises: the corrupted run may only hold it, or read its size)."""
    inputs = a.clean
    if isinstance(inputs, Tensor):
        tiny = inputs[:1, :1]
    else:
        tiny = {k: (v[:1, :1] if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[:2] == (a.B, a.T) else v)
                for k, v in ((k, inputs[k]) for k in inputs.keys())}
    small = record(model, tiny, what=a.whats)
    data = {k: torch.empty((a.B, a.T, *t.shape[2:]), dtype=t.dtype, device="meta") for k, t in small.data.items()}
    return Recording(data, small.layers, None, None, a.B)


def _lean(model, inputs, budget: int) -> dict:
    """{"logits_to_keep": 1} when the recording runs (clean, corrupted) may skip their full
    logits (a transformers model that takes the keyword) and those would take over a quarter
    of the budget (SmolLM2 at 4,096 positions: 0.8 GB a row); else {}. The scan reads
    neither run's logits: the self-checks compare the last block's output."""
    if not takes_logits_to_keep(model):
        return {}
    get = getattr(model, "get_output_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    ids = inputs if isinstance(inputs, Tensor) else next(
        (inputs[k] for k in inputs.keys() if isinstance(inputs[k], Tensor) and inputs[k].dim() == 2), None)
    if not isinstance(weight, Tensor) or ids is None:
        return {}
    return {"logits_to_keep": 1} if ids.numel() * weight.shape[0] * weight.element_size() > budget // 4 else {}


def _positions_of(rec: Recording) -> int:
    t = rec["z", rec.layers[0].index] if ("z", rec.layers[0].index) in rec else None
    return 1 if t is None else t.shape[1]


class _Attribution(Handler):
    """Adds a zero leaf to each activation so its gradient can be read."""

    def __init__(self, what: str):
        self.what = what
        self.leaves: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def _leaf(self, lay, t):
        d = torch.zeros_like(t, requires_grad=True)
        self.leaves[lay.index] = d
        self.values[lay.index] = t.detach()
        return t + d

    def k(self, lay, k):
        return self._leaf(lay, k) if self.what == "k" else k

    def v(self, lay, v):
        return self._leaf(lay, v) if self.what == "v" else v

    def z(self, lay, z, v):
        return self._leaf(lay, z) if self.what == "z" else z


def attribution_scan(model, clean, corrupted, metric: Callable[[Tensor], Tensor], what: str = "z", *,
                     group=None) -> Tensor:
    """Attribution patching: `patch_scan`'s table to first order, every head at once.

    metric(corrupted) + sum over batch, positions and head dims of (a_clean - a_corr) *
    d metric / d a, at the corrupted run (two forwards, one backward). An
    approximation: exact only where the metric is linear in the head's activation (far
    from it for heads whose patch changes the output a lot); use `patch_scan` for the
    exact table. what: "z", "k" or "v". Returns `(layers, heads)`, like `patch_scan`.

    group: None (one process), or a torch.distributed process group whose every rank makes
    this call with the same model, inputs and options. There are no variants to share: the
    two halves are the runner's two units, the corrupted forward and backward on rank 0 while
    rank 1 records the clean run (at most (2 forwards + 1 backward) / (1 forward + 1 backward)
    faster; ranks above 1 wait), every rank gets both and computes the same table, bitwise
    the one process's. An error on any rank raises on every rank.
    """
    check_group(group)
    ranks = Ranks(group, "attribution_scan")

    def checked():
        check_model(model)
        check_what(what, ("z", "k", "v"))
        check_inputs(model, clean, corrupted, metric)
        check_grad_mode("attribution_scan")
    ranks.run(checked, lambda _: fingerprint(model, clean, corrupted) + what)

    def half(name: str):
        if name == "clean":
            rec = record(model, clean, what=(what,))
            got = [(lay.index, rec[what, lay.index]) for lay in rec.layers]
        else:
            got = _attribution_grads(model, corrupted, metric, what)
        return got if group is None else to_device(got, torch.device("cpu"))  # pickled by the settle

    # costs: a forward and a backward against one forward (the costlier half goes to rank 0)
    (a_clean, got_corrupted), _ = run_units(ranks, ["clean", "corrupted"], [1.0, 3.0], half, None,
                                            "attribution_scan", size=lambda _: 1)
    if group is not None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        a_clean, got_corrupted = to_device((a_clean, got_corrupted), device)
    return _attribution_table(a_clean, *got_corrupted)


def _attribution_grads(model, corrupted, metric, what: str) -> tuple[float, list[tuple[int, Tensor, Tensor | None]]]:
    """The corrupted half: (metric, [(layer, activation, d metric / d activation or None), ...])."""
    handler = _Attribution(what)
    with Engine(model, handler).installed(), torch.enable_grad():
        m = metric(logits_of(call(model, corrupted, takes_use_cache(model))))
        base = scalar(m, "on the corrupted run")
        if not isinstance(m, Tensor) or not m.requires_grad:
            raise TypeError(f"metric must return a scalar tensor computed from the logits (attribution "
                            f"differentiates it); received {type(m).__name__}"
                            + ("" if not isinstance(m, Tensor) else " without a gradient"))
        layers = sorted(handler.leaves)
        grads = torch.autograd.grad(m, [handler.leaves[i] for i in layers], allow_unused=True)
    return base, [(i, handler.values[i], g) for i, g in zip(layers, grads)]


def _attribution_table(clean: list[tuple[int, Tensor]], base: float,
                       corrupted: list[tuple[int, Tensor, Tensor | None]]) -> Tensor:
    """base + sum of (clean - corrupted) * gradient per head, `(layers, heads)`."""
    assert [i for i, _ in clean] == [i for i, _, _ in corrupted], "both halves ran the same attention layers"
    out = torch.full((len(clean), max(a.shape[2] for _, a in clean)), math.nan)
    for (i, a_clean), (_, a_corr, g) in zip(clean, corrupted):
        delta = a_clean - a_corr  # (B, T|S, heads, Dh)
        contrib = torch.zeros(delta.shape[2]) if g is None else (delta * g).sum(dim=(0, 1, 3))
        out[i, :delta.shape[2]] = base + contrib.float()
    return out
