"""Where the decode step's split over the key axis pays (`MachinePlan.min_split_bytes`, one
core's L2; `kernels.decode.MIN_SPLIT_BYTES` overrides it), measured in a way a loaded machine
does not distort: the calling thread's CPU time.

    .venv/bin/python benchmarks/decode_split.py                      # 9/3 x 64 and 9/3 x 128, 2 threads
    .venv/bin/python benchmarks/decode_split.py --lengths 1024 4096 --rounds 20

On a machine shared with other work, a 2-thread step's wall time is set by when the
scheduler runs the second thread (under load 8 on 2 cores every parallel region costs
a time slice, ~20 ms, whatever the kernel does), so wall-clock rounds cannot tell a
split step from an unsplit one. With OMP_WAIT_POLICY=PASSIVE (set here: idle threads
sleep instead of spinning) the calling thread's CPU time per step is its own share of
the kernel, which at::parallel_for makes the busiest share (unsplit: 2 of 3 K/V heads;
split in 2: 3 of 6 half heads), plus the merge and the public call's checks. That is
the step's wall time on a quiet machine up to what it leaves out: the threads' wake-up
(one parallel region either way) and the two threads' contention for memory. The quiet
wall-clock check is `benchmarks/decode.py --profile`.

Each round times, in a rotated order, `multihead.scaled_dot_product_attention` of one
query over K/V of L keys (cold: rotating over copies larger than the L3) with the split
forced on and off (MIN_SPLIT_BYTES 1 or inf), at an even and an odd L; medians over
rounds, "x" the median of the per-round ratios unsplit / split (> 1: the split pays).
Writes JSON to benchmarks/results/decode_split.json (or --json).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":  # read by OpenMP when torch loads: re-run with it set
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine_info import machine, write_json  # noqa: E402
from multihead import scaled_dot_product_attention  # noqa: E402
from multihead.kernels import decode  # noqa: E402

GEOMETRIES = {"9/3 x 64": (9, 3, 64), "9/3 x 128": (9, 3, 128)}  # SmolLM2's heads; the same with 128-wide


def measure(H: int, Hkv: int, D: int, L: int, rounds: int, rotate_mib: float) -> dict:
    n = max(2, math.ceil(rotate_mib * 2**20 / (2 * Hkv * (L + 1) * D * 4)))
    g = torch.Generator().manual_seed(L)
    kv = [(torch.randn(1, Hkv, L + 1, D, generator=g), torch.randn(1, Hkv, L + 1, D, generator=g)) for _ in range(n)]
    q = torch.randn(1, H, 1, D, generator=g)

    def step(k, v, split):
        saved, decode.MIN_SPLIT_BYTES = decode.MIN_SPLIT_BYTES, (1 if split else math.inf)
        try:
            return scaled_dot_product_attention(q, k, v)
        finally:
            decode.MIN_SPLIT_BYTES = saved

    k, v = kv[0]
    for odd in (False, True):  # the split takes the same values as the one call (1e-6)
        kk, vv = (k, v) if odd else (k[:, :, :L], v[:, :, :L])
        err = (step(kk, vv, True).double() - step(kk, vv, False).double()).abs().max().item()
        assert err < 1e-6, f"split differs from the one call by {err:.2e} (L={L}, D={D}, odd={odd})"
    keys = [(split, odd) for split in (False, True) for odd in (False, True)]
    times = {key: [] for key in keys}
    load0, i = os.getloadavg()[0], 0
    with torch.inference_mode():
        for r in range(rounds):
            for key in keys[r % 4:] + keys[:r % 4]:
                t = 0
                for _ in range(4):
                    k, v = kv[i % n]
                    i += 1
                    if not key[1]:
                        k, v = k[:, :, :L], v[:, :, :L]
                    t0 = time.thread_time_ns()
                    step(k, v, key[0])
                    t += time.thread_time_ns() - t0
                times[key].append(t / 4e9)
    row = {"H": H, "Hkv": Hkv, "D": D, "L": L, "kv_bytes_per_head": 2 * L * D * 4,
           "load": [load0, os.getloadavg()[0]]}
    for odd in (False, True):
        tag = "odd" if odd else "even"
        row[f"unsplit_s_{tag}"] = statistics.median(times[False, odd])
        row[f"split_s_{tag}"] = statistics.median(times[True, odd])
        row[f"x_{tag}"] = statistics.median(a / b for a, b in zip(times[False, odd], times[True, odd]))
        row[f"times_s_{tag}"] = {"unsplit": times[False, odd], "split": times[True, odd]}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--rotate-mib", type=float, default=600.0, help="cold K/V: rotate over this many MiB (L3: 260)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "decode_split.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    rows = []
    print(f"{args.threads} threads, OMP_WAIT_POLICY=PASSIVE, the calling thread's CPU time per step, fp32, B = 1")
    print("| geometry | L | K+V MiB/head | unsplit us | split us | x (even L) | x (odd L) | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in args.geometries:
        H, Hkv, D = GEOMETRIES[name]
        for L in args.lengths:
            r = measure(H, Hkv, D, L, args.rounds, args.rotate_mib)
            r["geometry"] = name
            rows.append(r)
            print(f"| {name} | {L} | {r['kv_bytes_per_head'] / 2**20:.2f} | {r['unsplit_s_even'] * 1e6:.0f} | "
                  f"{r['split_s_even'] * 1e6:.0f} | {r['x_even']:.2f} | {r['x_odd']:.2f} | "
                  f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |", flush=True)
    write_json(args.json, {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                           "machine": machine(), "threads": args.threads, "rounds": args.rounds,
                           "rotate_mib": args.rotate_mib, "min_split_bytes": decode.MIN_SPLIT_BYTES,
                           "method": "calling thread's CPU time (time.thread_time_ns), OMP_WAIT_POLICY=PASSIVE",
                           "load": {"start": load_start, "end": os.getloadavg()}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
