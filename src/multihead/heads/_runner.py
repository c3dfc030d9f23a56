"""The generic part of every scan: units of work (each a chunk of variants that one forward
carries, or a self-check forward), run in order in one process or shared across the ranks of
a process group (whole units each, every rank getting every result), with progress counted
in variants and an ETA from each unit's cost; and the `(layers, heads)` table they fill.

A scan is a specialisation: it says what its units are, what one forward of a unit does
(the setter of its kind of patch, on the shared machinery of `_batch`, `_prefix` and
`_budget`) and what a unit costs; `patch_scan` and `path_patch_scan` are two."""

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


def table(widths: Sequence[int], cells: Iterable[tuple[tuple[int, int], float]]) -> Tensor:
    """`(layers, max(widths))` float32 with cell (layer, head) set to its value; NaN where a
    layer has fewer heads than the widest, or no value came."""
    out = torch.full((len(widths), max(widths)), math.nan)
    for (layer, h), value in cells:
        out[layer, h] = value
    return out
