"""The edge tools across processes (`group=`): 2 gloo ranks on 127.0.0.1.

Each rank builds the same float64 GPT-2 (fused c_attn, biases) and Llama (GQA) of
test_edge_circuits, calls `edge_scores`, `edge_patch` and `faithfulness_curve` with
`group=None` (one process, in the same process and thread count) and with the world's group,
and reports what differs: with the same chunks of rows (`batch_size=` at most B / ranks) the
group's results are bitwise one process's; with the default chunks (one process runs one
chunk, the group one per rank) equal to float64 rounding. Every rank must have run rows of
its own, and together each row once per forward. An error on one rank (a metric that fails
there, inputs that differ) raises on every rank within the world's bound. A world that does
not finish within WORLD_TIMEOUT fails; so does a rank that raises unexpectedly.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import dist_helpers
from test_edge_circuits import make, pair
from test_edge_circuits import metric as _metric

WORLD_TIMEOUT = 120.0  # seconds the world may run before the test fails (a hang fails here)
PG_TIMEOUT = 30  # seconds gloo waits in a collective: a rank left waiting raises instead of hanging
B, T = 5, 6  # five rows: two ranks get unequal shares


def _inputs(seed: int):
    return pair(seed, rows=B, length=T, changed=(1, 3))


def _last_diff(logits):  # one value per row: its mean is a metric the bootstrap can resample
    return logits[:, -1, 3] - logits[:, -1, 5]


def _differs(name: str, one, many, exact: bool) -> str | None:
    """What differs between one process's result and the group's (None: nothing)."""
    a = torch.as_tensor(one, dtype=torch.float64)
    b = torch.as_tensor(many, dtype=torch.float64)
    if a.shape != b.shape:
        return f"{name}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
    if exact:
        return None if torch.equal(a, b) else f"{name}: not bitwise equal, max diff {float((a - b).abs().max()):.3e}"
    scale = max(float(a.abs().max()), 1e-300)
    diff = float((a - b).abs().max())
    # 1e-10: float64 rounding of rows summed in other groups, amplified where the curve divides by
    # the gap between the clean and the corrupted metric
    return None if diff <= 1e-10 * scale else f"{name}: max diff {diff:.3e} of scale {scale:.3e}"


def _curve_values(c: dict) -> list[float]:
    return [*c["faithfulness"], c["cpr"], c["cmd"], *c["metric_kept"], c["metric_clean"], c["metric_corrupted"]]


def _w_equal(rank: int, world: int) -> dict:
    from multihead import heads
    from multihead.heads import _edge_run
    from multihead.heads.metrics import AtPositions

    group = dist.group.WORLD
    report: dict = {"unequal": [], "rows": {}, "unseeded": None}
    rows = [0]
    forward = _edge_run.Run.forward

    def counted(self, emb):  # the only place that sees which rows this rank ran
        rows[0] += emb.shape[0]
        return forward(self, emb)
    _edge_run.Run.forward = counted

    def check(name, one, many, exact):
        got = _differs(name, one, many, exact)
        if got:
            report["unequal"].append(got)

    def shared(name, fn, *args, **kwargs):
        """fn(*args, group=group, **kwargs) on this rank, counting the rows its forwards ran."""
        rows[0] = 0
        out = fn(*args, group=group, **kwargs)
        report["rows"][name] = rows[0]
        return out

    for kind in ("gpt2", "llama"):
        model = make(kind)
        clean, corrupted = _inputs({"gpt2": 10, "llama": 11}[kind])
        reference, _ = _inputs(12)
        at_last = AtPositions(lambda lg: (lg[:, 3] - lg[:, 5]).mean(), torch.tensor([T - 1, T - 2, T - 1, 2, T - 1]))
        for method, steps, metric in (("eap-ig", 3, _metric), ("eap", 1, at_last)):
            for size in (None, 2, 1):
                name = f"{kind} edge_scores {method} batch_size={size}"
                one = heads.edge_scores(model, clean, corrupted, metric, method, steps, batch_size=size)
                many = shared(name, heads.edge_scores, model, clean, corrupted, metric, method, steps,
                              batch_size=size)
                check(name, one.matrix, many.matrix, exact=size is not None)
                check(name + " top", [s for _, s in one.top(20)], [s for _, s in many.top(20)], size is not None)
        scores = heads.edge_scores(model, clean, corrupted, _metric, "eap")
        E = heads.edges(model)
        keep = [E[i] for i in torch.randperm(len(E), generator=torch.Generator().manual_seed(3))[:len(E) // 3]]
        for size in (None, 2):
            exact = size is not None
            name = f"{kind} edge_patch corrupted batch_size={size}"
            check(name, heads.edge_patch(model, clean, corrupted, _metric, keep, batch_size=size),
                  shared(name, heads.edge_patch, model, clean, corrupted, _metric, keep, batch_size=size), exact)
            name = f"{kind} edge_patch mean batch_size={size}"
            check(name, heads.edge_patch(model, clean, None, _metric, keep, "mean", reference=reference,
                                         batch_size=size),
                  heads.edge_patch(model, clean, None, _metric, keep, "mean", reference=reference, batch_size=size,
                                   group=group), exact)
            name = f"{kind} faithfulness_curve batch_size={size}"
            kw = dict(fractions=[0.01, 0.1, 0.5, 1.0], bootstrap=50, per_row=_last_diff, batch_size=size)
            mean_metric = lambda lg: _last_diff(lg).mean()  # noqa: E731
            one = heads.faithfulness_curve(model, clean, corrupted, mean_metric, scores, **kw)
            many = shared(name, heads.faithfulness_curve, model, clean, corrupted, mean_metric, scores, **kw)
            check(name, _curve_values(one), _curve_values(many), exact)
            check(name + " intervals", one["cpr_interval"] + one["cmd_interval"],
                  many["cpr_interval"] + many["cmd_interval"], exact)
            assert one["edges_kept"] == many["edges_kept"]
        unseeded = heads.faithfulness_curve(model, clean, corrupted, mean_metric, scores, bootstrap=50,
                                            per_row=_last_diff, seed=None, group=group)
        report["unseeded"] = unseeded["cpr_interval"] + unseeded["cmd_interval"]
    _edge_run.Run.forward = forward
    return report


def _w_errors(rank: int, world: int) -> dict:
    """Errors of one rank: each must raise on every rank, then the world goes on."""
    from multihead import heads

    group = dist.group.WORLD
    model = make("llama")
    clean, corrupted = _inputs(11)
    other, _ = _inputs(13)
    E = heads.edges(model)
    got: dict[str, str | None] = {}
    expect = dist_helpers.error_recorder(got)

    def failing(logits):
        if rank == 1:
            raise KeyError("metric failed on purpose")
        return _metric(logits)

    scores = heads.edge_scores(model, clean, corrupted, _metric, "eap")
    expect("edge_scores metric", lambda: heads.edge_scores(model, clean, corrupted, failing, "eap", batch_size=1,
                                                           group=group))
    expect("edge_patch metric", lambda: heads.edge_patch(model, clean, corrupted, failing, E[:5], group=group))
    expect("faithfulness_curve metric", lambda: heads.faithfulness_curve(model, clean, corrupted, failing, scores,
                                                                         group=group))
    expect("edge_scores inputs differ", lambda: heads.edge_scores(
        model, clean if rank == 0 else other, corrupted, _metric, "eap", group=group))
    expect("edge_patch keep differs", lambda: heads.edge_patch(model, clean, corrupted, _metric,
                                                               E[:5] if rank == 0 else E[:6], group=group))
    expect("edge_scores bad method on one rank", lambda: heads.edge_scores(
        model, clean, corrupted, _metric, "eap" if rank == 0 else "acdc", group=group))
    single = heads.edge_scores(model, clean, corrupted, _metric, "eap", batch_size=2)
    got["after"] = torch.equal(single.matrix, heads.edge_scores(model, clean, corrupted, _metric, "eap",
                                                                batch_size=2, group=group).matrix)
    return got


@pytest.mark.distributed
def test_every_rank_gets_the_single_process_scores_patch_and_curve():
    world = 2
    results = dist_helpers.run_world(_w_equal, world, timeout=WORLD_TIMEOUT, pg_timeout=PG_TIMEOUT)
    for rank, report in enumerate(results):
        assert not report["unequal"], f"rank {rank} of {world}: results differ from one process's: {report['unequal']}"
    for name in results[0]["rows"]:
        ran = [r["rows"][name] for r in results]
        assert all(n > 0 for n in ran), f"{name}: a rank ran no rows: {ran}"
    # edge_patch: the corrupted and the patched forward of every row, once, on one rank
    assert sum(r["rows"]["llama edge_patch corrupted batch_size=2"] for r in results) == 2 * B
    # EAP-IG with 3 steps over several chunks: the readouts' pass and the gradients' pass, each
    # 3 steps, and the corrupted run, every row once
    assert sum(r["rows"]["llama edge_scores eap-ig batch_size=2"] for r in results) == (3 + 3 + 1) * B
    assert results[0]["unseeded"] == results[1]["unseeded"], "seed=None: the ranks resampled differently"


def _w_lab(rank: int, world: int) -> list[str]:
    """multihead's own decoder (GQA with RoPE; MLA) across the ranks: with the same chunks, bitwise one process's."""
    import test_edge_lab
    from multihead import heads

    group, unequal = dist.group.WORLD, []
    for kind in ("gqa-rope", "mla"):
        model = test_edge_lab.make(kind)
        clean, corrupted = test_edge_lab.pair(8, rows=B)
        name = f"lab {kind} edge_scores"
        one = heads.edge_scores(model, clean, corrupted, _metric, "eap-ig", 2, batch_size=2)
        many = heads.edge_scores(model, clean, corrupted, _metric, "eap-ig", 2, batch_size=2, group=group)
        unequal.append(_differs(name, one.matrix, many.matrix, exact=True))
        E = heads.edges(model)
        keep = E[::3]
        unequal.append(_differs(f"lab {kind} edge_patch", heads.edge_patch(model, clean, corrupted, _metric, keep,
                                                                           batch_size=2),
                                heads.edge_patch(model, clean, corrupted, _metric, keep, batch_size=2, group=group),
                                exact=True))
    return [u for u in unequal if u]


@pytest.mark.distributed
def test_the_lab_decoder_across_ranks_is_one_process():
    results = dist_helpers.run_world(_w_lab, 2, timeout=WORLD_TIMEOUT, pg_timeout=PG_TIMEOUT)
    for rank, unequal in enumerate(results):
        assert not unequal, f"rank {rank} of 2: results differ from one process's: {unequal}"


@pytest.mark.distributed
def test_an_error_on_one_rank_raises_on_every_rank():
    start = time.monotonic()
    results = dist_helpers.run_world(_w_errors, 2, timeout=90, pg_timeout=PG_TIMEOUT)
    dist_helpers.check_every_rank_raised(results, PG_TIMEOUT / 2, "scores")
    r0, r1 = results
    for name in ("edge_scores metric", "edge_patch metric", "faithfulness_curve metric"):
        assert r1[name].startswith("KeyError") and "on purpose" in r1[name] and "rank 1 of 2" in r1[name], r1[name]
        assert r0[name].startswith("RuntimeError") and "rank(s) 1 of 2 raised" in r0[name], r0[name]
    for name in ("edge_scores inputs differ", "edge_patch keep differs"):
        for got in results:
            assert got[name].startswith("ValueError") and "disagree" in got[name], got[name]
    assert "method must be one of" in r1["edge_scores bad method on one rank"], r1
    assert "rank(s) 1" in r0["edge_scores bad method on one rank"], r0
    assert time.monotonic() - start < 90


def test_a_bad_group_is_a_type_error():
    from multihead import heads

    model = make("gpt2")
    clean, corrupted = _inputs(1)
    E = heads.edges(model)
    scores = heads.edge_scores(model, clean, corrupted, _metric, "eap")
    calls = {
        "edge_scores": lambda g: heads.edge_scores(model, clean, corrupted, _metric, "eap", group=g),
        "edge_patch": lambda g: heads.edge_patch(model, clean, corrupted, _metric, E[:3], group=g),
        "faithfulness_curve": lambda g: heads.faithfulness_curve(model, clean, corrupted, _metric, scores,
                                                                 fractions=[0.5, 1.0], group=g),
    }
    for name, call in calls.items():
        for bad in ("world", 0, dist):
            with pytest.raises(TypeError, match=f"group must be None .*received {type(bad).__name__}"):
                call(bad)
        assert call(None) is not None, name
