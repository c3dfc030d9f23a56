"""Where the time of one decode step goes: the K pass, the softmax, the V pass, and the
start and join of a parallel region, beside the whole step (torch's one folded flash call,
multihead's GEMM engine, its native kernel where the machine has a C compiler, and
multihead's step: the engine it chose, split over the keys on torch's kernel), one-token
GQA, fp32, B = 1.

    .venv/bin/python benchmarks/decode_profile.py                     # L 16384, 32/8 heads of 128
    .venv/bin/python benchmarks/decode_profile.py --quick             # L 1024, few rounds: smoke test

The flash kernel does the three parts in one pass per block of keys, so they cannot be
timed inside it; here they are timed as the three ops of multihead's GEMM engine
(`kernels.decode.gemm`), which move the same bytes, with the G query heads of a K/V head
folded into rows: `K @ q^T` reads all of K (the K pass; the keys the tall operand, as the
engine has them: `q @ K^T`, the same product with the keys the wide operand, runs the BLAS's
small-M kernel, measured 1.9x slower on an AMD EPYC), the softmax reads and writes the
(Hkv, G, L) scores, `p @ V` reads all of V (the V pass). Their
shares of their sum say which pass the step's time is in; the whole step beside them says
how much the fusion saves. "region" is the cost of one parallel region with nothing in
it to speak of (a fill of 64 Ki floats, above torch's grain, at the benchmark's threads
minus at 1 thread): what a step pays per op that wakes the threads.

Method: every round times each part once, in an order rotated round by round, each on its
own copy of K and V out of enough copies to exceed --rotate-mib (so every pass reads from
memory, as one layer of a many-layer model does, not from the L3 the previous pass left
warm); the time of a sample is CPU time of the process (time.process_time, all threads)
and wall time both; medians over rounds. CPU time is what a loaded machine distorts less:
a thread not scheduled does not count, but its cache may be evicted by the other load, so
shares measured under load are indications, stated with the load. "% read" is K+V bytes
per step time against `sum` over a 128 MiB tensor in the same round; "% of its K/V's read"
against `sum` over the step's own K and V (the copy of the rotation the step would read
next), in the same rounds: the rate of the bytes the step reads, read as it reads them. The
128 MiB tensor is read nine times in a row per sample, and part of it is still in the 32 MiB
L3 at the next read; the header also gives the same read rotated over four such tensors,
which has no such hits (on the AMD EPYC at two threads: about 54 GB/s against 46).

Below the table, the native step beside its two halves: its bytes at its K/V's read rate, and its
compute, the kernel's time per key on one K/V head whose K and V stay in L2 (the difference
of two lengths, so the call's fixed cost drops out) times the step's keys; and how much of
the shorter half the step hides under the longer (the overlap: 100% where it takes the
longer half alone, 0% where it takes their sum).

Writes a Markdown table to stdout and JSON to benchmarks/results/decode_profile.json (--json).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from machine_info import machine, write_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from multihead.functional import scaled_dot_product_attention  # noqa: E402
from multihead.kernels import decode  # noqa: E402
from multihead.kernels.common import flash_lse  # noqa: E402
from multihead.kernels.machine import machine_plan  # noqa: E402

PARTS = ("K pass", "softmax", "V pass")


def build(L: int, H: int, Hkv: int, D: int, rotate_mib: int) -> dict:
    """The timed callables, each over its own rotation of K/V copies."""
    kv_bytes = 2 * Hkv * L * D * 4
    n = max(1, math.ceil(rotate_mib * (1 << 20) / kv_bytes))
    g = torch.Generator().manual_seed(0)
    copies = [(torch.randn(1, Hkv, L, D, generator=g), torch.randn(1, Hkv, L, D, generator=g)) for _ in range(n)]
    q = torch.randn(1, H, 1, D, generator=g)
    qf = q.reshape(1, Hkv, H // Hkv, D)  # (1, Hkv, G, D)
    scale = D ** -0.5
    scores = torch.empty(Hkv, L, H // Hkv)
    probs = torch.softmax(torch.randn(Hkv, H // Hkv, L, generator=g), -1)
    q_rows = qf[0].transpose(-1, -2)  # (Hkv, D, G)
    big = torch.ones(32 << 20)  # 128 MiB, the read ceiling
    bigs = [big] + [torch.ones(32 << 20) for _ in range(3)]  # the same read, rotated over four: no L3 hits
    small = torch.empty(64 << 10)
    state = {"i": 0}

    def kv():
        state["i"] = (state["i"] + 1) % n
        return copies[state["i"]]

    def k_pass():
        k, _ = kv()
        torch.bmm(k[0], q_rows, out=scores)  # (Hkv, L, G)

    def v_pass():
        _, v = kv()
        return torch.bmm(probs, v[0])  # (Hkv, G, D)

    def flash():
        k, v = kv()
        return flash_lse(qf, k, v, causal=False, scale=scale)

    def step():
        k, v = kv()
        return scaled_dot_product_attention(q, k, v)

    def gemm():
        k, v = kv()
        return decode.gemm(q, k, v, scale)

    def native():
        k, v = kv()
        return decode.native(q, k, v, scale)

    checks = copies[0]
    ref = torch.softmax((qf.double() @ checks[0].double().transpose(-1, -2)) * scale, -1) @ checks[1].double()
    got = scaled_dot_product_attention(q, *checks).reshape(1, Hkv, H // Hkv, D)
    assert float((got.double() - ref).abs().max()) < 1e-4, "multihead's step disagrees with the float64 softmax"
    assert float((decode.gemm(q, *checks, scale).double().reshape(ref.shape) - ref).abs().max()) < 1e-4
    cases = {"K pass": k_pass, "softmax": lambda: torch.softmax(scores.transpose(1, 2), -1), "V pass": v_pass,
             "flash call": flash, "gemm engine": gemm}
    if decode.native_applies(q, *checks):  # the C kernel built on this machine (kernels.native)
        assert float((decode.native(q, *checks, scale).double().reshape(ref.shape) - ref).abs().max()) < 1e-4
        cases["native engine"] = native
        cases.update(in_l2(H // Hkv, D, scale, g))

    def read_kv():  # the step's own bytes: a K/V copy of the rotation, as the steps read them
        k, v = kv()
        return k.sum() + v.sum()

    def read_rotated():
        state["b"] = (state.get("b", 0) + 1) % len(bigs)
        return bigs[state["b"]].sum()

    cases.update({"multihead step": step, "region": lambda: small.fill_(1.0), "read 128 MiB": lambda: big.sum(),
                  "read 128 MiB, rotated": read_rotated, "read K/V": read_kv})
    return {"cases": cases, "kv_bytes": kv_bytes, "copies": n}


# Keys of one K/V head in the two calls whose difference is the native kernel's compute per
# key: K and V of the longer one (768 KiB at D 128) stay in a 1 MiB L2 from call to call
IN_L2 = (256, 768)


def in_l2(G: int, D: int, scale: float, g: torch.Generator) -> dict:
    """The native kernel on one K/V head (G query rows) of IN_L2 keys, the same K and V each
    call: their difference per key is its compute per key with the reads from cache, what
    the step adds to the memory's time where the two do not overlap."""
    cases = {}
    q = torch.randn(1, G, 1, D, generator=g)
    for keys in IN_L2:
        k, v = torch.randn(1, 1, keys, D, generator=g), torch.randn(1, 1, keys, D, generator=g)
        cases[f"native, {keys} keys in L2"] = lambda k=k, v=v: decode.native(q, k, v, scale)
    return cases


