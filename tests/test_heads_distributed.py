"""heads' scans across processes (`group=`): 2 and 4 gloo ranks on 127.0.0.1.

Each rank builds the same small random GPT-2 and Llama (one seed), computes every table
twice, with `group=None` (the single-process scan, in the same process and thread count)
and with the world's group, and returns what differs; the test asserts here that every
rank's table is the single-process one bit for bit (NaN where the single-process table has
NaN), that the work was shared (every rank evaluated the metric for some variants and
together for each variant once), and that an error on one rank raises on every rank
within the world's bound instead of leaving the others in a collective. A world that does
not finish within WORLD_TIMEOUT fails; so does a rank that raises unexpectedly.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import dist_helpers
from dist_helpers import last_token_metric as _metric

WORLD_TIMEOUT = 90.0  # seconds a world may run before the test fails (a hang fails here)
PG_TIMEOUT = 30  # seconds gloo waits in a collective: a rank left waiting raises instead of hanging
WHATS = ("z", "k", "v", "pattern")


# ------------------------------------------------------------------ the harness


def run_world(fn, world: int, timeout: float = WORLD_TIMEOUT) -> list:
    """`fn(rank, world)` on `world` gloo ranks forked from one server (torch and transformers
    imported once); their results by rank."""
    return dist_helpers.run_world(fn, world, timeout=timeout, pg_timeout=PG_TIMEOUT)


# ----------------------------------------------------------------------- workers


class _Counting:
    """A metric that counts its calls (the variants a rank evaluated)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, logits):
        self.calls += 1
        return _metric(logits)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where the other has NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _lm_loss(model, batch):
    logits = model(batch, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _w_tables(rank: int, world: int) -> dict:
    from multihead import heads

    group = dist.group.WORLD
    models, clean, corrupted = dist_helpers.scan_models()
    report: dict = {"unequal": [], "calls": {}, "info": {}}

    def check(name, single, shared):
        if not _same(single, shared):
            report["unequal"].append(f"{name}: max diff {float((single - shared).abs().nan_to_num(0).max()):.3e}")

    for mname, model in models.items():
        for cname, corr in corrupted.items():
            for what in WHATS:
                for per_run in (None, 1):
                    name = f"{mname} {cname} patch_scan {what} per_run={per_run}"
                    info_one, info_all, counter = {}, {}, _Counting()
                    single = heads.patch_scan(model, clean, corr, _metric, what, variants_per_run=per_run,
                                              info=info_one)
                    shared = heads.patch_scan(model, clean, corr, counter, what, variants_per_run=per_run,
                                              info=info_all, group=group)
                    check(name, single, shared)
                    report["calls"][name] = counter.calls - 1  # less the check on the corrupted run
                    report["info"][name] = (info_one == info_all, info_one["skipped"])
            shared = heads.patch_scan(model, clean, corr, _metric, "z", positions=[-1, 5], group=group)
            check(f"{mname} {cname} patch_scan positions", heads.patch_scan(model, clean, corr, _metric, "z",
                                                                            positions=[-1, 5]), shared)
            for what in ("z", "k", "v"):
                check(f"{mname} {cname} attribution_scan {what}",
                      heads.attribution_scan(model, clean, corr, _metric, what),
                      heads.attribution_scan(model, clean, corr, _metric, what, group=group))
            for receivers, via in (([(2, 0), (1, 1)], "q"), ([(2, 1)], "k"), ("logits", "q")):
                name = f"{mname} {cname} path_patch_scan {receivers} {via}"
                counter = _Counting()
                single = heads.path_patch_scan(model, clean, corr, _metric, receivers, via)
                shared = heads.path_patch_scan(model, clean, corr, counter, receivers, via, variants_per_run=1,
                                               group=group)
                check(name, single, heads.path_patch_scan(model, clean, corr, _metric, receivers, via,
                                                          variants_per_run=1))
                check(name + " (one sender a run)", single, shared)
        batches = [torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(5)]
        for normalize in (True, False):
            check(f"{mname} importance normalize={normalize}",
                  heads.importance(model, batches, _lm_loss, normalize=normalize),
                  heads.importance(model, iter(batches), _lm_loss, normalize=normalize, group=group))
    return report


def _check_tables(results: list[dict], world: int) -> None:
    for rank, report in enumerate(results):
        assert not report["unequal"], f"rank {rank} of {world}: tables differ from one process's: {report['unequal']}"
        assert report["info"] and all(same for same, _ in report["info"].values()), (rank, report["info"])
    skipped = {name: s for name, (_, s) in results[0]["info"].items()}
    assert any(skipped.values()) and not all(skipped.values()), skipped  # both paths ran, the prefix skip and not
    for name in results[0]["calls"]:
        calls = [r["calls"][name] for r in results]
        if "patch_scan" in name and "path" not in name:
            heads = 3 * (2 if " k " in name or " v " in name else 4) if "llama" in name else 3 * 4
            assert sum(calls) == heads, f"{name}: the ranks evaluated {calls} variants; expected {heads} in all"
            if "per_run=1" in name:  # a chunk a variant: at least 6 chunks, so every rank has one
                assert all(c > 0 for c in calls), f"{name}: a rank did nothing: {calls}"


def _w_errors(rank: int, world: int) -> dict:
    """Errors that used to be one rank's: each must raise on every rank, then the world goes on."""
    from multihead import heads

    group = dist.group.WORLD
    models, clean, corrupted = dist_helpers.scan_models()
    model, corr = models["llama"], corrupted["middle"]
    got: dict[str, str | None] = {}
    expect = dist_helpers.error_recorder(got)

    class Failing:
        def __init__(self, on_rank: int, at_call: int):
            self.on_rank, self.at_call, self.calls = on_rank, at_call, 0

        def __call__(self, logits):
            self.calls += 1
            if rank == self.on_rank and self.calls >= self.at_call:
                raise KeyError(f"metric failed on purpose at call {self.calls}")
            return _metric(logits)

    expect("patch_scan setup", lambda: heads.patch_scan(model, clean, corr, Failing(1, 1), group=group))
    expect("patch_scan mid-scan", lambda: heads.patch_scan(model, clean, corr, Failing(1, 3), "k",
                                                           variants_per_run=1, group=group))
    expect("path_patch_scan mid-scan", lambda: heads.path_patch_scan(
        model, clean, corr, Failing(world - 1, 2), [(2, 0)], variants_per_run=1, group=group))
    # rank 0 runs the costlier half, the corrupted forward and backward, and so the metric
    expect("attribution_scan", lambda: heads.attribution_scan(model, clean, corr, Failing(0, 1), group=group))

    def loss(m, batch):
        if rank == 0:
            raise KeyError("loss failed on purpose")
        return _lm_loss(m, batch)
    batches = [clean, corr, clean]
    expect("importance", lambda: heads.importance(model, batches, loss, group=group))
    expect("inputs differ", lambda: heads.patch_scan(model, clean, corr if rank == 0 else corrupted["first"],
                                                     _metric, group=group))
    expect("bad argument on one rank", lambda: heads.patch_scan(model, clean, corr, _metric,
                                                                "z" if rank == 0 else "q", group=group))
    # the world is still in step: a scan after all of that is the single-process one
    single = heads.patch_scan(model, clean, corr, _metric)
    got["after"] = _same(single, heads.patch_scan(model, clean, corr, _metric, group=group))
    return got


# ------------------------------------------------------------------------- tests


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_returns_the_single_process_table(world):
    """patch_scan (z/k/v/pattern, with and without the prefix skip, chunks of 1 and of 8 variants,
    positions), attribution_scan, path_patch_scan (q, k, logits) and importance on GPT-2 and Llama."""
    _check_tables(run_world(_w_tables, world), world)


@pytest.mark.distributed
def test_an_error_on_one_rank_raises_on_every_rank():
    start = time.monotonic()
    world = 2
    results = run_world(_w_errors, world, timeout=60)
    dist_helpers.check_every_rank_raised(results, PG_TIMEOUT / 2, "scan")
    r0, r1 = results
    assert r0["attribution_scan"].startswith("KeyError") and "rank 0 of 2" in r0["attribution_scan"], r0
    assert r1["attribution_scan"].startswith("RuntimeError") and "rank(s) 0 of 2 raised" in r1["attribution_scan"], r1
    for name in ("patch_scan setup", "patch_scan mid-scan"):
        assert r1[name].startswith("KeyError") and "on purpose" in r1[name] and "rank 1 of 2" in r1[name], r1[name]
        assert r0[name].startswith("RuntimeError") and "rank(s) 1 of 2 raised" in r0[name] and \
            "on purpose" in r0[name], r0[name]
    assert r1["path_patch_scan mid-scan"].startswith("KeyError"), r1["path_patch_scan mid-scan"]
    assert "rank(s) 1" in r0["path_patch_scan mid-scan"], r0["path_patch_scan mid-scan"]
    assert r0["importance"].startswith("KeyError") and "rank(s) 0" in r1["importance"], (r0, r1)
    for got in results:
        assert got["inputs differ"].startswith("ValueError") and "disagree" in got["inputs differ"], got
    assert "what must be one of" in r1["bad argument on one rank"] or "'q'" in r1["bad argument on one rank"], r1
    assert "rank(s) 1" in r0["bad argument on one rank"], r0
    assert time.monotonic() - start < 60


def test_a_bad_group_is_a_type_error(tmp_path):
    import transformers

    import multihead.interop.hf  # noqa: F401
    from multihead import heads

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8,
                                                                 vocab_size=11, bos_token_id=0,
                                                                 eos_token_id=0)).eval()
    model.set_attn_implementation("multihead")
    x = torch.randint(0, 11, (1, 4))
    calls = {
        "patch_scan": lambda g: heads.patch_scan(model, x, x, _metric, group=g),
        "attribution_scan": lambda g: heads.attribution_scan(model, x, x, _metric, group=g),
        "path_patch_scan": lambda g: heads.path_patch_scan(model, x, x, _metric, "logits", group=g),
        "importance": lambda g: heads.importance(model, [x], _lm_loss, group=g),
    }
    for name, call in calls.items():
        for bad in ("world", 0, dist):
            with pytest.raises(TypeError, match=f"group must be None .*received {type(bad).__name__}"):
                call(bad)
        assert call(None) is not None, name
