"""Decode benchmark: one new token over a KV cache of L tokens, CPU, fp32.

    .venv/bin/python benchmarks/decode.py                    # L = 1024, 4096, 16384
    .venv/bin/python benchmarks/decode.py --quick            # L = 256, 1024, few rounds: smoke test
    .venv/bin/python benchmarks/decode.py --lengths 4096 --rounds 9 --no-layer
    .venv/bin/python benchmarks/decode.py --profile --lengths 512 2048 8192 16384 --rounds 7 --rotate-mib 400

--profile: the one-token step alone, each way it can be done (multihead's public call, the
same with the split off, the one folded flash call, the key axis split in 2 and 4 merged by
log-sum-exp, the two passes as matrix products with the G query heads folded into rows,
torch's enable_gqa), for GQA 32/8 x 128 and SmolLM2's 9/3 x 64 (--profile-geometries), at
1 and 2 threads (--profile-threads), as a share of the read rate of the same round; into
the JSON's 'profile' entry (the rest is kept). Where
the split pays is `kernels.decode.MIN_SPLIT_BYTES`'s evidence. --rotate-mib above the L3
(260 MiB on the Intel VM) so every step reads its cache from memory.

Geometry (DeepSeek-V2-like, B = 1): d_model 4096, 32 query heads of head_dim 128;
MHA (32 KV heads), GQA (8 KV heads), MQA (1 KV head); MLA with kv_rank 512 and
rope_dim 64 (cache 576 values per token against MHA's 2 * 32 * 128 = 8192).

Two kinds of step:
- kernel: attention of the new token over the cache, given its projections.
  MHA/GQA/MQA: `multihead.scaled_dot_product_attention(q (1, 32, 1, 128), k, v)` over
  the cached `(1, Hkv, L, 128)`. MLA naive: `LatentAttention.attend_naive` (decompress
  K and V of all L cached latents with kv_b_proj, then attention). MLA absorbed:
  `attend_absorbed` (fold W_UK into the query, attend over the latent, apply W_UV).
  The baseline: torch's `F.scaled_dot_product_attention(..., enable_gqa=True)` on the
  same q, k, v.
- layer: the whole module's forward for one token with a cache at length L - 1
  (projections, RoPE, cache write, attention, output projection).

Method: every round runs each case once, in an order rotated round by round, and
medians are taken over rounds; "x torch" is the median over rounds of the paired ratio
torch / multihead, which cancels slow drifts of the load (the machine is shared: the
load average is recorded). So that a step reads its cache from memory, as one layer of
a many-layer model would, and not from the 32 MiB L3 left warm by the previous round,
each case rotates over enough copies of its cache to exceed --rotate-mib.

Ceilings, timed in every round beside the cases (same load): copy bandwidth, the bytes
of a 128 MiB tensor copied per second by `copy_` into a preallocated one (what "a large
tensor clone" measures; the memory traffic is twice that, read + write); read bandwidth,
`sum` of the same tensor; fp32 matmul throughput, a 1024^3 `torch.mm`. "GB/s" is cache
bytes / step time; "% copy" and "% read" compare it with the copy and read bandwidth of
the same round (median over rounds). "floor ms" is the roofline of the kernel step,
max(cache bytes / read bandwidth, FLOPs / matmul throughput), which tells a
memory-bound step from a compute-bound one.

Writes a Markdown report to stdout, JSON to benchmarks/results/decode.json (--json) and
the report between its markers in docs/benchmarks-decode.md (--doc; --no-doc to skip), the page's
other sections kept.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from doc_section import write_section  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from machine_info import machine, plan_choices  # noqa: E402
from multihead import Attention, LatentAttention, scaled_dot_product_attention  # noqa: E402

D_MODEL, HEADS, HEAD_DIM = 4096, 32, 128
KV_RANK, ROPE_DIM = 512, 64
FP32 = 4
MiB = 1 << 20
KV_VARIANTS = {"MHA": 32, "GQA": 8, "MQA": 1}  # name -> KV heads


@dataclass
class Case:
    """One timed thing: `fn(i)` runs step i (i picks the cache copy)."""

    name: str  # "MHA", "MLA absorbed", "torch GQA", ...
    kind: str  # "kernel" or "layer"
    fn: object
    cache_bytes: int
    flops: float = 0.0
    times: list = field(default_factory=list)



def probes() -> list[Case]:
    """The machine's ceilings, timed in every round next to the cases (same load).

    copy: the 128 MiB copied per second by `copy_` into a preallocated tensor;
    read: `sum` of the same 128 MiB; matmul: a 1024^3 fp32 `torch.mm`.
    """
    x = torch.randn(32 * MiB)  # 128 MiB: four times the L3
    y = torch.empty_like(x)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return [Case("copy", "probe", lambda i: y.copy_(x), x.nbytes),
            Case("read", "probe", lambda i: x.sum(), x.nbytes),
            Case("matmul", "probe", lambda i: a @ b, 0, 2.0 * 1024**3)]


def _copies(nbytes: int, rotate_bytes: int) -> int:
    return max(1, math.ceil(rotate_bytes / max(1, nbytes)))


def _fill_(t: torch.Tensor) -> torch.Tensor:
    return t.normal_(0.0, 1.0)


def build_cases(L: int, modules: dict, rotate_bytes: int, layer: bool) -> list[Case]:
    """Caches (several copies of the small ones), new-token inputs and the step functions."""
    g = torch.Generator().manual_seed(L)
    cases: list[Case] = []
    q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g)  # (B, H, 1, D)
    x = torch.randn(1, 1, D_MODEL, generator=g)  # the new token's input to a layer

    # ---- MHA / GQA / MQA: KVCache objects, shared by the kernel and the layer step
    for name, hkv in KV_VARIANTS.items():
        attn = modules[name]
        nbytes = 2 * hkv * L * HEAD_DIM * FP32
        caches = []
        for _ in range(_copies(nbytes, rotate_bytes)):
            c = attn.new_cache(1, L)
            _fill_(c.k), _fill_(c.v)
            c.update(c.k[:, :, :L - 1].clone(), c.v[:, :, :L - 1].clone())  # L - 1 cached (host length too)
            caches.append((c, c.checkpoint(1)))  # restore(mark) puts it back at L - 1 before each step
        kv = [(c.k[:, :, :L], c.v[:, :, :L]) for c, _ in caches]  # (1, Hkv, L, D) views
        n = len(kv)
        flops = 4.0 * HEADS * L * HEAD_DIM  # Q K^T and P V, multiply-add = 2

        def mh_step(i, kv=kv, n=n):
            k, v = kv[i % n]
            return scaled_dot_product_attention(q, k, v, causal=True)

        def torch_step(i, kv=kv, n=n):
            k, v = kv[i % n]
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        cases.append(Case(name, "kernel", mh_step, nbytes, flops))
        cases.append(Case(f"torch {name}", "kernel", torch_step, nbytes, flops))
        if layer:
            def layer_step(i, attn=attn, caches=caches, n=n):
                c, mark = caches[i % n]
                c.restore(mark)  # the new token is written at position L - 1
                return attn(x, cache=c)

            cases.append(Case(name, "layer", layer_step, nbytes))

    # ---- MLA: latent caches `(1, L, R + rope_dim)`
    mla = modules["MLA"]
    nbytes = L * (KV_RANK + ROPE_DIM) * FP32
    caches = []
    for _ in range(_copies(nbytes, rotate_bytes)):
        c = mla.new_cache(1, L)
        _fill_(c.buf)
        c.update(c.buf[:, :L - 1].clone())  # L - 1 cached (host length too)
        caches.append((c, c.checkpoint(1)))
    n = len(caches)
    q_nope, q_pe = mla.queries(x, L - 1)  # (1, H, 1, D), (1, H, 1, rope_dim)
    naive_flops = 2.0 * L * KV_RANK * HEADS * 2 * HEAD_DIM + 2.0 * HEADS * L * (2 * HEAD_DIM + ROPE_DIM)
    absorbed_flops = 2.0 * HEADS * KV_RANK * 2 * HEAD_DIM + 2.0 * HEADS * L * (2 * KV_RANK + ROPE_DIM)
    for absorb, flops in ((False, naive_flops), (True, absorbed_flops)):
        label = "MLA absorbed" if absorb else "MLA naive"
        attend = mla.attend_absorbed if absorb else mla.attend_naive

        def mla_kernel(i, attend=attend, caches=caches, n=n):
            return attend(q_nope, q_pe, caches[i % n][0].buf[:, :L])

        cases.append(Case(label, "kernel", mla_kernel, nbytes, flops))
        if layer:
            def mla_layer(i, absorb=absorb, caches=caches, n=n):
                c, mark = caches[i % n]
                c.restore(mark)
                return mla(x, cache=c, absorb=absorb)

            cases.append(Case(label, "layer", mla_layer, nbytes))
    return cases


def time_cases(cases: list[Case], rounds: int, min_sample_s: float, log) -> None:
    """Round-robin: every round runs every case once, in an order rotated round by round."""
    calls = {}
    for c in cases:  # warm up, and pick calls per sample so that one sample lasts >= min_sample_s
        t0 = time.perf_counter()
        c.fn(0)
        dt = time.perf_counter() - t0
        calls[c.name, c.kind] = max(1, min(20, math.ceil(min_sample_s / max(dt, 1e-6))))
    step = 0
    for r in range(rounds):
        k = r % len(cases)
        for c in cases[k:] + cases[:k]:
            n = calls[c.name, c.kind]
            t0 = time.perf_counter()
            for _ in range(n):
                c.fn(step)
                step += 1
            c.times.append((time.perf_counter() - t0) / n)
        log(f"  round {r + 1}/{rounds} done, load {os.getloadavg()[0]:.2f}")


def paired(a: Case, b: Case) -> float:
    """Median over rounds of time(a) / time(b): a slow drift of the load cancels out."""
    return statistics.median(ta / tb for ta, tb in zip(a.times, b.times))


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def run(args, log) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_start = os.getloadavg()
    log(f"machine: {machine()}")
    with torch.inference_mode():
        modules = {name: Attention(D_MODEL, HEADS, hkv, head_dim=HEAD_DIM, bias=False, causal=True, rope=True).eval()
                   for name, hkv in KV_VARIANTS.items()}
        modules["MLA"] = LatentAttention(D_MODEL, HEADS, KV_RANK, head_dim=HEAD_DIM, rope_dim=ROPE_DIM,
                                         causal=True).eval()
        ceiling_cases = probes()
        rows, per_length = [], []
        for L in args.lengths:
            log(f"L = {L}")
            load0 = os.getloadavg()[0]
            for c in ceiling_cases:
                c.times.clear()
            cases = build_cases(L, modules, int(args.rotate_mib * MiB), args.layer)
            time_cases(cases + ceiling_cases, args.rounds, args.min_sample_ms / 1e3, log)
            copy, read, mm = ceiling_cases
            ceil = {"copy_GBps": copy.cache_bytes / statistics.median(copy.times) / 1e9,
                    "read_GBps": read.cache_bytes / statistics.median(read.times) / 1e9,
                    "matmul_GFLOPs": mm.flops / statistics.median(mm.times) / 1e9}
            log(f"  copy {ceil['copy_GBps']:.1f} GB/s, read {ceil['read_GBps']:.1f} GB/s, "
                f"matmul {ceil['matmul_GFLOPs']:.0f} GFLOP/s")
            per_length.append({"L": L, "load_start": load0, "load_end": os.getloadavg()[0], **ceil,
                               "times_s": {c.name: list(c.times) for c in ceiling_cases}})
            by_key = {(c.name, c.kind): c for c in cases}
            for c in cases:
                med = statistics.median(c.times)
                row = {"L": L, "kind": c.kind, "variant": c.name, "cache_bytes": c.cache_bytes,
                       "median_s": med, "min_s": min(c.times), "rounds": len(c.times),
                       "GBps": c.cache_bytes / med / 1e9, "flops": c.flops, "times_s": list(c.times)}
                if c.kind == "kernel":
                    # achieved bandwidth over the copy bandwidth of the same round, median over rounds
                    row["pct_copy"] = 100 * c.cache_bytes / copy.cache_bytes / paired(c, copy)
                    row["pct_read"] = 100 * c.cache_bytes / read.cache_bytes / paired(c, read)
                    row["floor_s"] = max(c.cache_bytes / (ceil["read_GBps"] * 1e9),
                                         c.flops / (ceil["matmul_GFLOPs"] * 1e9))
                    theirs = by_key.get((f"torch {c.name}", "kernel"))
                    row["x_torch"] = paired(theirs, c) if theirs is not None else None
                rows.append(row)
            del cases, by_key
            gc.collect()
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {"d_model": D_MODEL, "n_heads": HEADS, "head_dim": HEAD_DIM, "kv_rank": KV_RANK,
                   "rope_dim": ROPE_DIM, "dtype": "float32", "batch": 1, "lengths": args.lengths,
                   "rounds": args.rounds, "rotate_mib": args.rotate_mib},
        "load": {"start": load_start, "end": os.getloadavg()},
        "per_length": per_length,
        "rows": rows,
    }


def _row(report, L, variant, kind="kernel"):
    for r in report["rows"]:
        if (r["L"], r["variant"], r["kind"]) == (L, variant, kind):
            return r
    return None


def evaluate_targets(report) -> list[dict]:
    out = []
    L = max(report["config"]["lengths"])
    ceil = next(p for p in report["per_length"] if p["L"] == L)

    def add(name, passed, detail):
        out.append({"target": name, "passed": bool(passed), "detail": detail})

    for v in ("GQA", "MQA"):
        r = _row(report, L, v)
        bound = "memory" if r["floor_s"] == r["cache_bytes"] / (ceil["read_GBps"] * 1e9) else "compute"
        need_s = r["cache_bytes"] / (0.5 * ceil["copy_GBps"] * 1e9)
        add(f"{v} kernel step reads its cache at >= 50% of copy bandwidth (L = {L})", r["pct_copy"] >= 50,
            f"{r['GBps']:.1f} GB/s = {r['pct_copy']:.0f}% of the copy bandwidth ({ceil['copy_GBps']:.1f} GB/s), "
            f"{r['pct_read']:.0f}% of the read bandwidth ({ceil['read_GBps']:.1f} GB/s); "
            f"{fmt_ms(r['median_s'])} ms against a roofline floor of {fmt_ms(r['floor_s'])} ms ({bound}-bound). "
            f"50% needs the step in {fmt_ms(need_s)} ms, i.e. its {r['flops'] / 1e6:.0f} MFLOP at "
            f"{r['flops'] / need_s / 1e9:.0f} GFLOP/s = {100 * r['flops'] / need_s / 1e9 / ceil['matmul_GFLOPs']:.0f}% "
            f"of the machine's fp32 matmul throughput")
        add(f"{v} kernel step >= 3x faster than torch SDPA enable_gqa (L = {L})", r["x_torch"] >= 3,
            f"{fmt_ms(r['median_s'])} ms vs torch {fmt_ms(_row(report, L, 'torch ' + v)['median_s'])} ms: "
            f"{r['x_torch']:.1f}x (median of paired ratios)")
    naive, absorbed = _row(report, L, "MLA naive"), _row(report, L, "MLA absorbed")
    speedup = naive["median_s"] / absorbed["median_s"]
    add(f"MLA absorbed kernel step >= 10x faster than naive (L = {L})", speedup >= 10,
        f"{fmt_ms(absorbed['median_s'])} ms vs {fmt_ms(naive['median_s'])} ms: {speedup:.0f}x")
    ratio = _row(report, L, "MHA")["cache_bytes"] / absorbed["cache_bytes"]
    add("MLA cache about 1/14 of MHA's", 13.5 <= ratio <= 15, f"MHA / MLA cache bytes = {ratio:.1f} (8192 / 576)")
    return out


def render(report) -> str:
    m, cfg = report["machine"], report["config"]
    lines = [
        f"Decode benchmark, {report['date']}: {m['cpu']}, {m['cores']} cores, {m['threads']} torch "
        f"thread{'s' if m['threads'] > 1 else ''}, torch {m['torch']}. fp32, B = 1, d_model {cfg['d_model']}, "
        f"{cfg['n_heads']} query heads of {cfg['head_dim']}, MLA kv_rank {cfg['kv_rank']} + rope_dim "
        f"{cfg['rope_dim']}; medians of {cfg['rounds']} interleaved rounds. Load average (1 min, the machine "
        f"is shared): {report['load']['start'][0]:.2f} at the start, {report['load']['end'][0]:.2f} at the end.",
        "",
        "Ceilings, timed in every round beside the cases:",
        "",
        "| L | load (1 min) | copy GB/s (bytes copied) | read GB/s | matmul GFLOP/s |",
        "|---:|---|---:|---:|---:|",
    ]
    for p in report["per_length"]:
        lines.append(f"| {p['L']} | {p['load_start']:.1f} -> {p['load_end']:.1f} | {p['copy_GBps']:.1f} | "
                     f"{p['read_GBps']:.1f} | {p['matmul_GFLOPs']:.0f} |")
    lines += [
        "",
        "Kernel step (attention of one new token over the cache, given its projections). "
        "\"% copy\", \"% read\": cache bytes per second over the copy / read bandwidth of the same round; "
        "\"floor\": max(cache bytes / read bandwidth, FLOPs / matmul throughput); "
        "\"x torch\": torch's time over multihead's, paired by round.",
        "",
        "| L | variant | cache MiB | step ms | min ms | GB/s | % copy | % read | floor ms | x torch |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        if r["kind"] != "kernel":
            continue
        xt = f"{r['x_torch']:.1f}x" if r.get("x_torch") is not None else ""
        lines.append(f"| {r['L']} | {r['variant']} | {r['cache_bytes'] / MiB:.1f} | {fmt_ms(r['median_s'])} | "
                     f"{fmt_ms(r['min_s'])} | {r['GBps']:.1f} | {r['pct_copy']:.0f}% | {r['pct_read']:.0f}% | "
                     f"{fmt_ms(r['floor_s'])} | "
                     f"{xt} |")
    if any(r["kind"] == "layer" for r in report["rows"]):
        lines += ["", "Layer step (the module's forward for one token with the cache at L - 1: projections, RoPE, "
                  "cache write, attention, output; the weights are read too):", "",
                  "| L | variant | cache MiB | step ms | min ms |", "|---:|---|---:|---:|---:|"]
        for r in report["rows"]:
            if r["kind"] == "layer":
                lines.append(f"| {r['L']} | {r['variant']} | {r['cache_bytes'] / MiB:.1f} | "
                             f"{fmt_ms(r['median_s'])} | {fmt_ms(r['min_s'])} |")
    lines += ["", "Targets:", ""]
    for t in report["targets"]:
        lines.append(f"- [{'x' if t['passed'] else ' '}] {t['target']}: {t['detail']}")
    return "\n".join(lines) + "\n"


NOTES = """
Reading the table:

