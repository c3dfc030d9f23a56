"""Process groups, neighbours and the one check every rank runs together.

A distributed call must fail on every rank or on none: a rank that raises while the
others enter a send or a collective leaves them waiting forever. So the public entry
points validate locally, then `agree` all-gathers a small signature of every rank's
input (shapes, dtype, flags) and raises the same error on every rank when one of them
is wrong or when they disagree.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class ProcessGroupError(RuntimeError, ValueError):
    """No usable process group (a RuntimeError, and a ValueError since the group is an argument)."""


def resolve_group(group, what: str):
    """The group to use: `group`, or the default one; a clear error when there is none."""
    if not dist.is_available():
        raise ProcessGroupError(f"{what} needs torch.distributed, which this torch build lacks")
    if group is None:
        if not dist.is_initialized():
            raise ProcessGroupError(
                f"{what} needs a process group: call torch.distributed.init_process_group() first "
                f"(torchrun sets the environment it reads), or pass group=; received group=None "
                f"and no default group is initialised"
            )
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None; received {type(group).__name__}")
    return group


class GroupRef:
    """A weak reference to a process group, for what outlives a call: a module, an autograd
    graph. torch's registry holds every group until `destroy_process_group()`; a strong
    reference kept here would keep the group (and gloo's worker threads) alive past it, to
    the interpreter's exit, where those threads die mid-cleanup (SIGABRT: "terminate called
    without an active exception", seen in 2 of 19 runs of examples/distributed.py)."""

    __slots__ = ("_ref",)

    def __init__(self, group):
        self._ref = weakref.ref(group)

    def get(self):
        group = self._ref()
        if group is None:
            raise ProcessGroupError("the process group this was made with has been destroyed "
                                    "(destroy_process_group()); make it again in the new group")
        return group

    def __deepcopy__(self, memo):
        return self  # the same group, never a copy of it


def check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}; received {layout!r}")


def chunk_ids(rank: int, size: int, layout: str) -> list[int]:
    """Global chunk indices held by `rank`, ascending: [r] of P, or [r, 2P-1-r] of 2P (zigzag)."""
    return [rank] if layout == "contiguous" else [rank, 2 * size - 1 - rank]


def comm_device(group) -> torch.device:
    """Where small control tensors must live for this group's backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device(group, t: Tensor, name: str) -> str | None:
    backend = dist.get_backend(group)
    if backend == "gloo" and t.device.type != "cpu":
        return f"the gloo backend sends CPU tensors; received {name} on {t.device} (use backend 'nccl' for GPUs)"
    if backend == "nccl" and t.device.type != "cuda":
        return f"the nccl backend sends CUDA tensors; received {name} on {t.device} (use backend 'gloo' on CPU)"
    return None


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def layout_code(layout) -> int:
    return LAYOUTS.index(layout) + 1 if layout in LAYOUTS else 0


def float_code(x: float | None) -> int:
    """A float as the int64 of its bits (0 for None), to compare across ranks exactly."""
    return 0 if x is None else int(torch.tensor(float(x), dtype=torch.float64).view(torch.int64))


def tensor_code(t, n_dims: int = 4) -> list[int]:
    """A fixed-length description of an optional tensor: [present, ndim, dtype, *shape[:n_dims]]."""
    if not isinstance(t, Tensor):
        return [0, 0, 0] + [0] * n_dims
    shape = list(t.shape[:n_dims])
    return [1, t.dim(), dtype_code(t.dtype) if t.is_floating_point() else 100 + int(t.dtype == torch.bool),
            *shape, *[0] * (n_dims - len(shape))]


def agree_on(group, what: str, check, width: int, fields: str) -> list[int]:
    """Run this rank's checks, then agree (`agree`) before any rank can raise.

    `check()` raises ValueError/TypeError for this rank's bad input or returns its
    signature, `width` ints. A check that raised on one rank alone while the others went on
    into a collective would leave them waiting (30 min by default) or, worse, pair their
    collectives with the failing rank's next call. Returns the (agreed) signature.
    """
    error, signature = None, [0] * width
    try:
        signature = list(check())
    except (TypeError, ValueError) as e:
        error = e
    assert len(signature) == width, (what, signature)
    agree(group, what, error, signature, fields)
    return signature


def agree(group, what: str, error: str | Exception | None, signature: list[int], fields: str) -> None:
    """Raise the same error on every rank if any rank has `error` or the signatures differ.

    `signature` is a fixed-length list of ints describing this rank's input (named by
    `fields` in the message); ranks must send lists of the same length. A rank with an
    exception as its `error` raises its type (TypeError stays TypeError), the others a
    ValueError naming that rank.
    """
    size = dist.get_world_size(group)
    mine = torch.tensor([1 if error else 0, *signature], dtype=torch.long, device=comm_device(group))
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    rank = dist.get_rank(group)
    bad = [r for r, t in enumerate(every) if int(t[0])]
    if isinstance(error, Exception):
        raise type(error)(f"{what} on rank {rank}: {error}") from error
    if error:
        raise ValueError(f"{what} on rank {rank}: {error}")
    if bad:
        raise ValueError(f"{what}: rank(s) {', '.join(map(str, bad))} received invalid input (see their "
                         f"error); every rank stops")
    sigs = [tuple(int(x) for x in t[1:]) for t in every]
    if any(s != sigs[0] for s in sigs):
        table = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
        raise ValueError(f"{what}: ranks disagree on {fields}: {table}. Every rank must pass its shard "
                         f"of the same sequence, with the same shapes, dtype and options")
