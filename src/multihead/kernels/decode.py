"""The plain decode step (a few queries, no mask, score mod, weights or dropout) and its
split over the key axis: flash-decoding (Dao, Haziza, Massa and Sizov, 2023), on the CPU.

torch's CPU flash kernel runs one work item per (batch row, head); with the G query heads
of a K/V head folded into its query length a decode step has B * Hkv items, and when the
threads do not divide them the keys are split into P parts, each part's output and
log-sum-exp from one kernel call on a strided view of K and V, merged exactly by
log-sum-exp (`split_keys`). Taken only where it pays (`key_splits`: the CPU, several
threads, batch 1, few folded query rows, H > Hkv > 1, enough K/V bytes per head, nothing
requiring grad). The method and its measurements: docs/benchmarks-decode.md, "How the
decode split works".

A step whose K/V stream from beyond the L2 has two more engines. `gemm`: the scores as one
batched GEMM with the keys as the tall operand (`(S, D) @ (D, G*T)` per K/V head, the
keys read once, as `common.one_query_shared_keys` does for MLA), the softmax, and the
values as a second GEMM. `native` (float32): multihead's own kernel (`decode_step.c`,
compiled for the machine on first use by `kernels.native`), one pass over each K/V head's
keys with the softmax online and the next keys prefetched, which reads K and V at most of
the memory's streaming rate where torch's kernel and the BLAS compute too long per byte to
hide their reads (docs/benchmarks-decode.md). Which engine is fastest is the machine's:
torch's kernel works through the keys in small blocks with a GEMM call each, which costs
little where the BLAS is fast on small blocks and up to 1.4x on another core. So it is
timed on the first such step of each dtype, thread count, query rows and head width, every
engine that may run it on that step's own inputs, and the winner kept for the process
(`machine.measured_choices`; `MachinePlan.decode_engine` fixes it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.kernels import native as _native
from multihead.kernels.common import HAS_CPU_FLASH, flash_lse, merge_two
from multihead.kernels.machine import fastest, machine_plan, recalled, remember
from multihead.kernels.sdpa import plain

__all__ = ["MIN_SPLIT_BYTES", "engine", "gemm", "gemm_applies", "key_splits", "native", "native_applies",
           "native_checked", "split_bytes", "split_keys", "step"]

# K and V bytes of one K/V head (S * (D + Dv) * element size) from which a step splits; None: the
# machine's (`MachinePlan.min_split_bytes`, one core's L2, and why). An int here overrides it.
MIN_SPLIT_BYTES: int | None = None
# folded query rows up to which torch's kernel makes one work item per head (its smallest
# block of queries): with more, it splits the queries itself and the threads have work
_ONE_BLOCK = 32
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_GEMM_DTYPES = (torch.float32, torch.float64)  # the half types' CPU GEMMs would round the scores


def split_bytes() -> int:
    """The K/V bytes per head from which a step splits: `MIN_SPLIT_BYTES`, else the machine plan's."""
    return machine_plan().min_split_bytes if MIN_SPLIT_BYTES is None else MIN_SPLIT_BYTES


