"""Two builds of the native decode kernel in one process: this checkout's `kernels/*.c` against
a git revision's (default HEAD), one decode step per layer of a model's worth of layers, fp32.

    .venv/bin/python benchmarks/native_ab.py                  # the working tree against HEAD
    .venv/bin/python benchmarks/native_ab.py --base HEAD~3    # against an older kernel
    .venv/bin/python benchmarks/native_ab.py --quick          # a smoke run

Why one process: a kernel change of a few percent is smaller than what separates two runs of
the same kernel in two processes on a shared machine (each process gets its own pages, and
the memory's read rate moves with them by 20% or more). Here both builds read the same K/V
tensors, in turns.

Method: each case (geometry, cache length L, threads) holds one K/V cache per layer (up to
--max-mib of them; a model's layers are read in turn, so each layer's K/V comes from the L3
or from memory as in a generate, not from the L2 the previous call left warm). A sample is
one "token": the step of every layer, timed as a whole, per layer. Every round runs each
build once per case in a shuffled order; medians over rounds. Both builds are checked
against a float64 softmax first. The base revision's `mh_decode_step` must take the
arguments this checkout's takes.

Writes a Markdown table to stdout and JSON to benchmarks/results/native_ab.json (--json).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from machine_info import machine, write_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from multihead.kernels import decode, native  # noqa: E402

GEOMETRIES = {"smollm2": (9, 3, 64), "gqa": (32, 8, 128), "gemma3": (4, 1, 256)}  # (H, Hkv, D)
LABELS = {"smollm2": "SmolLM2 9/3 x 64", "gqa": "GQA 32/8 x 128", "gemma3": "Gemma 3 4/1 x 256"}


def build_base(rev: str, folder: Path) -> Path:
    """The kernel sources and header at `rev`, built as kernels.native builds this checkout's."""
    rel = native.SOURCES[0].parent.relative_to(ROOT)
    for name in (p.name for p in (*native.SOURCES, *native.HEADERS)):
        text = subprocess.run(["git", "show", f"{rev}:{rel / name}"], cwd=ROOT, capture_output=True, text=True)
        if text.returncode != 0:
            raise SystemExit(f"git show {rev}:{rel / name} failed: {text.stderr.strip()}")
        (folder / name).write_text(text.stdout)
    try:
        return native.build(folder, sources=folder)
    except RuntimeError as err:
        raise SystemExit(f"the base kernel did not build: {err}") from err


def step_fn(path: Path):
    fn = native.declare(ctypes.CDLL(str(path))).mh_decode_step

    def call(q, k, v, out, threads):
        H, Hkv, L, D = q.shape[1], k.shape[1], k.shape[2], q.shape[3]
        flag = fn(q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3],
                  1, Hkv, H // Hkv, 1, L, D, D ** -0.5, out.data_ptr(), threads, decode._GRAIN)
        if flag != 0:
            raise RuntimeError(f"mh_decode_step returned {flag}")
    return call


def check(builds: dict, H: int, Hkv: int, D: int) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, L, D, generator=g) for n, L in ((H, 1), (Hkv, 300), (Hkv, 300)))
    ref = torch.softmax((q.double() @ k.double().repeat_interleave(H // Hkv, 1).transpose(-1, -2)) * D ** -0.5, -1)
    ref = ref @ v.double().repeat_interleave(H // Hkv, 1)
    for name, call in builds.items():
        out = torch.empty(1, H, 1, D)
        call(q, k, v, out, 1)
        err = float((out.double() - ref).abs().max())
        assert err < 1e-4, f"the {name} kernel is {err:.2e} from the float64 softmax"


def case(builds: dict, geometry: str, L: int, threads: int, args) -> dict:
    H, Hkv, D = GEOMETRIES[geometry]
    kv_bytes = 2 * Hkv * L * D * 4
    layers = max(2, min(args.layers, math.floor(args.max_mib * 2**20 / kv_bytes)))
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(1, Hkv, L, D, generator=g), torch.randn(1, Hkv, L, D, generator=g)) for _ in range(layers)]
    q, out = torch.randn(1, H, 1, D, generator=g), torch.empty(1, H, 1, D)
    torch.set_num_threads(threads)
    times = {name: [] for name in builds}
    for _ in range(args.rounds):
        order = list(builds)
        random.shuffle(order)
        for name in order:
            call = builds[name]
            t = time.perf_counter()
            for k, v in caches:
                call(q, k, v, out, threads)
            times[name].append((time.perf_counter() - t) / layers)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"geometry": LABELS[geometry], "H": H, "Hkv": Hkv, "D": D, "L": L, "threads": threads, "layers": layers,
            "base_us": med["base"] * 1e6, "new_us": med["new"] * 1e6, "new_over_base": med["new"] / med["base"],
            "base_times_s": times["base"], "new_times_s": times["new"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="the git revision whose kernel is the base (default HEAD)")
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 16384])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--layers", type=int, default=30, help="K/V caches read in turn per token (default 30)")
    p.add_argument("--max-mib", type=float, default=1024, help="at most this much K/V per case (at least 2 layers)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="L 64 256, 2 layers, 2 rounds: a smoke run")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "native_ab.json")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.layers, args.rounds = [64, 256], 2, 2
    new = native.build()  # this checkout's sources, as the library itself builds them
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": step_fn(build_base(args.base, Path(tmp))), "new": step_fn(new)}
        for geometry in args.geometries:
            check(builds, *GEOMETRIES[geometry])
        rows = [case(builds, geometry, L, threads, args) for geometry in args.geometries for L in args.lengths
                for threads in args.threads]
    report = {"benchmark": "native_ab", "base": args.base,
              "base_commit": subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, capture_output=True,
                                            text=True).stdout.strip(),
              "rounds": args.rounds, "rows": rows, "machine": machine()}
    m = report["machine"]
    print(f"Native decode kernel, this checkout against {args.base}, {m['cpu']} ({m['cores']} cores), "
          f"{args.rounds} rounds; load {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}\n")
    print("| geometry | L | threads | layers | base us per layer | new us per layer | new / base |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['geometry']} | {r['L']} | {r['threads']} | {r['layers']} | {r['base_us']:.1f} | "
              f"{r['new_us']:.1f} | {r['new_over_base']:.3f} |")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
