"""Block-sparse masks and score mods, side by side: multihead vs torch's fused kernel, the
dense-mask path and compiled flex_attention (CPU, fp32, B = 1, H = 8, D = 64).

    .venv/bin/python benchmarks/masks.py                      # N = 16384, softcap 4096, train 8192
    .venv/bin/python benchmarks/masks.py --n 8192 --n-train 4096 --threads 2
    .venv/bin/python benchmarks/masks.py --quick              # N = 512: smoke test
    .venv/bin/python benchmarks/masks.py --no-flex            # skip torch.compile
    .venv/bin/python benchmarks/masks.py --scaling-only --rounds 7   # window at 1 and 2 threads vs flex only

Rows (forward unless "fwd+bwd"):

- masks at N: `sliding_window(256) & causal` and `document` (8 documents of N/8) & causal,
  and 8 documents of random lengths & causal (multihead only; its ideal is the fraction of
  causal's pairs they allow, printed beside it),
  each run by multihead (block-sparse, "auto"), by the dense path (the same predicate
  materialised as a (T, S) bool tensor, as multihead did before, then the fused kernel),
  and by `torch.compile(flex_attention)` with a block mask; "setup" is the tile
  classification alone (multihead) or `create_block_mask` (flex, eager, as users call
  it); flex's compile time (first call) is reported separately and excluded.
- causal at N: multihead's tile scheme (`masks.causal()`) vs torch's fused causal call
  (`is_causal=True`) and the fused non-causal call (ideal causal fraction: 0.5).
- softcap(50) at --n-softcap: multihead (tile engine) vs the fused kernel without a
  score mod, vs compiled flex with the same score_mod.
- fwd+bwd at --n-train, causal: softcap and dropout 0.1 through multihead ("auto": the
  tile engine), vs the fused causal fwd+bwd without them; peak memory against the math
  path with the same options.

Time: every round runs each variant once in a shuffled order; medians over rounds, and
ratios as medians of the per-round ratios (cancels slow drifts of a shared machine's
load). Memory: each case runs once more in a fresh process; "peak" is the high-water RSS
during the call (reset through /proc/self/clear_refs) minus the RSS with inputs allocated.

Writes a Markdown table to stdout and JSON to benchmarks/results/masks.json (or --json).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multihead as mh  # noqa: E402
from machine_info import machine, plan_choices, write_json  # noqa: E402
from multihead import masks, score_mods  # noqa: E402
from multihead.kernels import planner  # noqa: E402

H, D, WINDOW, DOCS, CAP = 8, 64, 256, 8, 50.0


# ----------------------------------------------------------------------- cases


def _inputs(N: int, grad: bool = False):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, H, N, D, generator=g).requires_grad_(grad) for _ in range(3))


def _window():
    return masks.sliding_window(WINDOW) & masks.causal()


def _document(N: int):
    return masks.document(torch.arange(N) // (N // DOCS)) & masks.causal()


def _uneven_ids(N: int) -> torch.Tensor:
    """DOCS packed documents of random lengths (fixed seed), as a data loader packs them."""
    g = torch.Generator().manual_seed(1)
    cuts = torch.zeros(N, dtype=torch.long)
    cuts[torch.randperm(N - 1, generator=g)[:DOCS - 1] + 1] = 1
    return cuts.cumsum(0)


def uneven_pair_fraction(N: int) -> float:
    """Allowed pairs of the uneven documents & causal over those of causal."""
    lengths = torch.bincount(_uneven_ids(N)).double()
    return float((lengths * (lengths + 1)).sum() / (N * (N + 1)))


def _flex_mods(N: int):
    ids = torch.arange(N) // (N // DOCS)

    def window(b, h, q, kv):
        return (kv <= q) & (q - kv < WINDOW)

    def document(b, h, q, kv):
        return (kv <= q) & (ids[q] == ids[kv])

    def softcap(score, b, h, q, kv):
        return torch.tanh(score / CAP) * CAP

    return {"window": window, "document": document, "softcap": softcap}


def forward_cases(N: int) -> dict:
    """name -> zero-argument callable (inputs captured), all under torch.no_grad."""
    q, k, v = _inputs(N)
    win, doc = _window(), _document(N)
    uneven = masks.document(_uneven_ids(N)) & masks.causal()
    return {
        "torch causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "torch full": lambda: F.scaled_dot_product_attention(q, k, v),
        "multihead causal": lambda: mh.scaled_dot_product_attention(q, k, v, masks.causal()),
        "multihead window": lambda: mh.scaled_dot_product_attention(q, k, v, win),
        "multihead document": lambda: mh.scaled_dot_product_attention(q, k, v, doc),
        "multihead uneven documents": lambda: mh.scaled_dot_product_attention(q, k, v, uneven),
        "dense window": lambda: mh.scaled_dot_product_attention(q, k, v, win.to_dense(1, H, N, N)),
        "dense document": lambda: mh.scaled_dot_product_attention(q, k, v, doc.to_dense(1, H, N, N)),
        "setup window": lambda: planner.choose_tile(win, 1, H, N, N, 1, None, "cpu"),
        "setup document": lambda: planner.choose_tile(doc, 1, H, N, N, 1, None, "cpu"),
    }


def softcap_cases(N: int) -> dict:
    q, k, v = _inputs(N)
    return {
        "torch full (no mod)": lambda: F.scaled_dot_product_attention(q, k, v),
        "multihead softcap": lambda: mh.scaled_dot_product_attention(q, k, v, score_mod=score_mods.softcap(CAP)),
    }


def train_cases(N: int) -> dict:
    q, k, v = _inputs(N, grad=True)

    def step(fn):
        def run():
            out = fn()
            out.sum().backward()
            q.grad = k.grad = v.grad = None
        return run

    cap = score_mods.softcap(CAP)
    return {
        "torch causal fwd+bwd": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "multihead softcap fwd+bwd": step(lambda: mh.scaled_dot_product_attention(q, k, v, causal=True,
                                                                                  score_mod=cap)),
        "multihead dropout fwd+bwd": step(lambda: mh.scaled_dot_product_attention(q, k, v, causal=True,
                                                                                  dropout_p=0.1)),
        "torch dropout fwd+bwd": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                             dropout_p=0.1)),
        "math softcap fwd+bwd": step(lambda: mh.scaled_dot_product_attention(q, k, v, causal=True, score_mod=cap,
                                                                             backend="math")),
        "math dropout fwd+bwd": step(lambda: mh.scaled_dot_product_attention(q, k, v, causal=True, dropout_p=0.1,
                                                                             backend="math")),
    }


def flex_cases(N: int, N_softcap: int) -> tuple[dict, dict]:
    """Compiled flex callables and what their setup cost: (cases, {name: seconds})."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mods = _flex_mods(N)
    compiled = torch.compile(flex_attention)
    q, k, v = _inputs(N)
    qs, ks, vs = _inputs(N_softcap)
    setup, cases = {}, {}
    for name in ("window", "document"):
        t0 = time.perf_counter()
        bm = create_block_mask(mods[name], 1, 1, N, N, device="cpu")
        setup[f"flex {name} create_block_mask"] = time.perf_counter() - t0
        cases[f"flex {name}"] = lambda bm=bm: compiled(q, k, v, block_mask=bm)
    cases["flex softcap"] = lambda: compiled(qs, ks, vs, score_mod=mods["softcap"])
    # multihead's opt-in backend="flex": the same compiled kernel behind multihead's own masks
    win, cap = _window(), score_mods.softcap(CAP)
    cases["multihead backend=flex window"] = lambda: mh.scaled_dot_product_attention(q, k, v, win, backend="flex")
    cases["multihead backend=flex softcap"] = lambda: mh.scaled_dot_product_attention(qs, ks, vs, score_mod=cap,
                                                                                       backend="flex")
    for name, fn in cases.items():
        t0 = time.perf_counter()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
        setup[f"{name} compile (first call)"] = time.perf_counter() - t0
    return cases, setup


