"""patch_scan's setup shared across ranks (`group=`): rank 0 records the clean run while rank 1
makes the corrupted run, each sends what it made (`multihead.heads._ranks.pack`), and the
self-check forwards run on one rank each while the others run variants.

On 2 and 4 gloo ranks: every rank's table and `info` are the single-process ones bit for bit,
the full-length clean recording and the corrupted run each ran on one rank only, and each
self-check once in the whole world; a rank that fails in the shared phase makes every rank
raise (a lasting failure) or every rank redo the setup (a passing one), within the world's
bound; a deferred check that fails, or a stand-in of the clean recording that is not its
shape, makes every rank redo the setup itself, and the table and `info` are still one
process's. The packing itself is checked in one
process against the objects it packed.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import dist_helpers
from dist_helpers import last_token_metric as _metric

WORLD_TIMEOUT = 120.0
PG_TIMEOUT = 30
CASES = [(m, c, w) for m in ("gpt2", "llama") for c in ("middle", "first") for w in ("z", "k", "v")]
# the self-check forwards patch_scan may defer (those the scan has: the last block's where it trims it)
CHECKS = ("self_check", "shortcut_check", "last_block_check")


def run_world(fn, world: int, timeout: float = WORLD_TIMEOUT) -> list:
    return dist_helpers.run_world(fn, world, timeout=timeout, pg_timeout=PG_TIMEOUT)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


class _Calls:
    """Counts, in this process, the full-length clean recordings, the corrupted runs and the
    self-check forwards (CHECKS) of patch_scan (the stand-in's one-position recording is not
    counted)."""

    def __init__(self):
        from multihead.heads import _scan_state, scan

        self.scan, self.state, self.counts = scan, _scan_state, {}
        self.methods = [n for n in ("run_corrupted", *CHECKS) if hasattr(_scan_state.ScanState, n)]
        self.saved = {"record": scan.record, **{n: getattr(_scan_state.ScanState, n) for n in self.methods}}

        def record(model, inputs, *a, **kw):
            ids = inputs if isinstance(inputs, torch.Tensor) else inputs["input_ids"]
            if ids.shape[1] > 1:
                self.counts["record"] = self.counts.get("record", 0) + 1
            return self.saved["record"](model, inputs, *a, **kw)
        scan.record = record
        for name in self.methods:
            setattr(_scan_state.ScanState, name, self.counted(name))

    def counted(self, name):
        real = self.saved[name]

        def method(obj, *a, **kw):
            self.counts[name] = self.counts.get(name, 0) + 1
            return real(obj, *a, **kw)
        return method

    def take(self) -> dict:
        counts, self.counts = self.counts, {}
        return counts

    def restore(self):
        self.scan.record = self.saved["record"]
        for name in self.methods:
            setattr(self.state.ScanState, name, self.saved[name])


# ----------------------------------------------------------------------- workers


def _w_shared(rank: int, world: int) -> dict:
    from multihead import heads

    group = dist.group.WORLD
    models, clean, corrupted = dist_helpers.scan_models()
    calls = _Calls()
    out: dict = {}
    for mname, cname, what in CASES:
        model, corr = models[mname], corrupted[cname]
        for per_run in (None, 1):
            name = f"{mname} {cname} {what} per_run={per_run}"
            info_one, info_all = {}, {}
            single = heads.patch_scan(model, clean, corr, _metric, what, variants_per_run=per_run, info=info_one)
            one = calls.take()
            shared = heads.patch_scan(model, clean, corr, _metric, what, variants_per_run=per_run, info=info_all,
                                      group=group)
            out[name] = {"equal": _same(single, shared), "info": (info_one, info_all), "one": one,
                         "shared": calls.take()}
    # a metric of one position a row (a lambda: it never travels, each rank holds its own):
    # the rows rolled to end where it reads (`aligned`), the recordings' logits trimmed
    from multihead.heads.metrics import AtPositions

    at = AtPositions(lambda logits: (logits[:, 3] - logits[:, 4]).mean(), [5, 6])
    for mname in models:
        name = f"{mname} middle z AtPositions"
        info_one, info_all = {}, {}
        single = heads.patch_scan(models[mname], clean, corrupted["middle"], at, info=info_one)
        one = calls.take()
        shared = heads.patch_scan(models[mname], clean, corrupted["middle"], at, info=info_all, group=group)
        out[name] = {"equal": _same(single, shared), "info": (info_one, info_all), "one": one, "shared": calls.take()}
    calls.restore()
    return out


def _w_failing(rank: int, world: int) -> dict:
    """A forward that raises on one rank in the shared phase: lasting (every full-length forward
    on that rank) or passing (the first one only)."""
    from multihead import heads

    group = dist.group.WORLD
    models, clean, corrupted = dist_helpers.scan_models()
    model, corr = models["llama"], corrupted["middle"]
    single = heads.patch_scan(model, clean, corr, _metric)
    got: dict = {}
    for on_rank, lasting in ((0, True), (1, True), (0, False), (1, False)):
        left = [1]

        def pre(module, args, kwargs, on_rank=on_rank, lasting=lasting, left=left):
            ids = args[0] if args else kwargs.get("input_ids")
            if rank == on_rank and ids is not None and ids.shape[1] > 1 and (lasting or left[0]):
                left[0] -= 1
                raise KeyError(f"forward failed on purpose on rank {rank}")
        handle = model.register_forward_pre_hook(pre, with_kwargs=True)
        name = f"rank {on_rank} {'lasting' if lasting else 'passing'}"
        start = time.monotonic()
        try:
            table = heads.patch_scan(model, clean, corr, _metric, group=group)
            got[name] = ("returned", _same(single, table))
        except Exception as e:  # a lasting failure: every rank lands here
            got[name] = ("raised", f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}")
        finally:
            handle.remove()
        got[name + " seconds"] = time.monotonic() - start
    got["after"] = _same(single, heads.patch_scan(model, clean, corr, _metric, group=group))
    return got


def _w_check_fails(rank: int, world: int) -> dict:
    """A self-check that fails (on every rank, as a model would): the ranks that took it as
    passed redo the setup, and the table and info are one process's."""
    from multihead import heads
    from multihead.heads import _scan_state

    group = dist.group.WORLD
    models, clean, corrupted = dist_helpers.scan_models()
    out = {}
    for name in ("self_check", "shortcut_check"):
        real = getattr(_scan_state.ScanState, name)
        setattr(_scan_state.ScanState, name, lambda self: "failed on purpose")
        try:
            for mname in ("gpt2", "llama"):
                info_one, info_all = {}, {}
                single = heads.patch_scan(models[mname], clean, corrupted["middle"], _metric, info=info_one)
                shared = heads.patch_scan(models[mname], clean, corrupted["middle"], _metric, info=info_all,
                                          group=group)
                out[f"{name} {mname}"] = (_same(single, shared), info_one, info_all)
        finally:
            setattr(_scan_state.ScanState, name, real)
    return out


