"""Edge attribution: EAP (Syed et al., 2023) and EAP-IG (Hanna et al., 2024, "Have Faith in Faithfulness").

EAP's score of edge u -> r is the sum over rows and positions of (u's output on corrupted -
u's output on clean) . dm/dx_r on clean, where x_r is receiver r's own copy of the residual
stream: a first-order estimate of what patching that one edge to corrupted does to the
metric. EAP-IG averages dm/dx_r over `steps` runs whose input embeddings are interpolated
from corrupted to clean (alpha = k / steps, k = 1..steps; `steps=1` is EAP). One backward
per step gives every receiver's gradient (each copy's own, through its norm and its slice
of the projection); the scores of a receiver group are one matmul of the stacked sender
differences with those gradients, done as the backward reaches the group.

The metric may read the whole batch (a mean over rows): when the rows do not fit one
chunk, a first pass without gradients computes every step's logits and dm/dlogits, and
each chunk's backward starts from its rows of that gradient.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from multihead.heads._edge_common import (
    Inputs,
    check_batch_size,
    check_int,
    held,
    read_pair,
    reference_run,
    rows_per_chunk,
)
from multihead.heads._edge_model import EdgeModel
from multihead.heads._edge_run import Readout, Run, group_slices, scalar
from multihead.heads._ranks import Ranks, check_group, fingerprint
from multihead.heads._runner import row_chunks, run_rows
from multihead.heads.edge_graph import Graph, edge_name, parse_edge

METHODS = ("eap", "eap-ig")


class EdgeScores(Mapping):
    """edge -> score, for every edge of the graph (keys: `(sender, receiver)` pairs; names work too).

    `top(k)`: the k edges of largest |score|, as `[(edge, score)]`; `to_json()`: a JSON-ready dict
    with the names (`"a0.h1->a2.h0<q>"`); `matrix`: `(receivers, senders)` float64, each receiver's
    prefix of senders filled (see `multihead.heads.edge_graph.Graph`).
    """

    def __init__(self, graph: Graph, matrix: Tensor, method: str, steps: int):
        self.graph, self.matrix, self.method, self.steps = graph, matrix, method, steps

    def __getitem__(self, edge) -> float:
        try:
            where = self.graph.edge_index.get(parse_edge(edge))
        except (TypeError, ValueError) as err:  # not an edge at all: a missing key, as a mapping says it
            raise KeyError(f"{edge!r:.80}: {err}") from None
        if where is None:
            raise KeyError(edge)
        return float(self.matrix[where])

    def __iter__(self):
        return iter(self.graph.edges)

    def __len__(self) -> int:
        return len(self.graph)

    def __repr__(self) -> str:
        return f"EdgeScores({self.method}, steps={self.steps}, {len(self)} edges)"

    def vector(self) -> Tensor:
        """The scores in `graph.edges` order `(E,)`."""
        rows = torch.repeat_interleave(torch.arange(len(self.graph.receivers)), torch.tensor(self.graph.prefix))
        cols = torch.cat([torch.arange(n) for n in self.graph.prefix])
        return self.matrix[rows, cols]

    def top(self, k: int) -> list[tuple[tuple, float]]:
        k = check_int("k", k, 0, "how many edges")
        v = self.vector()
        order = torch.argsort(v.abs(), descending=True, stable=True)[:k]
        return [(self.graph.edges[i], float(v[i])) for i in order.tolist()]

    def to_json(self) -> dict:
        g = self.graph
        return {"method": self.method, "steps": self.steps,
                "graph": {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads, "mlp": g.mlp},
                "scores": {edge_name(e): s for e, s in zip(g.edges, self.vector().tolist())}}


def _check(method, steps) -> int:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; received {method!r}")
    if method == "eap":
        return 1
    return check_int("steps", steps, 1, "EAP-IG's interpolation steps")


def _embeddings(em: EdgeModel, clean: Inputs, corrupted: Inputs, steps: int, k: int) -> Tensor:
    """The input embedding of step k: corrupted + (k / steps) (clean - corrupted); clean itself at k = steps."""
    pos = torch.arange(clean.ids.shape[1], device=clean.ids.device)
    e = em.embed(clean.ids, pos)
    if k == steps:
        return e
    c = em.embed(corrupted.ids, pos)
    return c + (k / steps) * (e - c)


def _metric_grads(ranks, em, clean, corrupted, readout, steps, rows) -> list[Tensor]:
    """dm/dlogits of each step `[(B, ...)]`, from a pass without gradients over all chunks (shared
    over `ranks`); the metric reads the whole batch on every rank."""
    @torch.no_grad()
    def readouts(sl: slice) -> list[Tensor]:
        x, xc = clean.rows(sl), corrupted.rows(sl)
        return [readout.logits(Run(em, x.mask, x.ids.shape[1]).forward(_embeddings(em, x, xc, steps, k)), sl)
                for k in range(1, steps + 1)]
    done = run_rows(ranks, rows, readouts, ranks.name, em.device)

    def grads() -> list[Tensor]:
        out = []
        for k in range(1, steps + 1):
            logits = torch.cat([part[k - 1] for part in done]).requires_grad_(True)
            with torch.enable_grad():
                m = scalar(readout.value(logits), f"at step {k} of {steps}", grad=True)
                (g,) = torch.autograd.grad(m, logits)
            out.append(g)
        return out
    return ranks.run(grads)


def _chunk_scores(em, clean, corrupted, readout, steps, sl, grads) -> Tensor:
    """One chunk's sum over steps of D . dm/dx_r (float64, `(N_r, N_s)`)."""
    g = em.graph
    scores = torch.zeros(len(g.receivers), len(g.senders), dtype=torch.float64, device=em.device)
    x, xc = clean.rows(sl), corrupted.rows(sl)
    T = x.ids.shape[1]
    with torch.no_grad():
        ref, _ = reference_run(em, xc, readout, sl)
    diff = ref.out  # corrupted outputs now; minus clean once the clean run has recorded
    slices = group_slices(em)

    def hook(group: int, copies: Tensor) -> None:
        r0, n, p = slices[group]

        def add(grad: Tensor) -> None:
            scores[r0:r0 + n, :p] += (grad.flatten(1) @ diff[:p].flatten(1).t()).double()
        copies.register_hook(add)

    for k in range(steps, 0, -1):  # clean first: its recorded outputs make the differences
        run = Run(em, x.mask, T, record=k == steps, hook=hook)
        with torch.no_grad():
            emb = _embeddings(em, x, xc, steps, k)
        with torch.enable_grad():
            final = run.forward(emb.requires_grad_(True))
            if k == steps:
                diff = diff - run.stack
            logits = readout.logits(final, sl)
            if grads is None:
                m = scalar(readout.value(logits), f"at step {k} of {steps}", grad=True)
                m.backward()
            else:
                logits.backward(grads[k - 1][sl])
    return scores