# ------------------------------------------------------------------- measuring


def time_rounds(cases: dict, rounds: int, grad: bool = False) -> dict:
    times = {name: [] for name in cases}
    for fn in cases.values():  # warm-up
        with torch.set_grad_enabled(grad):
            fn()
    for _ in range(rounds):
        order = list(cases)
        random.shuffle(order)
        for name in order:
            with torch.set_grad_enabled(grad):
                t0 = time.perf_counter()
                cases[name]()
                times[name].append(time.perf_counter() - t0)
            print(f"  {name}: {times[name][-1]:.3f} s", file=sys.stderr, flush=True)
    return times


def ratio(times: dict, a: str, b: str) -> float | None:
    if a not in times or b not in times:
        return None
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


_CHILD = """
import json, sys, torch
sys.path.insert(0, {bench!r})
torch.set_num_threads({threads})
import masks as bench
group, name, N = sys.argv[1], sys.argv[2], int(sys.argv[3])
cases = getattr(bench, group)(N)

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

grad = group == "train_cases"
with torch.set_grad_enabled(grad):
    getattr(bench, group)(256)[name]()  # warm-up: lazy imports, allocator, thread pool
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = kib("VmRSS:")
    cases[name]()
    print(json.dumps((kib("VmHWM:") - base) / 1024))
"""