def _w_align_check(rank: int, world: int) -> dict:
    """The rolled rows' check (two forwards of the corrupted rows): run once in the world while
    the other ranks begin their share; when it fails, every rank redoes the setup with the rows
    as given, and the table and info are one process's."""
    from multihead import heads
    from multihead.heads import _align
    from multihead.heads.metrics import AtPositions

    group = dist.group.WORLD
    models, clean, corrupted = dist_helpers.scan_models()
    at = AtPositions(lambda logits: (logits[:, 3] - logits[:, 4]).mean(), [5, 6])
    # a failing alignment check injected on the ranks (distributed workers: no monkeypatch fixture there)
    real, ran = _align._same_logits, []
    out = {}
    for failing in (False, True):
        def check(*args, failing=failing):
            ran.append(1)
            return "failed on purpose" if failing else real(*args)
        _align._same_logits = check
        try:
            info_one, info_all = {}, {}
            single = heads.patch_scan(models["llama"], clean, corrupted["middle"], at, info=info_one)
            one, ran[:] = len(ran), []
            shared = heads.patch_scan(models["llama"], clean, corrupted["middle"], at, info=info_all, group=group)
            out[failing] = (_same(single, shared), info_one, info_all, one, len(ran))
            ran[:] = []
        finally:
            _align._same_logits = real
    return out