- MHA: multihead hands one query per K/V head straight to torch's fused kernel, so the
  two rows are the same kernel (1.0x). GQA and MQA fold each group's query heads into
  the query length, so every K/V head is read once; torch's `enable_gqa=True` reads the
  shared K/V once per query head, which is where the "x torch" column comes from. A
  folded MQA call is one head, so at batch 1 multihead splits it over the CPU threads
  through a stride-0 view of the one K/V head (without that, one core does all of it).
- MQA is compute-bound here: 32 query heads share each cached K/V value, 16 FLOPs per
  cached byte, so reading its cache at half the copy bandwidth would need the attention
  arithmetic at the rate given in its target line, most of the machine's matmul peak.
  torch's fused kernel runs these 16-row blocks well below that.
- MLA naive decompresses every cached latent through kv_b_proj each step
  (2 * L * 512 * 8192 FLOPs): compute-bound and linear in L. The absorbed step attends
  over the 576-wide latent directly (one tall-skinny GEMM for scores, one for values)
  and reads 1/14 of MHA's bytes, but as MQA with 32 heads it is compute-bound too.
- Layer step: at small L the weights (64 MiB per 4096 x 4096 projection) dominate.
"""


# ------------------------------------------------------------------ the decode step's profile

PROFILE_GEOMETRIES = {"GQA 32/8 x 128": (32, 8, 128), "SmolLM2 9/3 x 64": (9, 3, 64)}
PROFILE_SHORT = {"gqa": "GQA 32/8 x 128", "smollm2": "SmolLM2 9/3 x 64"}  # --profile-geometries


def profile_cases(L: int, H: int, Hkv: int, D: int, rotate_bytes: int) -> list[Case]:
    """One decode step (B = 1, one query) of one geometry, done each way the profile compares:
    multihead's public call (the engine `kernels.decode.engine` chose, split over the keys
    where `key_splits` says so), the same call on torch's kernel ("multihead flash") and with
    its split switched off too ("multihead unsplit"; so that "multihead flash" against it is
    the split's worth with the public call's fixed cost, its checks and the NaN check's
    reduction, on both sides; the ways below are the bare kernels, without it), the GEMM
    engine alone (`decode.gemm`: the keys the tall operand of the scores' GEMM), the native
    engine alone where it is built (`decode.native`: the C kernel of `kernels.native`), the one
    folded flash call (`sdpa.plain`), the split forced into 2 and 4 parts, the two
    passes as matrix products with the G query heads folded into rows (scores, softmax,
    values), torch's `enable_gqa`; and the read rate, `sum` over as many bytes as K and V."""
    from multihead.kernels import decode, sdpa

    g = torch.Generator().manual_seed(L)
    nbytes = 2 * Hkv * L * D * FP32
    n = _copies(nbytes, rotate_bytes)
    kv = [(torch.randn(1, Hkv, L, D, generator=g), torch.randn(1, Hkv, L, D, generator=g)) for _ in range(n)]
    flat = [torch.randn(2 * Hkv * L * D, generator=g) for _ in range(n)]
    q = torch.randn(1, H, 1, D, generator=g)
    scale, G = D ** -0.5, H // Hkv
    flops = 4.0 * H * L * D

    def two_matmuls(k, v):
        scores = (q.view(1, Hkv, G, D) * scale) @ k.transpose(-2, -1)  # (1, Hkv, G, L)
        return torch.softmax(scores, dim=-1) @ v  # (1, Hkv, G, D)

    def on_flash(k, v, split=True):  # the public call on torch's kernel, split or (split=False) one call
        saved, decode.MIN_SPLIT_BYTES = decode.MIN_SPLIT_BYTES, decode.MIN_SPLIT_BYTES if split else math.inf
        try:
            with plan_choices(decode_engine="flash"):
                return scaled_dot_product_attention(q, k, v)
        finally:
            decode.MIN_SPLIT_BYTES = saved

    ways = {"multihead": lambda k, v: scaled_dot_product_attention(q, k, v),
            "multihead flash": on_flash,
            "multihead unsplit": lambda k, v: on_flash(k, v, split=False),
            "gemm engine": lambda k, v: decode.gemm(q, k, v, scale),
            "one flash call": lambda k, v: sdpa.plain(q, k, v, scale),
            "split 2": lambda k, v: decode.split_keys(q, k, v, scale, 2)[0],
            "split 4": lambda k, v: decode.split_keys(q, k, v, scale, 4)[0],
            "two matmuls": two_matmuls,
            "torch enable_gqa": lambda k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    if decode.native_applies(q, *kv[0]):  # the C kernel, where this machine could build it
        ways["native engine"] = lambda k, v: decode.native(q, k, v, scale)
    want = ways["one flash call"](*kv[0]).double()
    for name, f in ways.items():
        err = (f(*kv[0]).double().reshape(want.shape) - want).abs().max().item()
        assert err < 1e-5, f"{name}: {err:.2e} from the one flash call"
    cases = [Case(name, "profile", lambda i, f=f: f(*kv[i % n]), nbytes, flops) for name, f in ways.items()]
    cases.append(Case("read", "profile", lambda i: flat[i % n].sum(), nbytes))
    return cases


def run_profile(args, log) -> dict:
    """Each geometry at each L, at each thread count: interleaved rounds of every way."""
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for label in (PROFILE_SHORT[g] for g in args.profile_geometries):
            H, Hkv, D = PROFILE_GEOMETRIES[label]
            for L in args.lengths:
                cases = profile_cases(L, H, Hkv, D, int(args.rotate_mib * MiB))
                for threads in args.profile_threads:
                    torch.set_num_threads(threads)
                    for c in cases:
                        c.times.clear()
                    load0 = os.getloadavg()[0]
                    time_cases(cases, args.rounds, args.min_sample_ms / 1e3, lambda m: None)
                    by = {c.name: c for c in cases}
                    for c in cases:
                        if c.name == "read":
                            continue
                        rows.append({"geometry": label, "H": H, "Hkv": Hkv, "D": D, "L": L, "threads": threads,
                                     "way": c.name, "median_s": statistics.median(c.times),
                                     "pct_read": 100 / paired(c, by["read"]),
                                     "x_torch": paired(by["torch enable_gqa"], c),
                                     "x_one_call": paired(by["one flash call"], c),
                                     "x_unsplit": paired(by["multihead unsplit"], c),
                                     "read_GBps": c.cache_bytes / statistics.median(by["read"].times) / 1e9,
                                     "load": [load0, os.getloadavg()[0]], "times_s": list(c.times)})
                    log(f"  {label} L={L} threads={threads}: load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
                del cases
                gc.collect()
    return {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(),
            "rounds": args.rounds, "rotate_mib": args.rotate_mib, "rows": rows}


def render_profile(prof) -> str:
    lines = [f"Decode-step profile, {prof['date']}: {prof['machine']['cpu']}, fp32, B = 1, one query; medians of "
             f"{prof['rounds']} interleaved rounds; \"% read\": the read rate (`sum` over as many bytes as K and "
             f"V, same round) over the step's, paired by round; \"x torch\": torch's `enable_gqa` time over this "
             f"way's; \"x 1 call\": the one folded flash call's time over this way's; \"x unsplit\": the public "
             f"call's with the split off over this way's.", "",
             "| geometry | L | threads | way | ms | % read | x torch | x 1 call | x unsplit | load |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in prof["rows"]:
        lines.append(f"| {r['geometry']} | {r['L']} | {r['threads']} | {r['way']} | {fmt_ms(r['median_s'])} | "
                     f"{r['pct_read']:.0f}% | {r['x_torch']:.2f}x | {r['x_one_call']:.2f}x | "
                     f"{r['x_unsplit']:.2f}x | "
                     f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384], help="cache lengths L")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; medians over them")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    p.add_argument("--min-sample-ms", type=float, default=20.0, help="repeat fast steps to fill a sample")
    p.add_argument("--rotate-mib", type=float, default=96.0,
                   help="rotate over cache copies totalling at least this much (3x the 32 MiB L3)")
    p.add_argument("--no-layer", dest="layer", action="store_false", help="kernel steps only")
    p.add_argument("--quick", action="store_true", help="L = 256 1024, 3 rounds: a smoke test")
    p.add_argument("--json", type=Path, default=None,
                   help="JSON output (default benchmarks/results/decode.json; none with --quick)")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks-decode.md")
    p.add_argument("--no-doc", dest="doc", action="store_const", const=None, help="do not write the doc page")
    p.add_argument("--render", type=Path, metavar="JSON",
                   help="run nothing: render the report of an earlier run's JSON (to --doc and --json)")
    p.add_argument("--profile", action="store_true",
                   help="the decode step's profile instead (GQA 32/8 x 128 and SmolLM2 9/3 x 64 at --lengths, "
                        "each way at --profile-threads): into the JSON's 'profile' entry, the rest kept")
    p.add_argument("--profile-threads", type=int, nargs="+", default=[1, 2], help="thread counts of --profile")
    p.add_argument("--profile-geometries", nargs="+", default=list(PROFILE_SHORT), choices=list(PROFILE_SHORT),
                   help="geometries of --profile: " + ", ".join(f"{k} ({v})" for k, v in PROFILE_SHORT.items()))
    args = p.parse_args(argv)
    if args.profile:
        path = args.json or ROOT / "benchmarks" / "results" / "decode.json"
        prof = run_profile(args, lambda m: print(m, file=sys.stderr, flush=True))
        print(render_profile(prof))
        report = json.loads(path.read_text()) if path.exists() else {}
        report["profile"] = prof
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        return 0
    if args.quick:
        args.lengths, args.rounds = [256, 1024], 3

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    report = json.loads(args.render.read_text()) if args.render else run(args, log)
    report["targets"] = evaluate_targets(report)
    md = render(report)
    print(md)
    if args.json is None and not args.quick:
        args.json = ROOT / "benchmarks" / "results" / "decode.json"
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.doc is not None and not args.quick:  # between its markers: the page's other sections stay
        write_section(args.doc, md + NOTES, "decode.py", "Decode benchmark")
    return 0


if __name__ == "__main__":
    sys.exit(main())
