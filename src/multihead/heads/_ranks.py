"""Scans across processes: every rank of a torch.distributed group holds the model, runs a
share of a scan's independent units (a patch scan's chunks of variants, importance's
batches) and ends with the whole table.

Two rules make it safe. The units are shared out by a fixed rule (`split`: every rank
computes the same owners from the same list), and each unit runs exactly the forward it
runs in one process, so the table is the single-process one bit for bit (with the same
kernels: the same device type and thread count, since a matrix product may round
differently on another). And a rank never
raises alone: whatever it raised is held until the next `settle`, a collective every rank
enters, which then raises on every rank (the failing one its own exception, the others a
RuntimeError naming it). A rank that raised while the others waited in a collective would
leave them hanging for the group's timeout (30 minutes by default).

`settle` uses `all_gather_object` (pickle): the payloads are small (tables, per-head
vectors, a signature). Under NCCL it moves them through the current CUDA device, which
each rank must have set (`torch.cuda.set_device`), as torch requires.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def check_group(group) -> None:
    """None (one process) or a torch.distributed ProcessGroup this process belongs to."""
    if group is None:
        return
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None (one process) or a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD after init_process_group); received {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("group does not include this process (torch.distributed.get_rank(group) is -1); valid: "
                         "a group this rank is a member of")


def split(costs: Sequence[float], size: int) -> list[int]:
    """The rank that runs each unit: the costliest first, each to the least loaded rank so
    far (ties to the lower rank). The same on every rank: it reads only `costs`."""
    load = [0.0] * size
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def fingerprint(model: nn.Module, *inputs) -> str:
    """A cheap digest of the inputs and of the model's parameter shapes and end values: ranks
    that hold different weights (a random init with another seed) or inputs are told so."""
    h = hashlib.blake2b(digest_size=8)

    def feed(x):
        if isinstance(x, Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif hasattr(x, "keys") and hasattr(x, "__getitem__"):
            for k in sorted(x.keys()):
                h.update(str(k).encode())
                feed(x[k])
        elif isinstance(x, (tuple, list)):
            for t in x:
                feed(t)
        else:
            h.update(repr(x).encode())

    for x in inputs:
        feed(x)
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        feed(name)
        feed(torch.cat([flat[:16], flat[-16:]]))
    return h.hexdigest()


class Ranks:
    """One call's view of `group` (None: one process, nothing shared, errors raised where they
    happen)."""

    def __init__(self, group, name: str):
        self.group, self.name = group, name
        if group is None:
            self.rank, self.size = 0, 1
        else:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def settle(self, error: BaseException | None, payload=None, signature=()) -> list:
        """Every rank's payload, by rank; raises on every rank if any rank has an `error` or
        the signatures (any picklable value that every rank must agree on) differ."""
        if self.group is None:
            if error is not None:
                raise error
            return [payload]
        import torch.distributed as dist

        mine = (None if error is None else f"{type(error).__name__}: {error}", signature, payload)
        every: list = [None] * self.size
        dist.all_gather_object(every, mine, group=self.group)
        failed = [(r, msg) for r, (msg, _, _) in enumerate(every) if msg is not None]
        if error is not None:
            error.add_note(f"{self.name}: raised on rank {self.rank} of {self.size}; every rank stops")
            raise error
        if failed:
            told = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            raise RuntimeError(f"{self.name}: rank(s) {', '.join(str(r) for r, _ in failed)} of {self.size} raised "
                               f"({told}); every rank stops")
        sigs = [s for _, s, _ in every]
        if any(s != sigs[0] for s in sigs):
            table = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
            raise ValueError(f"{self.name}: the ranks disagree on {table}; valid: every rank passes the same model "
                             f"(weights), inputs and options")
        return [p for _, _, p in every]

    def run(self, fn: Callable[[], object], signature: Callable[[object], object] = lambda result: ()):
        """fn() on this rank, then `settle` on `signature(result)`: its result, or the raise on every rank."""
        if self.group is None:
            return fn()
        result, error = None, None
        try:
            result = fn()
        except Exception as e:  # held for settle: every rank raises together
            error = e
        self.settle(error, None, () if error is not None else signature(result))
        return result

    def map(self, fn: Callable, units: Sequence, costs: Sequence[float] | None = None) -> list:
        """[fn(unit) for unit in units] with each unit run on one rank (`split` by `costs`), every
        result on every rank."""
        if self.group is None:
            return [fn(u) for u in units]
        owner = split([1.0] * len(units) if costs is None else costs, self.size)
        done: dict[int, object] = {}
        error = None
        try:
            for i, u in enumerate(units):
                if owner[i] == self.rank:
                    done[i] = fn(u)
        except Exception as e:  # held for settle: every rank raises together
            error = e
        merged: dict[int, object] = {}
        for part in self.settle(error, done, len(units)):
            merged.update(part)
        return [merged[i] for i in range(len(units))]