def edge_scores(model, clean, corrupted, metric, method: str = "eap-ig", steps: int = 5, *,
                batch_size: int | None = None, group=None) -> EdgeScores:
    """EAP or EAP-IG scores of every edge of the model's graph (see the module's docstring).

    Args:
        model: a transformers decoder LM (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, GPT-2) or multihead's
            `LabTransformer` (MHA, GQA, MQA or MLA; attention-only too).
        clean, corrupted: `(B, T)` ids or `{"input_ids", "attention_mask"}`, the same shape.
        metric: `callable(logits) -> 0-d tensor`, differentiable; an `AtPositions` gets the logits
            at its positions only.
        method: "eap" or "eap-ig"; steps: EAP-IG's interpolation steps (`steps=1` equals EAP).
        batch_size: rows per chunk (None: what keeps a chunk's graph near 1 GiB).
        group: None (one process), or a torch.distributed process group whose every rank makes this
            call with the same model, inputs and options. The chunks of rows (prompts) are shared
            over the ranks, smaller where that leaves a rank without one; the metric reads the whole
            batch on every rank (every chunk's readouts are gathered first, as one process does when
            the rows take several chunks), and the scores are the chunks' sums added in order. With
            the same chunks (`batch_size=` at most B / ranks) they are bitwise one process's; else
            equal up to rounding. An error on any rank raises on every rank.
    """
    check_group(group)
    ranks = Ranks(group, "edge_scores")

    def setup():
        n = _check(method, steps)
        em = EdgeModel.of(model)
        a, b = read_pair(em, clean, corrupted, metric)
        size = rows_per_chunk(em, a.ids.shape[1], check_batch_size(batch_size), True)
        return n, em, a, b, row_chunks(len(a), size, ranks), Readout(em, metric, a.ids.shape[1])
    n_steps, em, a, b, rows, readout = ranks.run(setup, lambda r: fingerprint(
        model, clean, corrupted, f"{method} {r[0]} {[(sl.start, sl.stop) for sl in r[4]]}"))
    g = em.graph
    with held(model):
        grads = None if len(rows) == 1 else _metric_grads(ranks, em, a, b, readout, n_steps, rows)
        parts = run_rows(ranks, rows, lambda sl: _chunk_scores(em, a, b, readout, n_steps, sl, grads),
                         ranks.name, em.device)
    scores = torch.zeros(len(g.receivers), len(g.senders), dtype=torch.float64, device=em.device)
    for part in parts:  # in the rows' order, whichever rank ran them
        scores += part
    bad = int((~torch.isfinite(scores)).sum())
    if bad:  # a NaN or inf score orders nothing, and to_json would write what JSON cannot read
        raise ValueError(f"{bad} of {len(g)} edge scores are not finite: the metric or its gradient overflowed in "
                         f"the model's {em.dtype}; valid: a model whose forward and backward stay finite (float32 "
                         "or bfloat16 for a float16 one)")
    return EdgeScores(g, (scores / n_steps).cpu(), method, n_steps)
