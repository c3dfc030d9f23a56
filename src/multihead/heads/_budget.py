"""How much one scan forward carries: the memory a row of it takes, the variants a forward
holds within the budget, the output head's cost, and which logits it computes (an
`AtPositions` metric's positions only, through transformers' `logits_to_keep`). Shared by
`patch_scan` and `path_patch_scan`."""

from __future__ import annotations

import math

from torch import Tensor, nn

from multihead.heads.engine import forward_takes, is_hf
from multihead.heads.metrics import AtPositions

# The default bound on a scan forward's rows (variants x B): bigger batches cost more per row
# here, and memory grows with them
ROWS_PER_RUN = 16
# ... unless its rows are short: then up to this many row-positions, for a forward of a few
# positions a row is mostly per-call overhead and small matrix products
POSITIONS_PER_RUN = 2048
# The automatic bound on one scan forward's memory (its logits and activations; what the
# scan holds for the whole call, the clean and corrupted runs' per-layer tensors, is apart)
MEMORY_PER_RUN = 1 << 30


def check_memory(max_memory) -> int | None:
    """max_memory: None (the automatic budget) or a number of bytes >= 1 (an int, or a float such as 2e9)."""
    if max_memory is None:
        return None
    valid = f"None (automatic: {MEMORY_PER_RUN / 2**30:.0f} GiB) or a number of bytes >= 1 (e.g. 2e9)"
    if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)):
        raise TypeError(f"max_memory must be {valid}; received {max_memory!r} ({type(max_memory).__name__})")
    if not math.isfinite(max_memory) or max_memory < 1:
        raise ValueError(f"max_memory must be {valid}; received {max_memory!r}")
    return int(max_memory)


def bytes_per_row(vocab: int, itemsize: int, blocks: list[nn.Module], width: int, positions: int,
                  logit_positions: int | None = None) -> int:
    """About what one row (one copy of one input) adds to a scan forward's peak: its logits
    twice (the model's and a metric's working copy, e.g. a log-softmax; at `logit_positions`
    positions when only those are computed, else at all) and a block's activations, about
    two floats per position for every parameter of a block over the model's width (the
    projections' and the MLP's outputs, the residual and its copies)."""
    per_block = sum(p.numel() for b in blocks[:1] for p in b.parameters())
    act = 2 * per_block // max(1, width) + 4 * width
    head = positions if logit_positions is None else logit_positions
    return itemsize * (positions * act + head * 2 * vocab)


def model_width(model: nn.Module, default: int) -> int:
    """The model's hidden width: its input embeddings' columns, else `default`."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = getattr(get() if callable(get) else None, "weight", None)
    except NotImplementedError:
        emb = None
    return emb.shape[1] if isinstance(emb, Tensor) and emb.dim() == 2 else default


def variants_per_forward(per_row: int, B: int, max_memory: int | None, positions: int = 0) -> tuple[int, int]:
    """(variants per forward, the budget in bytes): as many as `max_memory` (or the
    automatic budget) holds, at least one, and without a budget given at most ROWS_PER_RUN
    rows (bigger batches cost more per row), or POSITIONS_PER_RUN row-positions when rows
    of `positions` positions are short enough for more."""
    budget = MEMORY_PER_RUN if max_memory is None else max_memory
    n = max(1, budget // max(1, per_row * B))
    rows = max(ROWS_PER_RUN, POSITIONS_PER_RUN // positions if positions > 0 else 0)
    return (min(n, max(1, rows // B)) if max_memory is None else n), budget


def head_cost(model: nn.Module, blocks: list[nn.Module]) -> float:
    """The output head's cost per position in blocks: its weight's size over a block's
    parameters (both are matrix products over the same positions). 0 when unknown."""
    get = getattr(model, "get_output_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    per_block = sum(p.numel() for b in blocks for p in b.parameters()) / max(1, len(blocks))
    return float(weight.numel()) / per_block if isinstance(weight, Tensor) and per_block else 0.0


def takes_logits_to_keep(model) -> bool:
    """Whether the model is a transformers model whose forward computes its head's logits at
    the positions `logits_to_keep` names only."""
    return is_hf(model) and forward_takes(model, "logits_to_keep")


def keep_positions(model, metric, T: int, B: int) -> dict:
    """{"logits_to_keep": the positions read} for an `AtPositions` metric on a model that
    takes the keyword (T known), else {} (the scan forwards compute every position's logits)."""
    if not isinstance(metric, AtPositions):
        return {}
    if len(metric.positions) != B:
        raise ValueError(f"the metric reads one position for each of {len(metric.positions)} rows; the inputs have "
                         f"{B} rows (valid: an AtPositions made for these inputs)")
    if not T or not takes_logits_to_keep(model):
        return {}
    return {"logits_to_keep": metric.keep(T)}


def read_metric(metric, logits: Tensor, keep: dict, T: int):
    """The metric of logits computed with `keep` (`keep_positions`' keywords): those of the
    kept positions only when it holds them, else every position's."""
    return metric.kept(logits, keep["logits_to_keep"], T) if keep else metric(logits)
