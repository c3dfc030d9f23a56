"""The native band engine: attention under a relative mask (one that depends on q - kv alone:
causal, sliding windows, their intersections) by multihead's own C kernel (`band.c`,
compiled for the machine on first use by `kernels.native`), float32 on the CPU, forward only.

The fused tile engine (`fused_tiles`) hands torch's flash kernel the rectangles of the band a
mask keeps and merges their outputs; the native kernel walks the band itself, one block of
query rows at a time with its accumulators in L1, skipping whole tiles the mask hides and
masking the rest from the mask's values at each q - kv (`planner.shared_differences`). It takes
calls of at least one block of rows (`native.band_rows`, 64 with AVX-512): a decode step
would compute 63 padded rows for its one. Which of the two runs a call is the machine's:
timed on the first call of each dtype, thread count, head width, group size and band width
(the pairs a row may attend, to a power of two), on the call's own last rows
(`_PROBE_ROWS`), and kept for the process (`machine.measured_choices`;
`MachinePlan.band_engine` fixes it). The method and its measurements: docs/benchmarks.md,
"The native band engine".

The kernel also looks at its output's rows for the NaN rule (a row not finite or zero
throughout): where it found none, `attend` skips the sums over q, k, v and out that would
otherwise look for a NaN (`looked_clean`).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

from multihead.kernels import fused_tiles
from multihead.kernels import native as _native
from multihead.kernels.machine import fastest, machine_plan, recalled, remember
from multihead.kernels.planner import shared_differences
from multihead.masks import MaskMod

__all__ = ["applies", "band", "engine", "looked_clean", "run"]

_MAX_D = 256  # each thread's buffers hold Q^T and O^T of one block, (D, rows) each, sized for this D
_PROBE_ROWS = 1024  # the engines are timed on the call's last rows: each row's work as in the call
_CLEAN = threading.local()  # .ref: a weak reference to the last output the kernel found clean


def applies(q: Tensor, k: Tensor, v: Tensor, mask, score_mod, dropout_p: float) -> bool:
    """Whether `band` may run this call: float32 on the CPU, nothing requiring grad, no dropout
    or score mod, a relative MaskMod, at least `native.band_rows()` queries, D = Dv a
    multiple of 4 and at most 256, every last dim contiguous, and the library built
    (`native.library`). (Whether the mask is the same for every batch row and head is
    `band`'s to find.)"""
    if q.dtype is not torch.float32 or not q.is_cpu or dropout_p or score_mod is not None:
        return False
    if not isinstance(mask, MaskMod) or not mask.relative or torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    B, H, T, D = q.shape
    if v.shape[-1] != D or D % 4 or D > _MAX_D or 0 in q.shape or k.shape[2] == 0:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    rows = _native.band_rows()  # None without the library
    return rows is not None and T >= rows


def band(q: Tensor, k: Tensor, v: Tensor, mask: MaskMod, scale: float) -> tuple[Tensor, bool] | None:
    """softmax(q k^T * scale where `mask` allows) v by the C kernel, for a call `applies`
    accepts: (out `(B, H, T, D)`, whether a row of out is not finite or zero throughout), or
    None where the mask differs by batch row or head (its values at each q - kv are then not
    every pair's)."""
    allowed = shared_differences(mask, *q.shape[:3], k.shape[2], q.device)
    return None if allowed is None else _kernel(q, k, v, allowed, scale)


def _kernel(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> tuple[Tensor, bool]:
    B, H, T, D = q.shape
    out = fused_tiles.output((B, H, T, D), q.dtype, q.device)  # warm memory where a dropped output's is free
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    flag = _native.library().mh_band(
        q.data_ptr(), qs[0], qs[1], qs[2], k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1], vs[2],
        B, H, k.shape[1], T, k.shape[2], D, scale, allowed.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if flag < 0:  # `applies` keeps this from happening; a guard, never a wrong answer
        what = "could not allocate its buffers for" if flag == -2 else "refused"
        raise RuntimeError(f"the native band kernel {what} q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out, flag == 1


def engine(q: Tensor, k: Tensor, v: Tensor, mask: MaskMod, scale: float, fused, allowed: Tensor) -> str:
    """"native" or "fused" for a call `applies` accepts whose mask is the same for every head
    (`allowed`, its values at each q - kv): the plan's `band_engine`, else what was timed on
    this process's first call of the same dtype, threads, head width, group size and band
    width, else timed now by `machine.fastest` (each engine in turn; "native" only if it wins
    by its margin) on the call's last `_PROBE_ROWS` query rows (a relative mask is
    bottom-right aligned, so those rows see the keys they see in the call). `fused` runs the
    fused tile engine on (q, k, v)."""
    fixed = machine_plan().band_engine
    if fixed is not None:
        return fixed
    B, H, T, D = q.shape
    width = 1 << (min(int(allowed.sum()), k.shape[2]) - 1).bit_length()  # keys a row may attend, to a power of 2
    case = (f"{str(q.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, D {D}, G {H // k.shape[1]}, "
            f"{width} keys")
    won = recalled("band_engine", case)
    if won is None:
        probe = q[:, :, -_PROBE_ROWS:]
        runs = {"fused": lambda: fused(probe, k, v), "native": lambda: band(probe, k, v, mask, scale)}
        won = fastest(runs, "fused")
        remember("band_engine", case, won)
    return won


def run(q: Tensor, k: Tensor, v: Tensor, mask, scale: float, fused) -> Tensor | None:
    """The native kernel's output where `engine` picks it for this call (the caller checks
    `applies` first), else None: the caller runs `fused` itself. An output the kernel found
    clean is remembered for `looked_clean`."""
    allowed = shared_differences(mask, *q.shape[:3], k.shape[2], q.device)  # every head's, or None
    if allowed is None or engine(q, k, v, mask, scale, fused, allowed) != "native":
        return None
    out, bad = _kernel(q, k, v, allowed, scale)
    _CLEAN.ref = None if bad else weakref.ref(out)
    return out


def looked_clean(out: Tensor) -> bool:
    """Whether `out` is the last output the native kernel made on this thread and it found no
    row of it not finite or zero throughout: then the NaN rule has nothing to do (a NaN in q,
    an attended key or value reaches its row as NaN in this kernel, which never zeroes a
    row; a NaN the mask hides in a tile it skips is never read, and one in a tile it reads
    can only make rows there NaN, which it flags)."""
    ref = getattr(_CLEAN, "ref", None)
    return ref is not None and ref() is out