def peak_mib(group: str, name: str, N: int, threads: int) -> float | None:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return None
    code = _CHILD.format(bench=str(Path(__file__).resolve().parent), threads=threads)
    run = subprocess.run([sys.executable, "-c", code, group, name, str(N)], capture_output=True, text=True,
                         timeout=1800)
    if run.returncode != 0:
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------- threads: scaling


def scaling_cases(N: int, flex: bool) -> dict:
    """`sliding_window(256) & causal` at N: multihead's public call (the engine this process
    timed faster, `kernels.band`: its own band kernel or the fused tile engine), the fused tile
    engine (bands: alike query blocks in one call; its plan kept from call to call), the same
    planning every call (`planner._PLANS_KEPT = 0`: the tile search and the walk over the
    tiles, on one thread, each call), the fused engine block by block (`fused_tiles.BANDS =
    False`: one call per query block, as before bands), the fused engine with a new output
    every call (`fused_tiles.KEEP_OUTPUT = False`: 32 MiB faulted in page by page, where the
    kept output's pages are warm) and compiled flex_attention (its block mask made once,
    outside the timing), at this process's thread count."""
    from multihead.kernels import fused_tiles

    q, k, v = _inputs(N)
    win = _window()

    def fused_with(module=None, name: str = "", value=None):
        """The window call on the fused tile engine, with `module.<name>` set to `value` for its
        duration (then as it was); what the process timed is kept."""
        def call():
            kept = getattr(module, name) if module is not None else None
            if module is not None:
                setattr(module, name, value)
            try:
                with plan_choices(band_engine="fused"):
                    return mh.scaled_dot_product_attention(q, k, v, win)
            finally:
                if module is not None:
                    setattr(module, name, kept)
        return call

    cases = {"multihead window": lambda: mh.scaled_dot_product_attention(q, k, v, win),
             "multihead window, fused tile engine": fused_with(),
             "fused tile engine, plan each call": fused_with(planner, "_PLANS_KEPT", 0),
             "fused tile engine, block by block": fused_with(fused_tiles, "BANDS", False),
             "fused tile engine, new output each call": fused_with(fused_tiles, "KEEP_OUTPUT", False)}
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        bm = create_block_mask(_flex_mods(N)["window"], 1, 1, N, N, device="cpu")
        compiled = torch.compile(flex_attention)
        cases["flex window"] = lambda: compiled(q, k, v, block_mask=bm)
    return cases


def call_profile(fn) -> dict:
    """One call of `fn` with the fused engine's kernel calls and merges timed: how many kernel
    calls, their (q, k, mask) shapes, wall seconds in the kernel, in the log-sum-exp merges,
    and in the rest (plan, masks, copies into the output, the NaN check, Python between
    calls), and the page faults of the call (`minor_faults`: 8,192 are a new 32 MiB output)."""
    from multihead.kernels import fused_tiles

    calls, spent = {}, {"kernel_s": 0.0, "merge_s": 0.0}
    real_kernel, real_merge = fused_tiles.flash_lse, fused_tiles.lse_merge

    def kernel(q, k, v, **kw):
        t0 = time.perf_counter()
        result = real_kernel(q, k, v, **kw)
        spent["kernel_s"] += time.perf_counter() - t0
        mask = kw.get("mask")
        key = f"q {tuple(q.shape)} k {tuple(k.shape)} causal={kw['causal']} " \
              f"mask {None if mask is None else tuple(mask.shape)}"
        calls[key] = calls.get(key, 0) + 1
        return result

    def merge(parts, *args):
        t0 = time.perf_counter()
        result = real_merge(parts, *args)
        if len(parts) > 1:
            spent["merge_s"] += time.perf_counter() - t0
        return result

    fused_tiles.flash_lse, fused_tiles.lse_merge = kernel, merge
    try:
        with torch.no_grad():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn()
            total = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    finally:
        fused_tiles.flash_lse, fused_tiles.lse_merge = real_kernel, real_merge
    return {"calls": sum(calls.values()), "shapes": calls, "total_s": total, **spent,
            "rest_s": total - spent["kernel_s"] - spent["merge_s"], "minor_faults": faults}


