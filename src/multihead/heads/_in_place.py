"""GPT-2's tanh GELU in place, inside the head tools' own forwards.

transformers' `NewGELUActivation` (activation "gelu_new": GPT-2, GPT-J, GPT-Neo, CodeGen,
Phi-1/2) is eight tensor ops, each writing a fresh `(rows, T, 4C)` tensor, which at a
scan's batch sizes glibc maps afresh and the kernel zero-fills page by page (measured in
docs/heads.md). The in-place form writes one, and over an input larger than half the L2
runs its passes chunk by chunk, so that each chunk stays in L2 across them. It is the
model's arithmetic exactly: the same ops on the same values in the same order, save the
operands of a product or a sum swapped (exact in IEEE arithmetic), so its output is
bitwise the model's. It runs only where nothing differentiates and only in a thread
inside `in_place_activations` (another thread's forward, or one after the block, runs the
model's own code): the module gets an instance `forward` for the block, removed when the
last block using it ends, also on errors; a module whose `forward` was already replaced on
the instance is left as it is.
"""

from __future__ import annotations

import math
import sys
import threading
from contextlib import contextmanager

import torch
from torch import Tensor, nn

# the switch (benchmarks and tests compare with and without)
IN_PLACE = True

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_LOCK = threading.Lock()
_THREADS: dict[int, int] = {}  # thread id -> how many in-place blocks it is inside
_USERS: dict[int, int] = {}  # id(module) -> how many in-place blocks hold its forward


def _new_gelu_into(x: Tensor, a: Tensor) -> Tensor:
    """NewGELUActivation's ops on `x`, written into `a` (x's shape), in the model's order."""
    torch.pow(x, 3.0, out=a)
    a.mul_(0.044715)
    a.add_(x)
    a.mul_(_SQRT_2_OVER_PI)
    a.tanh_()
    a.add_(1.0)
    return a.mul_(x * 0.5)


def _chunk_elements(x: Tensor) -> int | None:
    """Elements of `x` per chunk, so that a chunk of x and one of the output fill half of this
    machine's L2 (`kernels.machine_plan`; a power of two, a multiple of any vector width);
    None where one pass over `x` fits there already or `x` is not contiguous."""
    from multihead.kernels.machine import machine_plan

    k = 1 << max(10, (machine_plan().l2_bytes // (4 * x.element_size())).bit_length() - 1)
    return k if x.is_contiguous() and x.numel() > 2 * k else None


def new_gelu_in_place(x: Tensor) -> Tensor:
    """`0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))`, as transformers'
    NewGELUActivation computes it, into one fresh tensor instead of eight; `x` is only read.
    Its seven passes run chunk by chunk where `x` is larger than half the L2: a scan's
    `(rows, T, 4C)` is tens of MiB, and each pass then reads and writes memory; a chunk
    stays in L2 across the seven (docs/heads.md gives the time saved).
    Each element goes through the same ops either way: bitwise the model's output, at any
    thread count (tests/test_heads_in_place.py)."""
    out = torch.empty_like(x)
    k = _chunk_elements(x)
    if k is None:
        return _new_gelu_into(x, out)
    flat, into = x.view(-1), out.view(-1)
    for i in range(0, flat.numel(), k):
        _new_gelu_into(flat[i:i + k], into[i:i + k])
    return out


class _InPlaceForward:
    """The instance forward of a NewGELUActivation inside `in_place_activations`."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        if (len(args) == 1 and not kwargs and isinstance(x := args[0], Tensor) and x.is_floating_point()
                and threading.get_ident() in _THREADS and not torch.is_grad_enabled()):
            return new_gelu_in_place(x)
        return type(self.module).forward(self.module, *args, **kwargs)


def _new_gelu_class():
    acts = sys.modules.get("transformers.activations")  # not loaded: no model of it exists
    return getattr(acts, "NewGELUActivation", None) if acts is not None else None


@contextmanager
def in_place_activations(model: nn.Module):
    """Within the block, the calling thread's no-grad forwards of `model` run its
    NewGELUActivation modules in place (bitwise the same outputs); nothing otherwise."""
    cls = _new_gelu_class()
    mods = [m for m in model.modules() if type(m) is cls] if IN_PLACE and cls is not None else []
    if not mods:
        yield
        return
    me = threading.get_ident()
    held: list[nn.Module] = []
    with _LOCK:
        for m in mods:
            own = vars(m).get("forward")
            if own is None:
                vars(m)["forward"] = _InPlaceForward(m)
            elif not isinstance(own, _InPlaceForward):
                continue  # replaced by someone else: theirs runs
            _USERS[id(m)] = _USERS.get(id(m), 0) + 1
            held.append(m)
        _THREADS[me] = _THREADS.get(me, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _THREADS[me] -= 1
            if not _THREADS[me]:
                del _THREADS[me]
            for m in held:
                _USERS[id(m)] -= 1
                if not _USERS[id(m)]:
                    del _USERS[id(m)]
                    if isinstance(vars(m).get("forward"), _InPlaceForward):
                        del vars(m)["forward"]
