"""Block-sparse masks and score mods, side by side: multihead vs torch's fused kernel, the
dense-mask path and compiled flex_attention (CPU, fp32, B = 1, H = 8, D = 64).

    .venv/bin/python benchmarks/masks.py                      # N = 16384, softcap 4096, train 8192
    .venv/bin/python benchmarks/masks.py --n 8192 --n-train 4096 --threads 2
    .venv/bin/python benchmarks/masks.py --quick              # N = 512: smoke test
    .venv/bin/python benchmarks/masks.py --no-flex            # skip torch.compile

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
from machine_info import machine, write_json  # noqa: E402
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
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "masks.json"),
                    help="where to write the JSON results")
    args = ap.parse_args(argv)
    if args.quick:
        args.n = args.n_softcap = args.n_train = 512
        args.rounds, args.no_flex = 1, True
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

    report = {
        "meta": {"date": started.isoformat(timespec="seconds"), "machine": machine(), "B": 1, "H": H, "D": D,
                 "dtype": "float32", "N": args.n, "N_softcap": args.n_softcap, "N_train": args.n_train,
                 "rounds": args.rounds, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                 "window": WINDOW, "documents": DOCS, "softcap": CAP},
        "times_s": {n: ts for t in (t_fwd, t_soft, t_train) for n, ts in t.items()},
        "median_s": med, "setup_s": setup, "peak_mib": memory, "ratios": ratios,
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
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