def time_rounds(cases: dict, rounds: int, reps: int, threads: int) -> dict:
    """Per case: CPU and wall seconds per call of every round (medians of `reps` calls)."""
    out = {name: {"cpu": [], "wall": []} for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, cpu, wall = cases[name], [], []
            fn()
            for _ in range(reps):
                c, w = time.process_time(), time.perf_counter()
                fn()
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - w)
            out[name]["cpu"].append(statistics.median(cpu))
            out[name]["wall"].append(statistics.median(wall))
    return out


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    built = build(args.length, args.heads, args.kv_heads, args.head_dim, args.rotate_mib)
    times = time_rounds(built["cases"], args.rounds, args.reps, args.threads)
    torch.set_num_threads(1)
    one = time_rounds({"region": built["cases"]["region"]}, args.rounds, args.reps, 1)["region"]
    torch.set_num_threads(args.threads)
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    med["region"] = {k: med["region"][k] - statistics.median(one[k]) for k in ("cpu", "wall")}
    total = {k: sum(med[p][k] for p in PARTS) for k in ("cpu", "wall")}
    read_rate = (32 << 20) * 4 / med["read 128 MiB"]["wall"]
    kv_rate = built["kv_bytes"] / med["read K/V"]["wall"]
    rotated_rate = (32 << 20) * 4 / med["read 128 MiB, rotated"]["wall"]
    rows = []
    steps = [name for name in ("flash call", "gemm engine", "native engine", "multihead step") if name in med]
    for name in (*PARTS, *steps, "region"):
        m = med[name]
        rows.append({"part": name, "cpu_us": m["cpu"] * 1e6, "wall_us": m["wall"] * 1e6,
                     "share_cpu": m["cpu"] / total["cpu"] if name in PARTS else None,
                     "share_wall": m["wall"] / total["wall"] if name in PARTS else None,
                     "pct_read": (100 * built["kv_bytes"] / m["wall"] / read_rate
                                  if name in steps else None),
                     "pct_read_kv": 100 * built["kv_bytes"] / m["wall"] / kv_rate if name in steps else None})
    compute = _compute(med, args, built["kv_bytes"] / kv_rate)
    # the plan after the rounds: "measured" holds the engine the step chose on this machine
    return {"benchmark": "decode_profile", "config": {"L": args.length, "H": args.heads, "Hkv": args.kv_heads,
            "D": args.head_dim, "threads": args.threads, "rounds": args.rounds, "reps": args.reps,
            "kv_copies": built["copies"], "kv_bytes": built["kv_bytes"], "kernel_plan": machine_plan().as_dict()},
            "read_gb_s": read_rate / 1e9, "read_rotated_gb_s": rotated_rate / 1e9, "read_kv_gb_s": kv_rate / 1e9,
            "rows": rows, "compute": compute,
            "machine": machine()}