@pytest.mark.distributed
def test_the_rolled_rows_check_runs_once_in_the_world_and_a_failure_gives_the_single_process_table():
    got = run_world(_w_align_check, 2)
    for failing in (False, True):
        for rank in range(2):
            equal, info_one, info_all, one, _ = got[rank][failing]
            assert equal, f"rank {rank}, check failing={failing}: the table differs from one process's"
            assert info_one == info_all, (rank, failing, info_one, info_all)
            assert one == 1
        assert got[0][failing][1]["aligned"] is (not failing), got[0][failing][1]
    assert got[0][True][1]["aligned_reason"] == "failed on purpose"
    assert sum(got[rank][False][4] for rank in range(2)) == 1  # once in the world, on one rank
    # failing: once deferred, then once more on every rank when the setup is redone in line
    assert sum(got[rank][True][4] for rank in range(2)) == 1 + 2


def _w_stand_in_off(rank: int, world: int) -> dict:
    """A stand-in whose shapes are not the clean run's (one position too many): every rank
    must see it and run the whole setup itself; the table is still one process's."""
    from multihead import heads
    from multihead.heads import scan
    from multihead.heads._record import Recording

    group = dist.group.WORLD
    models, clean, corrupted = dist_helpers.scan_models()
    # a stand-in of the wrong shape injected: the ranks must refuse it, and no real input produces one
    real = scan._stand_in

    def off(model, a):
        good = real(model, a)
        data = {k: torch.empty((t.shape[0], t.shape[1] + 1, *t.shape[2:]), dtype=t.dtype, device="meta")
                for k, t in good.data.items()}
        return Recording(data, good.layers, None, None, good.batch)
    single = heads.patch_scan(models["gpt2"], clean, corrupted["middle"], _metric)
    calls = _Calls()
    scan._stand_in = off
    try:
        shared = heads.patch_scan(models["gpt2"], clean, corrupted["middle"], _metric, group=group)
    finally:
        scan._stand_in = real
        calls.restore()
    return {"equal": _same(single, shared), "counts": calls.take()}


# ------------------------------------------------------------------------- tests


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_the_setup_is_shared_and_the_tables_are_one_process(world):
    results = run_world(_w_shared, world)
    for name in results[0]:
        for rank, got in enumerate(results):
            r = got[name]
            assert r["equal"], f"rank {rank} of {world}, {name}: the table differs from one process's"
            assert r["info"][0] == r["info"][1], f"rank {rank}, {name}: info {r['info'][1]} vs {r['info'][0]}"
        one = results[0][name]["one"]
        shared = [got[name]["shared"] for got in results]
        assert one.get("record") == 1 and one.get("run_corrupted") == 1, (name, one)
        # the full-length clean recording on rank 0 only, the corrupted run on rank 1 only
        assert [s.get("record", 0) for s in shared] == [1] + [0] * (world - 1), (name, shared)
        assert [s.get("run_corrupted", 0) for s in shared] == [0, 1] + [0] * (world - 2), (name, shared)
        for check in CHECKS:  # each check once in the world, as in one process
            assert sum(s.get(check, 0) for s in shared) == one.get(check, 0), (name, check, one, shared)
    assert all(results[0][f"{m} middle z AtPositions"]["info"][0]["aligned"] for m in ("gpt2", "llama")), results[0]
    ran = {name: results[0][name]["one"] for name in results[0]}
    assert any(r.get("self_check") for r in ran.values()) and any(r.get("shortcut_check") for r in ran.values())