def key_splits(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Parts to split the keys of a plain step into (1: none; see the module docstring): the
    smallest P <= threads that gives the threads equal shares of B * Hkv * P items, or the
    most even shares (fewest items on the busiest thread per part)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if B != 1 or Hkv == 1 or Hkv == H or H // Hkv * T > _ONE_BLOCK or not HAS_CPU_FLASH or not q.is_cpu \
            or S * (D + v.shape[-1]) * q.element_size() < split_bytes():
        return 1
    threads = torch.get_num_threads()
    if threads == 1 or Hkv % threads == 0 or S < threads or q.dtype not in _FLASH_DTYPES or D != v.shape[-1]:
        return 1
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return 1
    if torch.compiler.is_compiling():
        return 1

    def busiest(p: int) -> float:  # the busiest thread's items, in units of one unsplit head
        return -(-Hkv * p // threads) / p

    return min(range(1, threads + 1), key=lambda p: (busiest(p), p))


def split_keys(q: Tensor, k: Tensor, v: Tensor, scale: float, parts: int) -> tuple[Tensor, Tensor]:
    """Attention of q `(1, H, T, D)` over k, v `(1, Hkv, S >= parts, D)` with the keys in
    `parts` parts: (out `(1, H, T, D)`, every part's output `(parts or parts + 1, Hkv, G*T, D)`,
    which the NaN check reads: a kernel that zeroes a part's row, its every score NaN,
    leaves a finite merged row). The parts are a view of K and V whose batch dim is the part.

    2 parts (2 threads): keys [0, c) and [S - c, S), c = ceil(S / 2); for an odd S the key
    both hold is masked out of the second (a -inf from `_overlap_mask`, a view: nothing
    written per step), merged by `common.merge_two` (`torch.lerp` with the second part's weight
    sigmoid(lse_1 - lse_0)): one kernel call and three small ops for every S. More parts:
    equal runs of c = S // parts, the last S - parts * c keys as one more call, merged with
    the parts' weights exp(lse_p - max_p lse_p) / their sum. No softmax: torch's CPU softmax
    wakes the intra-op threads even for a few elements, which costs more than the merge."""
    _, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qf = q.reshape(1, Hkv, H // Hkv * T, D)  # (1, Hkv, G*T, D)
    ks, vs = k.stride(), v.stride()
    c = -(-S // parts) if parts == 2 else S // parts
    step_ = S - c if parts == 2 else c  # where part p starts: p * step_
    kp = k.as_strided((parts, Hkv, c, D), (step_ * ks[2], ks[1], ks[2], ks[3]), k.storage_offset())  # (P, Hkv, c, D)
    vp = v.as_strided((parts, Hkv, c, D), (step_ * vs[2], vs[1], vs[2], vs[3]), v.storage_offset())
    mask = _overlap_mask(c, q.dtype) if parts == 2 and 2 * c > S else None
    out, lse = flash_lse(qf.expand(parts, *qf.shape[1:]), kp, vp, causal=False, scale=scale, mask=mask)
    acc = lse.dtype  # float32, or float64
    if parts == 2:
        o = out if out.dtype == acc else out.to(acc)
        merged = merge_two(o[0], o[1], lse[0], lse[1])  # (Hkv, G*T, D): sub, sigmoid, lerp
    else:
        if parts * c < S:
            o, lp = flash_lse(qf, k[:, :, parts * c:], v[:, :, parts * c:], causal=False, scale=scale)
            out, lse = torch.cat((out, o)), torch.cat((lse, lp))
        # `common.lse_merge`'s math on the parts one kernel call stacked along dim 0: one weighted
        # sum over the stack is 7 ops for any P, pairwise `merge_two`s with a running lse 4 per part
        w = torch.exp(lse - lse.amax(0))  # (P, Hkv, G*T)
        merged = (out * w.unsqueeze(-1)).sum(0) / w.sum(0).unsqueeze(-1)
    if merged.dtype != q.dtype:
        merged = merged.to(q.dtype)
    return merged.view(1, H, T, D), out


_MASKS: dict[torch.dtype, Tensor] = {}


def _overlap_mask(c: int, dtype: torch.dtype) -> Tensor:
    """`(2, 1, 1, c)`: zeros for the first part, -inf on the first key of the second (the key
    the first part holds too), 0 elsewhere. A view of one buffer per dtype, 2N long with
    zeros around a -inf at N (part 0 reads [N - c, N), part 1 [N, N + c)), grown by doubling;
    a step builds nothing."""
    buf = _MASKS.get(dtype)
    if buf is None or buf.shape[0] // 2 < c:
        n = 1 << max(c - 1, 1).bit_length()
        buf = torch.zeros(2 * n, dtype=dtype)
        buf[n] = float("-inf")
        _MASKS[dtype] = buf
    n = buf.shape[0] // 2
    return buf.as_strided((2, 1, 1, c), (c, 0, 0, 1), n - c)


def gemm_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `gemm` may run this plain step: float32/64 on the CPU, few folded query rows,
    K/V bytes per head beyond the plan's `min_split_bytes` (one core's L2: streamed; below,
    torch's kernel keeps them in cache and its one call is the cheaper; `MIN_SPLIT_BYTES`
    moves the split alone), nothing requiring grad, and K and V whose batch
    and head dims merge without a copy (a cache's view does)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if S * (D + v.shape[-1]) * q.element_size() < machine_plan().min_split_bytes:  # asked first: the usual no
        return False
    if not q.is_cpu or q.dtype not in _GEMM_DTYPES or H // Hkv * T > _ONE_BLOCK:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return all(B == 1 or t.stride(0) == Hkv * t.stride(1) for t in (k, v))


def gemm(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Attention of q `(B, H, T, D)` over every key of k, v `(B, Hkv, S, D | Dv)` as two
    batched GEMMs: the scores `(S, D) @ (D, G*T)` per K/V head with the keys the tall operand
    (read once, in order), the softmax over S in the input's dtype, the values `(G*T, S) @
    (S, Dv)`. Exact to rounding (the scores are kept whole: G*T*S floats per head)."""
    B, H, T, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    qf = q.reshape(B * Hkv, H // Hkv * T, D) * scale  # (B*Hkv, G*T, D)
    scores = torch.bmm(k.flatten(0, 1), qf.transpose(1, 2))  # (B*Hkv, S, G*T)
    probs = torch.softmax(scores.transpose(1, 2), dim=-1)  # (B*Hkv, G*T, S)
    return torch.bmm(probs, v.flatten(0, 1)).view(B, H, T, Dv)


def native_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `native` may run this plain step: float32, D = Dv a multiple of the library's
    vector width and at most 512, at most 32 folded query rows (padded to a multiple of 4),
    a key at least, the last dim of q, K and V contiguous, and the library built
    (`native.library`). Where it runs is `step`'s: on the CPU, with nothing requiring grad."""
    if q.dtype is not torch.float32:
        return False
    B, H, T, D = q.shape
    _, Hkv, S, _ = k.shape
    width = _native.vector_width()  # None without the library
    if width is None or D % width or v.shape[-1] != D or D > 512 or (H // Hkv * T + 3) // 4 * 4 > 32 or S == 0:
        return False
    return q.stride()[-1] == 1 and k.stride()[-1] == 1 and v.stride()[-1] == 1


# K and V floats a thread of the native kernel takes at least, as torch's own parallel loops take
# at least at::internal::GRAIN_SIZE elements: a shorter share costs less than waking a thread
_GRAIN = 32768


def native(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Attention of q `(B, H, T, D)` over every key of k, v `(B, Hkv, S, D)`, float32, by the
    kernel of `decode_step.c`: one pass over the keys per K/V head (scores, online softmax,
    values), on as many of torch's threads as have `_GRAIN` floats of K and V each; where
    the B * Hkv heads do not divide among them the keys are split into parts merged by
    log-sum-exp, as `split_keys` does."""
    return native_checked(q, k, v, scale)[0]


def native_checked(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, bool]:
    """`native`'s (out, whether the kernel found a row of out not finite or zero throughout:
    the NaN rule's first look, `functional._nan_or_zero_row`, taken in the same call)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    out = q.new_empty(B, H, T, D)  # float32 on the CPU as q is, whatever torch's default dtype and device
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    flag = _native.library().mh_decode_step(
        q.data_ptr(), qs[0], qs[1], qs[2], k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1], vs[2],
        B, Hkv, H // Hkv, T, k.shape[2], D, scale, out.data_ptr(), torch.get_num_threads(), _GRAIN)
    if flag < 0:  # the checks above keep this from happening; a guard, never a wrong answer
        what = "could not allocate its work buffer for" if flag == -2 else "refused"
        raise RuntimeError(f"the native decode kernel {what} q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out, flag == 1


def _flash(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """torch's kernel: `split_keys` where `key_splits` says split (never on one thread, asked
    first), else `sdpa.plain`."""
    if torch.get_num_threads() > 1 and (q.shape[2] == 1 or not causal):
        parts = key_splits(q, k, v)
        if parts > 1:
            return split_keys(q, k, v, scale, parts)
    out = plain(q, k, v, scale, causal)
    return out, out


def _engines(q: Tensor, k: Tensor, v: Tensor, scale: float, streamed: bool) -> dict:
    """The engines that may run this step, by name: torch's kernel, the GEMMs where the K/V
    stream (`gemm_applies`), and the native kernel where `native_applies`."""
    engines = {"flash": lambda: _flash(q, k, v, scale, False)}
    if streamed:
        engines["gemm"] = lambda: gemm(q, k, v, scale)
    if native_applies(q, k, v):
        engines["native"] = lambda: native(q, k, v, scale)
    return engines


_CASES: dict[tuple, str] = {}  # (dtype, threads, rows, D, streamed) -> the case's name in `measured_choices`


def engine(q: Tensor, k: Tensor, v: Tensor, scale: float, streamed: bool = True) -> str:
    """"flash", "gemm" or "native" for a step `gemm_applies` accepts (`streamed`) or one
    whose K/V stay in the L2 that `native_applies` accepts: the plan's `decode_engine` (its
    "native" where `native_applies` does not hold, and its "gemm" on a step in cache, are
    torch's kernel), else what was timed on this process's first step of the same dtype,
    threads, query rows, head width and side of the L2, else timed now on this step by
    `machine.fastest` (each engine that may run it in turn; another than "flash" only if it
    wins by its margin). What was kept for a case says nothing of this step's layout: the
    caller (`_chosen`) asks `native_applies` of every step."""
    fixed = machine_plan().decode_engine
    if fixed is not None:
        if fixed == "native" and not native_applies(q, k, v) or fixed == "gemm" and not streamed:
            return "flash"
        return fixed
    B, H, T, D = q.shape
    key = (q.dtype, torch.get_num_threads(), H // k.shape[1] * T, D, streamed)
    case = _CASES.get(key)
    if case is None:  # formatted once per case: a step asks once per layer per token
        case = _CASES[key] = (f"{str(q.dtype).removeprefix('torch.')}, {key[1]} threads, {key[2]} rows, D {D}, "
                              f"{'streamed' if streamed else 'in cache'}")
    won = recalled("decode_engine", case)
    if won is None:
        won = fastest(_engines(q, k, v, scale, streamed), "flash")
        remember("decode_engine", case, won)
    return won


def step(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor | None]:
    """The plain step: (out, what the NaN check reads: out itself, the parts' outputs of a
    split step, or None where the native kernel looked at out's rows itself and found none
    to look at again). The `engine`'s choice where `_chosen` asks it: `gemm`, `native` or
    torch's kernel (`_flash`); elsewhere torch's kernel; only `sdpa.plain` inside
    torch.compile, where the thread count cannot be traced and inductor's graph holds the
    one kernel call."""
    if torch.compiler.is_compiling() or (q.shape[2] > 1 and causal):
        out = plain(q, k, v, scale, causal)
        return out, out
    chosen = _chosen(q, k, v, scale)
    if chosen != "flash":
        if chosen == "gemm":
            out = gemm(q, k, v, scale)
            return out, out
        out, bad = native_checked(q, k, v, scale)
        return out, out if bad else None
    return _flash(q, k, v, scale, causal)


def _chosen(q: Tensor, k: Tensor, v: Tensor, scale: float) -> str:
    """The `engine` of a plain step that may run another than torch's kernel: on the CPU with
    nothing requiring grad, where `gemm_applies` (K/V streamed) or `native_applies` (K/V in
    the L2, where the native kernel's one call costs less than torch's kernel call, its
    dispatch and allocations on some machines: docs/benchmarks-decode.md, "Steps in
    cache"); else "flash"."""
    if not q.is_cpu or torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "flash"
    streamed, native_ok = gemm_applies(q, k, v), native_applies(q, k, v)
    if not streamed and not native_ok:
        return "flash"
    won = engine(q, k, v, scale, streamed)
    # the case a winner is kept for does not hold the layout: a step of a case timed on
    # contiguous K/V may come with a strided last dim, which only torch's kernel takes
    return "flash" if won == "native" and not native_ok else won
