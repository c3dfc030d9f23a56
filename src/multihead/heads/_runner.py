"""The generic part of every scan: units of work (each a chunk of variants that one forward
carries, or a self-check forward), run in order in one process or shared across the ranks of
a process group (whole units each, every rank getting every result), with progress counted
in variants and an ETA from each unit's cost; and the `(layers, heads)` table they fill.

A scan is a specialisation: it says what its units are, what one forward of a unit does
(the setter of its kind of patch, on the shared machinery of `_batch`, `_prefix` and
`_budget`) and what a unit costs; `patch_scan`, `path_patch_scan` and `attribution_scan` (its
two halves as two units) are three. The edge tools share prompts instead (`run_rows`): their
units are chunks of rows, each rank runs whole chunks, and the caller combines the chunks'
results in order, as one process does."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from multihead.heads._ranks import Ranks
from multihead.heads.progress import ScanProgress


def run_units(ranks: Ranks, units: Sequence, costs: Sequence[float], work: Callable[[object], list],
              progress, label: str, note: Callable[[], str] | None = None,
              checks: Sequence[tuple[Callable[[], str], float]] = (), size: Callable[[object], int] = len
              ) -> tuple[list, bool]:
    """([work(unit) for unit in units], whether a check failed).

    `units`: each a chunk of `size(unit)` variants (progress counts them); `costs`: each unit's cost, in
    any one unit (the ranks' shares and the ETA read them). `note`: the line progress shows
    first. `checks`: (check, cost) pairs run first as units of their own, each on one rank
    while the others start on the units: a check returns "" or why it failed."""
    shown = ScanProgress(progress, sum(size(u) for u in units), list(costs), label)
    if shown.draw and note is not None:
        shown.note(note())

    def one(item):
        kind, x, cost = item
        if kind == "check":
            return x()
        values = work(x)
        shown.step(size(x), cost)
        return values
    items = [("check", c, cost) for c, cost in checks] + [("unit", u, c) for u, c in zip(units, costs)]
    try:
        results = ranks.map(one, items, [item[2] for item in items])
    finally:
        shown.close()
    return results[len(checks):], any(results[:len(checks)])


def to_device(x, device: torch.device):
    """Every tensor in nested lists, tuples and dicts moved to `device` (what crosses ranks travels on the
    CPU: a pickled CUDA tensor would unpickle on the sender's device)."""
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


def row_chunks(n: int, size: int, ranks: Ranks) -> list[slice]:
    """Rows 0..n in chunks of at most `size`, smaller where that leaves a rank without a chunk."""
    if ranks.size > 1:
        size = min(size, -(-n // ranks.size))
    return [slice(start, min(n, start + size)) for start in range(0, n, size)]


def run_rows(ranks: Ranks, rows: Sequence[slice], work: Callable[[slice], object], label: str,
             device: torch.device) -> list:
    """[work(rows) for rows in `rows`], each chunk run on one rank and every result on every rank
    (on `device`): a chunk's result is what one process computes for those rows, so a caller that
    combines them in order gets the single-process answer whatever the number of ranks."""
    def one(sl: slice):
        got = work(sl)
        return got if ranks.group is None else to_device(got, torch.device("cpu"))
    done, _ = run_units(ranks, rows, [float(sl.stop - sl.start) for sl in rows], one, None, label,
                        size=lambda sl: sl.stop - sl.start)
    return done if ranks.group is None else to_device(done, device)


def table(widths: Sequence[int], cells: Iterable[tuple[tuple[int, int], float]]) -> Tensor:
    """`(layers, max(widths))` float32 with cell (layer, head) set to its value; NaN where a
    layer has fewer heads than the widest, or no value came."""
    out = torch.full((len(widths), max(widths)), math.nan)
    for (layer, h), value in cells:
        out[layer, h] = value
    return out
