"""Exact edge patching: the model on clean inputs with only chosen edges of the graph carrying clean values.

`edge_patch(model, clean, corrupted, metric, keep)` runs the model on clean where every
receiver's input (its own copy of the residual stream) takes, for each of its edges, the
sender's output in this same patched run if the edge is in `keep`, else the sender's
output in the corrupted run (`ablation="mean"`: the sender's mean output over
`reference=` inputs, every row and real position). Keeping every edge gives the clean
metric, keeping none the corrupted one. The graph and its names: `multihead.heads.edge_graph`;
the forward: `multihead.heads._edge_run` (one matmul per receiver group, rows in chunks).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from multihead.heads._edge_common import (
    Inputs,
    check_batch_size,
    held,
    mean_reference,
    read_pair,
    read_reference,
    reference_run,
    rows_per_chunk,
)
from multihead.heads._edge_model import EdgeModel
from multihead.heads._edge_run import Readout, Run, make_plan, scalar
from multihead.heads._ranks import Ranks, check_group, fingerprint
from multihead.heads._runner import row_chunks, run_rows
from multihead.heads.edge_graph import Graph, edge_name, parse_edge

ABLATIONS = ("corrupted", "mean")


def edges(model) -> list[tuple]:
    """Every `(sender, receiver)` edge of the model's graph (see `multihead.heads.edge_graph`)."""
    return list(EdgeModel.of(model).graph.edges)


def keep_mask(graph: Graph, keep) -> Tensor:
    """The kept-edge mask `(N_r, N_s)` of `keep` (edges as pairs or names); errors name unknown edges."""
    if isinstance(keep, Tensor) and keep.dtype == torch.bool:
        want = (len(graph.receivers), len(graph.senders))
        if tuple(keep.shape) != want:
            raise ValueError(f"a keep mask must be (receivers, senders) = {want}; received {tuple(keep.shape)}")
        keep = keep.cpu()
        # receiver r reads only its prefix of senders: a True past it is no edge, as an unknown name is not
        off = keep & (torch.arange(want[1])[None, :] >= torch.tensor(graph.prefix)[:, None])
        if bool(off.any()):
            r, s = off.nonzero()[0].tolist()
            raise ValueError(f"the keep mask marks {int(off.sum())} (receiver, sender) pair(s) that are no edge of "
                             f"this model's graph, e.g. receiver {r} ({graph.receivers[r]!r}) from sender {s} "
                             f"({graph.senders[s]!r}), which runs after it")
        return keep
    if isinstance(keep, (str, bytes)) or not isinstance(keep, Iterable):
        hint = " (wrap one name in a list)" if isinstance(keep, str) else ""
        raise TypeError(f"keep must be a collection of edges ((sender, receiver) pairs or 'sender->receiver' names); "
                        f"received {type(keep).__name__}{hint}")
    if isinstance(keep, tuple) and len(keep) == 2 and _one_edge(graph, keep):
        raise TypeError(f"keep must be a collection of edges; received the one edge {keep!r} (wrap it in a list)")
    mask = torch.zeros(len(graph.receivers), len(graph.senders), dtype=torch.bool)
    unknown = []
    for e in keep:
        try:
            edge = parse_edge(e)
        except (ValueError, TypeError) as err:
            raise type(err)(f"keep: {err}") from None
        where = graph.edge_index.get(edge)
        if where is None:
            unknown.append(e)
            continue
        mask[where] = True
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ValueError(f"keep holds {len(unknown)} edge(s) not in this model's graph ({graph.n_layers} layers, "
                         f"{graph.n_heads} heads, {graph.n_kv_heads} KV heads): {shown}; an edge runs from a sender "
                         f"to a later receiver, e.g. {edge_name(graph.edges[len(graph.edges) // 2])!r}")
    return mask


def _one_edge(graph: Graph, keep: tuple) -> bool:
    """Whether a pair given as `keep` is itself one edge (its items iterated would be nodes, not edges)."""
    try:
        return parse_edge(keep) in graph.edge_index
    except (TypeError, ValueError):
        return False


