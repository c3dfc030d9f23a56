"""What `edge_patch`, `edge_scores` and `faithfulness_curve` share: input checks, chunks of rows,
the model's state kept as it was, and the reference runs (corrupted, or the mean over inputs)."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.heads._edge_model import EdgeModel
from multihead.heads._edge_run import Readout, Reference, Run, group_slices
from multihead.heads.metrics import AtPositions

BUDGET = 1 << 30  # bytes a chunk of rows may hold (its stacks of sender outputs and, for scores, its graph)
# keywords refused when set (None, and use_cache=False, say what the edge forward does anyway)
REFUSED = {"past_key_values": "a cache would skip the positions the edges run through",
           "use_cache": "the edge forward keeps no cache"}


@dataclass
class Inputs:
    """Token ids `(B, T)` and the padding mask `(B, T)` (None: no padding)."""

    ids: Tensor
    mask: Tensor | None

    def rows(self, sl: slice) -> Inputs:
        return Inputs(self.ids[sl], None if self.mask is None else self.mask[sl])

    def __len__(self) -> int:
        return self.ids.shape[0]


def read_inputs(inputs, name: str, device) -> Inputs:
    """`(B, T)` ids or `{"input_ids", "attention_mask"}`; errors name what was received and what is valid."""
    mask = None
    if isinstance(inputs, Mapping):
        for key in inputs:
            if key in REFUSED and inputs[key] is not None and inputs[key] is not False:
                raise ValueError(f"{name} holds {key!r} ({type(inputs[key]).__name__}): {REFUSED[key]}; pass "
                                 "input_ids and attention_mask only")
        extra = sorted(set(inputs) - {"input_ids", "attention_mask"} - set(REFUSED))
        if extra or "input_ids" not in inputs:
            raise ValueError(f"{name} takes input_ids and attention_mask; received keys {sorted(inputs)}")
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    else:
        ids = inputs
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a (B, T) tensor of token ids or a dict with input_ids; received "
                        f"{type(ids).__name__}")
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be (B, T) integer token ids; received shape {tuple(ids.shape)} of {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(ids.shape)}); give at least one row of one token")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.shape != ids.shape:
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"{name}'s attention_mask must have the ids' shape {tuple(ids.shape)}; received {got}")
        mask = mask.to(device).bool()
        mask = None if bool(mask.all()) else mask
    return Inputs(ids.to(device).long(), mask)


def check_ids(em: EdgeModel, x: Inputs, name: str) -> None:
    """Token ids inside the embedding, and no more positions than the model reads (GPT-2's learned ones,
    a LabTransformer's max_len)."""
    vocab = em.unembed.shape[0]
    lo, hi = int(x.ids.min()), int(x.ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{name} holds token ids outside [0, {vocab}) (min {lo}, max {hi})")
    T = x.ids.shape[1]
    if em.max_positions is not None and T > em.max_positions:
        raise ValueError(f"{name} has {T} positions; this model reads at most {em.max_positions} (GPT-2's learned "
                         f"position embeddings, a LabTransformer's max_len): give at most {em.max_positions} tokens "
                         "per row")


def read_pair(em: EdgeModel, clean, corrupted, metric) -> tuple[Inputs, Inputs | None]:
    a = read_inputs(clean, "clean", em.device)
    b = None if corrupted is None else read_inputs(corrupted, "corrupted", em.device)
    if b is not None and b.ids.shape != a.ids.shape:
        raise ValueError(f"clean {tuple(a.ids.shape)} and corrupted {tuple(b.ids.shape)} must have the same shape "
                         "(B, T): each edge's corrupted output stands at the same row and position")
    if not callable(metric):
        raise TypeError(f"metric must be callable(logits) -> scalar; received {type(metric).__name__}")
    if isinstance(metric, AtPositions) and len(metric.positions) != len(a):
        raise ValueError(f"the metric reads {len(metric.positions)} rows and clean has {len(a)}; give one position "
                         "per row")
    for x, name in ((a, "clean"), (b, "corrupted")):
        if x is not None:
            check_ids(em, x, name)
    return a, b


def read_reference(em: EdgeModel, reference) -> Inputs:
    """The inputs a mean ablation averages over: checked as clean is, with at least one real position."""
    ref = read_inputs(reference, "reference", em.device)
    check_ids(em, ref, "reference")
    if ref.mask is not None and not bool(ref.mask.any()):
        raise ValueError("reference's attention_mask marks every position as padding; a mean ablation averages "
                         "over real positions: give at least one")
    return ref


def check_int(name: str, value, minimum: int, what: str) -> int:
    """An int (a Python or NumPy integer, never a bool) of at least `minimum`: TypeError for another type,
    ValueError below it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum} ({what}); received {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} ({what}); received {value!r}")
    return int(value)


def check_batch_size(batch_size) -> int | None:
    if batch_size is None:
        return None
    return check_int("batch_size", batch_size, 1, "rows per chunk, or None")


def rows_per_chunk(em: EdgeModel, T: int, batch_size: int | None, grad: bool) -> int:
    """Rows per chunk: what keeps a chunk's stacks (and, for a gradient, its graph) under BUDGET."""
    if batch_size is not None:
        return batch_size
    g, C = em.graph, em.unembed.shape[1]
    per_row = T * C * 2 * len(g.senders)
    if grad:
        per_row += T * C * g.n_layers * (4 * g.per_layer + 16) + 4 * T * T * g.n_heads * g.n_layers
    per_row += em.unembed.shape[0] * (T if grad else 1)
    return max(1, BUDGET // (per_row * em.unembed.element_size()))


def chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


@contextmanager
def held(model):
    """The model in eval mode with its parameters' gradients off for the call; both as they were after it,
    also when the call raises (the edge forward computes gradients for its receivers' copies only)."""
    modes = [(m, m.training) for m in model.modules()]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        model.eval()
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        for p, flag in flags:
            p.requires_grad_(flag)


def reference_run(em: EdgeModel, x: Inputs, readout: Readout, rows: slice) -> tuple[Reference, Tensor]:
    """The corrupted run of one chunk: its senders' outputs, the residual each group read, its readout."""
    run = Run(em, x.mask, x.ids.shape[1], record=True)
    final = run.forward(em.embed(x.ids, torch.arange(x.ids.shape[1], device=x.ids.device)))
    return Reference(run.stack, run.resid), readout.logits(final, rows)


def mean_reference(em: EdgeModel, reference: Inputs, batch_size: int | None) -> Reference:
    """Every sender's mean output over the reference rows and their real positions, and the
    residuals those means sum to at each receiver group (`(1, 1, C)` each)."""
    T = reference.ids.shape[1]
    total, count = None, 0
    for sl in chunks(len(reference), rows_per_chunk(em, T, batch_size, False)):
        x = reference.rows(sl)
        run = Run(em, x.mask, T, record=True)
        run.forward(em.embed(x.ids, torch.arange(T, device=x.ids.device)))
        w = torch.ones(x.ids.shape, dtype=em.dtype, device=em.device) if x.mask is None else x.mask.to(em.dtype)
        part = torch.einsum("sbtc,bt->sc", run.stack, w)
        total = part if total is None else total + part
        count += float(w.sum())
    mean = (total / count)[:, None, None]  # (N_s, 1, 1, C)
    resid, r, g = [], mean[0], em.graph
    for layer, block in enumerate(em.blocks):
        first = g.first_sender(layer)
        resid.append(r)
        r = r + mean[first:first + g.n_heads].sum(0) + (0 if block.bo is None else block.bo)
        if g.mlp:
            resid.append(r)
            r = r + mean[first + g.n_heads]
    resid.append(r)
    assert len(resid) == len(group_slices(em))
    return Reference(mean, resid)
