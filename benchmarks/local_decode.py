"""One-token decode steps of a sliding-window layer and a soft-capped layer, beside the plain
causal layer (multihead.Attention, fp32, B = 1, CPU).

    .venv/bin/python benchmarks/local_decode.py                # d_model 512, 8 heads, 1024 cached
    .venv/bin/python benchmarks/local_decode.py --quick        # a smoke run

Each layer prefills --context tokens into its own cache (the windowed layer's is a
RollingKVCache of --window slots), then every round times --steps one-token steps of
each layer in a shuffled order. Reported: milliseconds per token (medians over rounds)
and the ratios to the plain layer (medians of per-round ratios). A windowed step attends
at most W keys, so it should cost less than the plain one over the whole context; a
soft-capped step pays for the score mod.

Writes a Markdown table to stdout and JSON to benchmarks/results/local_decode.json (or --json).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multihead as mh  # noqa: E402
from machine_info import machine, write_json  # noqa: E402


def layers(d_model: int, heads: int, window: int, cap: float, context: int) -> dict:
    """name -> (layer, cache), each cache holding `context` prefilled tokens."""
    out = {}
    for name, kw in (("plain", {}), (f"sliding_window={window}", {"sliding_window": window}),
                     (f"softcap={cap:g}", {"softcap": cap})):
        torch.manual_seed(0)
        layer = mh.Attention(d_model, heads, causal=True, **kw).eval()
        cache = layer.new_cache(1, context + 4096)
        with torch.no_grad():
            layer(torch.randn(1, context, d_model), cache=cache)
        out[name] = (layer, cache)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024, help="tokens cached before the timed steps")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--steps", type=int, default=100, help="one-token steps per layer per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--quick", action="store_true", help="64 cached, window 16, 10 steps, 2 rounds")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "local_decode.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.context, args.window, args.steps, args.rounds = 64, 16, 10, 2
    torch.set_num_threads(args.threads)
    random.seed(0)
    started = _dt.datetime.now(_dt.timezone.utc)
    load_start = os.getloadavg()
    cases = layers(args.d_model, args.heads, args.window, args.softcap, args.context)
    x = torch.randn(1, 1, args.d_model)
    ms = {name: [] for name in cases}
    with torch.no_grad():
        for layer, cache in cases.values():  # warm-up
            layer(x, cache=cache)
        for _ in range(args.rounds):
            order = list(cases)
            random.shuffle(order)
            for name in order:
                layer, cache = cases[name]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    layer(x, cache=cache)
                ms[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    median = {name: statistics.median(v) for name, v in ms.items()}
    ratios = {f"{name} / plain": statistics.median(a / b for a, b in zip(v, ms["plain"]))
              for name, v in ms.items() if name != "plain"}
    report = {"meta": {"date": started.isoformat(timespec="seconds"), "machine": machine(),
                       "d_model": args.d_model, "heads": args.heads, "context": args.context, "window": args.window,
                       "softcap": args.softcap, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
                       "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
              "ms_per_token": ms, "median_ms_per_token": median, "ratios": ratios}
    path = write_json(args.json, report)
    print(f"d_model {args.d_model}, {args.heads} heads, {args.context} cached, fp32, {args.threads} threads, "
          f"{args.rounds} rounds of {args.steps} steps")
    print("\n| layer | ms per token | / plain |\n|---|---:|---:|")
    for name, t in median.items():
        r = ratios.get(f"{name} / plain")
        print(f"| {name} | {t:.3f} | {'' if r is None else f'{r:.3f}'} |")
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
