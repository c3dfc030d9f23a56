"""Faithfulness curves of edge scores (the Mechanistic Interpretability Benchmark's CPR and CMD).

For each fraction p of the graph's edges, keep the round(p x edges) edges of largest |score|
(at least 1), run `edge_patch`, and report F = (m(kept) - m(none)) / (m(all) - m(none)).
CPR is the area under F and CMD the area under |1 - F|, by the trapezoid rule over p from 0
(where F = 0) to the last fraction. Every fraction's patched run shares one corrupted run
per chunk of rows. `bootstrap=n` adds 95% intervals over prompts: the rows resampled with
replacement n times, the metric recomputed from each run's stored logits (the scores stay
those given).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch

from multihead.checks import is_int
from multihead.heads._edge_common import check_batch_size, check_int, held, read_pair
from multihead.heads._edge_model import EdgeModel
from multihead.heads._edge_run import Readout, scalar
from multihead.heads._ranks import Ranks, check_group, fingerprint
from multihead.heads.edge_attribution import EdgeScores
from multihead.heads.edge_graph import parse_edge
from multihead.heads.edge_patching import keep_mask, patched_logits

FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _fractions(fractions) -> list[float]:
    try:
        given = list(fractions)
    except TypeError:
        raise TypeError(f"fractions must be numbers in (0, 1]; received {fractions!r:.80}") from None
    wrong = [p for p in given if isinstance(p, bool) or not isinstance(p, numbers.Real)]
    if wrong:  # a str or a bool is no fraction, though float() would take it
        raise TypeError(f"fractions must be numbers in (0, 1]; received {wrong[0]!r} ({type(wrong[0]).__name__})")
    out = [float(p) for p in given]
    if not out or any(not 0 < p <= 1 for p in out) or out != sorted(set(out)):
        raise ValueError(f"fractions must be increasing, distinct, in (0, 1]; received {out}")
    return out


def ranked(graph, scores) -> list[tuple]:
    """The graph's edges by |score|, largest first (ties in the graph's order)."""
    if isinstance(scores, EdgeScores):
        if scores.graph != graph:
            raise ValueError(f"scores are of another graph ({scores.graph}) than this model's ({graph}); score this "
                             "model's edges")
        v = scores.vector()
    elif isinstance(scores, Mapping):
        v = torch.tensor([_score(value) for value in _by_edge(graph, scores)], dtype=torch.float64)
    else:
        raise TypeError(f"scores must be EdgeScores or a mapping edge -> score; received {type(scores).__name__}")
    if bool(torch.isnan(v).any()):
        raise ValueError("scores hold NaN; a curve needs an order of the edges")
    return [graph.edges[i] for i in torch.argsort(v.abs(), descending=True, stable=True).tolist()]


def _by_edge(graph, scores: Mapping) -> list:
    """The mapping's values in `graph.edges` order (0 where an edge is missing); its keys pairs or names, each
    an edge of this graph, once."""
    values: dict = {}
    unknown = []
    for key, value in scores.items():
        try:
            edge = parse_edge(key)
        except (TypeError, ValueError) as err:
            raise type(err)(f"scores: {err}") from None
        if edge not in graph.edge_index:
            unknown.append(key)
        elif edge in values:
            raise ValueError(f"scores gives the edge {key!r} twice (as a pair and as a name)")
        values[edge] = value
    if unknown:
        raise ValueError(f"scores holds {len(unknown)} edge(s) not in this model's graph, e.g. {unknown[0]!r}: "
                         "scores of another model, or a misspelt name")
    if not values:
        raise ValueError("scores holds no edge; give a score per edge (edge_scores' EdgeScores, or a mapping)")
    return [values.get(e, 0.0) for e in graph.edges]


def _score(value) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() \
            and value.dtype != torch.bool:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"scores must map each edge to a real number; received {value!r:.40} "
                        f"({type(value).__name__})")
    return float(value)


def areas(fractions: list[float], faith: list[float]) -> tuple[float, float]:
    """(CPR, CMD): the trapezoid areas under F and |1 - F| from p = 0, where F = 0."""
    p, f = [0.0] + fractions, [0.0] + faith
    cpr = sum((p[i + 1] - p[i]) * (f[i] + f[i + 1]) / 2 for i in range(len(fractions)))
    cmd = sum((p[i + 1] - p[i]) * (abs(1 - f[i]) + abs(1 - f[i + 1])) / 2 for i in range(len(fractions)))
    return cpr, cmd


def _bootstrap(per_row, kept, none, full, fractions, n: int, seed: int) -> dict:
    """95% intervals of CPR and CMD over prompts: rows resampled n times, the metric the mean of per_row."""
    rows = []
    runs = [("corrupted", none), ("clean", full)] + [(f"fraction {p}", k) for p, k in zip(fractions, kept)]
    for name, logits in runs:
        v = per_row(logits)
        if not isinstance(v, torch.Tensor) or v.shape != (none.shape[0],):
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"per_row must return one value per row ({none.shape[0]},); received {got} on {name}")
        rows.append(v.detach().double().cpu())
    values = torch.stack(rows)  # (2 + fractions, B)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, values.shape[1], (n, values.shape[1]), generator=g)
    means = values[:, idx].mean(-1)  # (2 + fractions, n)
    faith = (means[2:] - means[0]) / (means[1] - means[0])
    cprs, cmds = zip(*(areas(fractions, faith[:, i].tolist()) for i in range(n)))
    q = torch.tensor([0.025, 0.975], dtype=torch.float64)
    return {"cpr_interval": torch.quantile(torch.tensor(cprs, dtype=torch.float64), q).tolist(),
            "cmd_interval": torch.quantile(torch.tensor(cmds, dtype=torch.float64), q).tolist(), "bootstrap": n}


def faithfulness_curve(model, clean, corrupted, metric, scores, fractions=FRACTIONS, *, bootstrap: int = 0,
                       per_row=None, seed: int | None = 0, batch_size: int | None = None, group=None) -> dict:
    """The faithfulness of the top edges by |score| at each fraction of the graph, with CPR and CMD.

    Args:
        scores: `EdgeScores` or a mapping edge -> score (edges missing from it score 0).
        fractions: increasing fractions of the edges in (0, 1].
        bootstrap, per_row: `bootstrap=n` resamples the prompts n times for 95% intervals of CPR and
            CMD; `per_row(readout) -> (B,)` gives each row's value, whose mean is the metric (the
            readout is what the metric reads: an `AtPositions`' rows `(B, vocab)`, else the logits).
        group: None (one process), or a torch.distributed process group whose every rank makes this
            call with the same model, inputs, scores and options: the chunks of rows are shared over
            the ranks, every rank gets every chunk's readouts and computes the same curve (with
            `seed=None`, rank 0's draw).

    Returns `{"fractions", "edges_kept", "faithfulness", "cpr", "cmd", "metric_kept", "metric_clean",
    "metric_corrupted"}` (and `"cpr_interval"`, `"cmd_interval"` with `bootstrap=n`).
    """
    check_group(group)
    ranks = Ranks(group, "faithfulness_curve")

    def setup():
        fr = _fractions(fractions)
        n = check_int("bootstrap", bootstrap, 0, "resamples")
        # seed=None: a fresh draw each call, as tasks' seed=None
        if seed is not None and not is_int(seed):
            raise TypeError(f"seed must be an int or None (the resampling's seed); received {seed!r} "
                            f"({type(seed).__name__})")
        if n and not callable(per_row):
            raise ValueError("bootstrap resamples prompts through per_row(readout) -> (B,), each row's value of "
                             "the metric; give per_row=")
        em = EdgeModel.of(model)
        a, b = read_pair(em, clean, corrupted, metric)
        order = ranked(em.graph, scores)
        sizes = [max(1, round(p * len(order))) for p in fr]
        masks = [keep_mask(em.graph, order[:k]) for k in sizes]
        return fr, n, em, a, b, sizes, masks, check_batch_size(batch_size), Readout(em, metric, a.ids.shape[1])
    fr, n_boot, em, a, b, sizes, masks, size, readout = ranks.run(setup, lambda r: fingerprint(
        model, clean, corrupted, r[6], f"{r[0]} {r[1]} {seed} {r[7]}"))
    # every rank resamples with one seed: rank 0's draw where none was given
    seed_ = int(seed) if seed is not None else ranks.settle(None, torch.Generator().seed())[0]
    with held(model):
        kept, (none, full) = patched_logits(em, a, b, readout, masks, "corrupted", None, size, ends=True, ranks=ranks)
        return ranks.run(lambda: _curve(readout, kept, none, full, fr, sizes, per_row, n_boot, seed_))


def _curve(readout, kept, none, full, fr, sizes, per_row, bootstrap: int, seed: int) -> dict:
    """The curve's dict from the readouts of the corrupted, the clean and the patched runs."""
    m_none, m_all = scalar(readout.value(none), "on corrupted"), scalar(readout.value(full), "on clean")
    if m_all == m_none:
        raise ValueError(f"the metric is {m_all} on clean and on corrupted; faithfulness divides by their gap")
    m_kept = [scalar(readout.value(k), f"with the top {n} edges") for k, n in zip(kept, sizes)]
    faith = [(m - m_none) / (m_all - m_none) for m in m_kept]
    cpr, cmd = areas(fr, faith)
    out = {"fractions": fr, "edges_kept": sizes, "faithfulness": faith, "cpr": cpr, "cmd": cmd,
           "metric_kept": m_kept, "metric_clean": m_all, "metric_corrupted": m_none}
    if bootstrap:
        out.update(_bootstrap(per_row, kept, none, full, fr, bootstrap, seed))
    return out