def patched_logits(em: EdgeModel, clean: Inputs, corrupted: Inputs | None, readout: Readout, masks: list[Tensor],
                   ablation: str, reference: Inputs | None, batch_size: int | None, ends: bool = False,
                   ranks: Ranks | None = None):
    """The readouts of the patched runs, one per mask `[(B, ...)]`, and (`ends`) of the reference run
    (the corrupted inputs, or the means) and of the clean run, all over chunks of rows (shared over
    `ranks`: each chunk's readouts are what one process computes for its rows)."""
    ranks = Ranks(None, "edge_patch") if ranks is None else ranks
    T = clean.ids.shape[1]
    plans, mean = ranks.run(lambda: ([make_plan(em, m) for m in masks],
                                     mean_reference(em, reference, batch_size) if ablation == "mean" else None))

    @torch.no_grad()
    def chunk(sl: slice) -> tuple[list[Tensor], list[Tensor]]:
        x = clean.rows(sl)
        emb = em.embed(x.ids, torch.arange(T, device=x.ids.device))
        if mean is None:
            ref, none = reference_run(em, corrupted.rows(sl), readout, sl)
        else:
            ref, none = mean, None
            if ends:
                nothing = make_plan(em, torch.zeros(len(em.graph.receivers), len(em.graph.senders), dtype=bool))
                none = readout.logits(Run(em, x.mask, T, nothing, ref).forward(emb), sl)
        both = [none, readout.logits(Run(em, x.mask, T).forward(emb), sl)] if ends else []
        return [readout.logits(Run(em, x.mask, T, plan, ref).forward(emb), sl) for plan in plans], both

    rows = row_chunks(len(clean), rows_per_chunk(em, T, batch_size, False), ranks)
    done = run_rows(ranks, rows, chunk, ranks.name, em.device)
    outs = [torch.cat([kept[i] for kept, _ in done]) for i in range(len(plans))]
    return outs, [torch.cat([both[i] for _, both in done]) for i in range(2)] if ends else None


def check_ablation(ablation, corrupted, reference) -> None:
    if ablation not in ABLATIONS:
        raise ValueError(f"ablation must be one of {ABLATIONS}; received {ablation!r}")
    if ablation == "mean" and reference is None:
        raise ValueError("ablation='mean' averages each sender's output over reference= inputs; give reference=")
    if ablation == "corrupted" and corrupted is None:
        raise ValueError("ablation='corrupted' needs the corrupted inputs; received None")


def edge_patch(model, clean, corrupted, metric, keep, ablation: str = "corrupted", *, reference=None,
               batch_size: int | None = None, group=None) -> float:
    """The metric of the model on `clean` with only the edges in `keep` carrying this run's values.

    Args:
        model: a transformers decoder LM (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, GPT-2) or multihead's
            `LabTransformer` (MHA, GQA, MQA or MLA; attention-only too).
        clean, corrupted: `(B, T)` ids or `{"input_ids", "attention_mask"}`, the same shape.
        metric: `callable(logits) -> scalar`; an `AtPositions` gets the logits at its positions only.
        keep: edges (`(sender, receiver)` pairs or `"a0.h1->a2.h0<q>"` names; see `edges(model)`).
        ablation: "corrupted" (the non-kept edges carry the sender's corrupted output) or "mean"
            (its mean output over `reference`'s rows and real positions; `corrupted` is unused).
        batch_size: rows per chunk (None: what keeps a chunk near 1 GiB).
        group: None (one process), or a torch.distributed process group whose every rank makes this
            call with the same model, inputs and options: the chunks of rows are shared over the
            ranks and the metric reads the whole batch on every rank (see `edge_scores`).
    """
    check_group(group)
    ranks = Ranks(group, "edge_patch")

    def setup():
        check_ablation(ablation, corrupted, reference)
        em = EdgeModel.of(model)
        a, b = read_pair(em, clean, corrupted if ablation == "corrupted" else None, metric)
        ref = read_reference(em, reference) if ablation == "mean" else None
        return em, a, b, ref, keep_mask(em.graph, keep), check_batch_size(batch_size), Readout(em, metric,
                                                                                                a.ids.shape[1])
    em, a, b, ref, mask, size, readout = ranks.run(setup, lambda r: fingerprint(
        model, clean, corrupted, reference, r[4], f"{ablation} {r[5]}"))
    with held(model):
        (out,), _ = patched_logits(em, a, b, readout, [mask], ablation, ref, size, ranks=ranks)
        return ranks.run(lambda: scalar(readout.value(out), "on the patched run"))