def _compute(med: dict, args, read_s: float) -> dict | None:
    """The native step beside its two halves: R, its bytes at its K/V's read rate; C, its compute
    with K and V in L2 (per key from `in_l2`, times the step's keys); and how much of the
    shorter of the two the step hides under the other, (R + C - step) / min(R, C): 1 where
    the step takes max(R, C), 0 where it takes R + C; None where the step took less than
    max(R, C) (its K and V came from a cache, as at --quick's length)."""
    short, long = (med.get(f"native, {keys} keys in L2") for keys in IN_L2)
    if short is None or long is None or "native engine" not in med:
        return None
    per_key = (long["wall"] - short["wall"]) / (IN_L2[1] - IN_L2[0])
    c = per_key * args.kv_heads * args.length
    step = med["native engine"]["wall"]
    overlap = (read_s + c - step) / min(read_s, c) if step >= max(read_s, c) else None
    return {"ns_per_key": per_key * 1e9, "compute_us": c * 1e6, "read_us": read_s * 1e6, "step_us": step * 1e6,
            "overlap": overlap}


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def render(report) -> str:
    c, m = report["config"], report["machine"]
    head = (f"Decode-step profile, {m['cpu']} ({m['cores']} cores, L2 {m.get('l2_bytes')}, L3 {m.get('l3_bytes')}), "
            f"{c['threads']} thread(s), L {c['L']}, {c['H']}/{c['Hkv']} heads of {c['D']}, {c['rounds']} rounds; "
            f"load {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}; read {report['read_gb_s']:.1f} GB/s")
    head += (f" (four such buffers in turn: {report['read_rotated_gb_s']:.1f} GB/s; its K/V: "
             f"{report['read_kv_gb_s']:.1f} GB/s)")
    lines = [head, "", "| part | CPU us | wall us | share (CPU) | share (wall) | % read | % of its K/V's read |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        read = "" if r["pct_read"] is None else f"{r['pct_read']:.0f}%"
        own = "" if r.get("pct_read_kv") is None else f"{r['pct_read_kv']:.0f}%"
        lines.append(f"| {r['part']} | {r['cpu_us']:.0f} | {r['wall_us']:.0f} | {_pct(r['share_cpu'])} | "
                     f"{_pct(r['share_wall'])} | {read} | {own} |")
    if report.get("compute"):
        x = report["compute"]
        lines += ["", f"native step {x['step_us']:.0f} us: its reads at its K/V's read rate {x['read_us']:.0f} us, "
                  f"its compute with K/V in L2 {x['compute_us']:.0f} us ({x['ns_per_key']:.1f} ns per key of a "
                  "K/V head); "
                  + (f"overlap of the two {100 * x['overlap']:.0f}%" if x["overlap"] is not None else
                     "faster than the reads: K/V from a cache")]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=16384, help="cached tokens L (default 16384)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=9, help="calls per case per round, their median kept (default 9)")
    p.add_argument("--rotate-mib", type=int, default=400, help="K/V copies rotated through, in MiB (default 400)")
    p.add_argument("--quick", action="store_true", help="L 1024, 3 rounds, 3 reps, 8 MiB rotated: a smoke test")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "decode_profile.json")
    args = p.parse_args(argv)
    if args.quick:
        args.length, args.rounds, args.reps, args.rotate_mib = 1024, 3, 3, 8
    report = run(args)
    print(render(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