def scaling_worker(threads: int, N: int, flex: bool) -> int:
    """A worker at `threads` torch threads: reads commands from stdin, one JSON line back for
    each. "round": every case once, shuffled: {name: [wall s, process cpu s]}; "profile":
    `call_profile` of multihead's two engines; "quit"."""
    torch.set_num_threads(threads)
    random.seed(threads)
    cases = scaling_cases(N, flex)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_s = {}
        for name, fn in cases.items():  # warm-up; flex compiles here
            t0 = time.perf_counter()
            fn()
            compile_s[name] = time.perf_counter() - t0
        print(json.dumps({"ready": threads, "first_call_s": compile_s}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "round":
                order = list(cases)
                random.shuffle(order)
                result = {}
                for name in order:
                    t0, c0 = time.perf_counter(), time.process_time()
                    cases[name]()
                    result[name] = [time.perf_counter() - t0, time.process_time() - c0]
                print(json.dumps(result), flush=True)
            elif cmd == "profile":
                profile = {name: call_profile(cases[name]) for name in (
                    "multihead window", "multihead window, fused tile engine", "fused tile engine, block by block",
                    "fused tile engine, new output each call")}
                print(json.dumps(profile), flush=True)
            else:
                return 0
    return 0


def run_scaling(N: int, rounds: int, thread_counts=(1, 2), flex: bool = True) -> dict:
    """One worker process per thread count (flex's compiled kernel keeps the thread count it
    was compiled at), driven round by round in turn: round r runs every case at every thread
    count before round r + 1 starts, so a drift of the machine's load hits all alike. Ratios
    are medians of per-round ratios: multihead / flex at each thread count, and each case's
    speed-up from 1 thread to the others."""
    here = str(Path(__file__).resolve())
    workers = {}
    for t in thread_counts:
        env = dict(os.environ, OMP_NUM_THREADS=str(t))
        cmd = [sys.executable, here, "--scaling-worker", str(t), "--n", str(N)] + ([] if flex else ["--no-flex"])
        workers[t] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready = {t: json.loads(w.stdout.readline()) for t, w in workers.items()}
        times = {t: {} for t in thread_counts}
        loads = []
        for _ in range(rounds):
            loads.append(os.getloadavg()[0])
            for t, w in workers.items():
                w.stdin.write("round\n")
                w.stdin.flush()
                for name, (wall, cpu) in json.loads(w.stdout.readline()).items():
                    times[t].setdefault(name, {"wall_s": [], "cpu_s": []})
                    times[t][name]["wall_s"].append(wall)
                    times[t][name]["cpu_s"].append(cpu)
        profiles = {}
        for t, w in workers.items():
            w.stdin.write("profile\n")
            w.stdin.flush()
            profiles[t] = json.loads(w.stdout.readline())
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.stdin.write("quit\n")
                w.stdin.flush()
                w.wait(timeout=60)

    def per_round(a, b):
        return statistics.median(x / y for x, y in zip(a, b))

    ratios, cpu_ratios = {}, {}
    names = list(times[thread_counts[0]])
    for t in thread_counts:
        tt = times[t]
        for name in names:
            if name != "flex window" and "flex window" in tt:
                ratios[f"{name} / flex window, {t} threads"] = per_round(tt[name]["wall_s"],
                                                                         tt["flex window"]["wall_s"])
                cpu_ratios[f"{name} / flex window, {t} threads"] = per_round(tt[name]["cpu_s"],
                                                                             tt["flex window"]["cpu_s"])
        if t != thread_counts[0]:
            for name in names:
                base = times[thread_counts[0]][name]
                ratios[f"{name}: speed-up {thread_counts[0]} -> {t} threads"] = per_round(base["wall_s"],
                                                                                          tt[name]["wall_s"])
                # CPU seconds at t threads over 1 thread's: t is perfect scaling (every thread busy,
                # no spinning); a busy machine's stolen time adds wall time but not CPU time
                cpu_ratios[f"{name}: CPU s {t} threads / {thread_counts[0]} thread"] = per_round(
                    tt[name]["cpu_s"], base["cpu_s"])
    return {"N": N, "rounds": rounds, "threads": list(thread_counts), "loadavg_1min_per_round": loads,
            "first_call_s": {t: r["first_call_s"] for t, r in ready.items()},
            "times": times, "median_wall_s": {t: {n: statistics.median(v["wall_s"]) for n, v in tt.items()}
                                              for t, tt in times.items()},
            "median_cpu_s": {t: {n: statistics.median(v["cpu_s"]) for n, v in tt.items()} for t, tt in times.items()},
            "ratios": ratios, "cpu_ratios": cpu_ratios, "profiles": profiles}


def print_scaling(sc: dict) -> None:
    print(f"\nthread scaling, sliding_window({WINDOW}) & causal, N={sc['N']}, {sc['rounds']} rounds, "
          f"load per round {', '.join(f'{x:.1f}' for x in sc['loadavg_1min_per_round'])}")
    print("\n| case | " + " | ".join(f"{t} thr. median s" for t in sc["threads"]) + " |\n|---|"
          + "---:|" * len(sc["threads"]))
    for name in sc["median_wall_s"][sc["threads"][0]]:
        print(f"| {name} | " + " | ".join(f"{sc['median_wall_s'][t][name]:.3f}" for t in sc["threads"]) + " |")
    print("\n| ratio (median of per-round ratios) | value |\n|---|---:|")
    for name, r in sc["ratios"].items():
        print(f"| {name} | {r:.3f} |")
    print("\n| CPU-time ratio (median of per-round ratios) | value |\n|---|---:|")
    for name, r in sc.get("cpu_ratios", {}).items():
        print(f"| {name} | {r:.3f} |")
    print("\n| profile (one call) | threads | kernel calls | kernel s | merges s | rest s | page faults |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for t, prof in sc["profiles"].items():
        for name, p in prof.items():
            print(f"| {name} | {t} | {p['calls']} | {p['kernel_s']:.3f} | {p['merge_s']:.3f} | {p['rest_s']:.3f} "
                  f"| {p.get('minor_faults', '')} |")


# ------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=16384, help="sequence length of the mask and causal rows")
    ap.add_argument("--n-softcap", type=int, default=4096, help="sequence length of the softcap row")
    ap.add_argument("--n-train", type=int, default=8192, help="sequence length of the fwd+bwd rows")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (medians are reported)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    ap.add_argument("--no-flex", action="store_true", help="skip torch.compile(flex_attention)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    ap.add_argument("--quick", action="store_true", help="N = 512 everywhere, one round, no flex: a smoke run")
    ap.add_argument("--scaling-threads", default="1,2",
                    help="thread counts of the scaling rows (window at N, one process each); '' skips them")
    ap.add_argument("--scaling-only", action="store_true",
                    help="run only the scaling rows, written into the JSON's 'scaling' (the rest kept)")
    ap.add_argument("--scaling-worker", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "masks.json"),
                    help="where to write the JSON results")
    args = ap.parse_args(argv)
    if args.scaling_worker:
        return scaling_worker(args.scaling_worker, args.n, not args.no_flex)
    if args.quick:
        args.n = args.n_softcap = args.n_train = 512
        args.rounds, args.no_flex = 1, True
    thread_counts = tuple(int(t) for t in args.scaling_threads.split(",") if t.strip())
    if args.scaling_only:
        started = _dt.datetime.now(_dt.timezone.utc)
        sc = run_scaling(args.n, args.rounds, thread_counts, not args.no_flex)
        sc.update(date=started.isoformat(timespec="seconds"), machine=machine())
        report = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        report["scaling"] = sc
        path = write_json(args.json, report)
        print_scaling(sc)
        print(f"\nJSON: {path}")
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    random.seed(0)
    load_start = os.getloadavg()
    started = _dt.datetime.now(_dt.timezone.utc)

    fwd = forward_cases(args.n)
    soft = softcap_cases(args.n_softcap)
    setup = {}
    if not args.no_flex:
        flex, setup = flex_cases(args.n, args.n_softcap)
        for name, fn in flex.items():
            (soft if name.endswith("softcap") else fwd)[name] = fn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_fwd = time_rounds(fwd, args.rounds)
        t_soft = time_rounds(soft, args.rounds)
        t_train = time_rounds(train_cases(args.n_train), args.rounds, grad=True)

    memory = {}
    if not args.no_memory:
        for group, name, N in [("forward_cases", "multihead window", args.n), ("forward_cases", "dense window", args.n),
                               ("forward_cases", "multihead document", args.n),
                               ("softcap_cases", "multihead softcap", args.n_softcap),
                               ("softcap_cases", "torch full (no mod)", args.n_softcap),
                               ("train_cases", "torch causal fwd+bwd", args.n_train),
                               ("train_cases", "multihead softcap fwd+bwd", args.n_train),
                               ("train_cases", "multihead dropout fwd+bwd", args.n_train),
                               ("train_cases", "math softcap fwd+bwd", args.n_train),
                               ("train_cases", "math dropout fwd+bwd", args.n_train)]:
            memory[name] = peak_mib(group, name, N, args.threads)

    med = {name: statistics.median(ts) for t in (t_fwd, t_soft, t_train) for name, ts in t.items()}
    ratios = {
        "window / torch causal": ratio(t_fwd, "multihead window", "torch causal"),
        "window / flex window": ratio(t_fwd, "multihead window", "flex window"),
        "window / dense window": ratio(t_fwd, "multihead window", "dense window"),
        "document / torch causal": ratio(t_fwd, "multihead document", "torch causal"),
        "document / flex document": ratio(t_fwd, "multihead document", "flex document"),
        "uneven documents / torch causal": ratio(t_fwd, "multihead uneven documents", "torch causal"),
        "uneven documents: allowed pairs / causal's": uneven_pair_fraction(args.n),
        "window setup / window": ratio(t_fwd, "setup window", "multihead window"),
        "document setup / document": ratio(t_fwd, "setup document", "multihead document"),
        "multihead causal / torch causal": ratio(t_fwd, "multihead causal", "torch causal"),
        "multihead causal / torch full": ratio(t_fwd, "multihead causal", "torch full"),
        "torch causal / torch full": ratio(t_fwd, "torch causal", "torch full"),
        "softcap / fused no mod": ratio(t_soft, "multihead softcap", "torch full (no mod)"),
        "flex softcap / fused no mod": ratio(t_soft, "flex softcap", "torch full (no mod)"),
        "backend=flex window / window": ratio(t_fwd, "multihead backend=flex window", "multihead window"),
        "backend=flex softcap / softcap": ratio(t_soft, "multihead backend=flex softcap", "multihead softcap"),
        "softcap fwd+bwd / fused causal fwd+bwd": ratio(t_train, "multihead softcap fwd+bwd", "torch causal fwd+bwd"),
        "dropout fwd+bwd / fused causal fwd+bwd": ratio(t_train, "multihead dropout fwd+bwd", "torch causal fwd+bwd"),
    }
    for a, b in (("multihead softcap fwd+bwd", "math softcap fwd+bwd"),
                 ("multihead dropout fwd+bwd", "math dropout fwd+bwd")):
        if memory.get(a) is not None and memory.get(b):
            ratios[f"memory {a} / {b}"] = memory[a] / memory[b]

    scaling = None
    if thread_counts:
        scaling = run_scaling(args.n, args.rounds, thread_counts, not args.no_flex)
        scaling.update(date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine=machine())

    report = {
        "meta": {"date": started.isoformat(timespec="seconds"), "machine": machine(), "B": 1, "H": H, "D": D,
                 "dtype": "float32", "N": args.n, "N_softcap": args.n_softcap, "N_train": args.n_train,
                 "rounds": args.rounds, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                 "window": WINDOW, "documents": DOCS, "softcap": CAP},
        "times_s": {n: ts for t in (t_fwd, t_soft, t_train) for n, ts in t.items()},
        "median_s": med, "setup_s": setup, "peak_mib": memory, "ratios": ratios, "scaling": scaling,
    }
    path = write_json(args.json, report)

    print(f"B=1 H={H} D={D} fp32, {args.threads} threads, N={args.n} (softcap {args.n_softcap}, "
          f"train {args.n_train}), {args.rounds} rounds, load {load_start[0]:.1f}->{os.getloadavg()[0]:.1f}")
    print("\n| case | median s | peak MiB |\n|---|---:|---:|")
    for name, t in med.items():
        peak = memory.get(name)
        print(f"| {name} | {t:.3f} | {'' if peak is None else f'{peak:.0f}'} |")
    if setup:
        print("\n| flex setup | s |\n|---|---:|")
        for name, t in setup.items():
            print(f"| {name} | {t:.2f} |")
    print("\n| ratio (median of per-round ratios) | value |\n|---|---:|")
    for name, r in ratios.items():
        if r is not None:
            print(f"| {name} | {r:.3f} |")
    if scaling is not None:
        print_scaling(scaling)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