@pytest.mark.distributed
def test_a_rank_failing_in_the_shared_setup_raises_on_every_rank():
    start = time.monotonic()
    results = run_world(_w_failing, 2, timeout=90)
    for rank, got in enumerate(results):
        assert got["after"] is True, f"rank {rank}: the scan after the failures differs from one process's"
        for on_rank in (0, 1):
            lasting, passing = got[f"rank {on_rank} lasting"], got[f"rank {on_rank} passing"]
            assert lasting[0] == "raised", (rank, on_rank, lasting)
            if rank == on_rank:
                assert lasting[1].startswith("KeyError") and "on purpose" in lasting[1] and \
                    f"raised on rank {on_rank} of 2" in lasting[1], lasting
            else:
                assert lasting[1].startswith("RuntimeError") and f"rank(s) {on_rank} of 2 raised" in lasting[1] \
                    and "on purpose" in lasting[1], lasting
            assert passing == ("returned", True), (rank, on_rank, passing)
        for name, seconds in got.items():
            if name.endswith("seconds"):
                assert seconds < PG_TIMEOUT / 2, f"rank {rank}: {name} took {seconds:.1f} s (waited in a collective?)"
    assert time.monotonic() - start < 90


@pytest.mark.distributed
def test_a_deferred_check_that_fails_gives_the_single_process_table():
    for rank, got in enumerate(run_world(_w_check_fails, 2)):
        for name, (equal, info_one, info_all) in got.items():
            assert equal, f"rank {rank}, {name}: the table differs from one process's"
            assert info_one == info_all, (rank, name, info_one, info_all)
        assert got["self_check gpt2"][1]["reason"] == "failed on purpose", got  # the prefix skip declined


def test_pack_rebuilds_against_the_receivers_model_and_refs():
    """One process: what `unpack` rebuilds equals what `pack` packed, bit for bit; modules,
    parameter views and refs are the receiver's own; views of one storage share it."""
    from multihead.heads._ranks import pack, unpack

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # the receiver's copy
    other.load_state_dict(model.state_dict())
    base = torch.randn(5, 6)
    mine, theirs = {"x": torch.ones(2)}, {"x": torch.zeros(2)}
    state = {"by_block": {id(model[1]): (base[1:3], base.t())}, "block": model[0],
             "weight": model[1].weight.detach().t(), "half": torch.arange(6, dtype=torch.float16),
             "inputs": mine, "empty": torch.zeros(0, 3), "ints": torch.arange(3)}
    packed = pack(state, model, {"inputs": mine})
    got = unpack(packed, other, {"inputs": theirs})
    (a, b), = got["by_block"].values()
    assert list(got["by_block"]) == [id(other[1])] and got["block"] is other[0] and got["inputs"] is theirs
    assert torch.equal(a, base[1:3]) and torch.equal(b, base.t()) and b.stride() == base.t().stride()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one storage, as sent
    assert got["weight"].untyped_storage().data_ptr() == other[1].weight.untyped_storage().data_ptr()
    assert torch.equal(got["weight"], other[1].weight.t()) and not got["weight"].requires_grad
    assert got["half"].dtype == torch.float16 and torch.equal(got["half"], state["half"])
    assert got["empty"].shape == (0, 3) and torch.equal(got["ints"], state["ints"])
    with pytest.raises(TypeError, match="cannot send a Tensor on meta"):
        pack({"t": torch.empty(2, device="meta")}, model)


@pytest.mark.distributed
def test_a_stand_in_of_the_wrong_shape_makes_every_rank_run_the_setup():
    for rank, got in enumerate(run_world(_w_stand_in_off, 2)):
        assert got["equal"], f"rank {rank}: the table differs from one process's"
        # rank 0's clean run of the shared phase, then every rank's own setup
        assert got["counts"].get("record") == (2 if rank == 0 else 1), (rank, got["counts"])
        assert got["counts"].get("run_corrupted") == (2 if rank == 1 else 1), (rank, got["counts"])
