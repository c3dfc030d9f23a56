"""Activation patching of every head: `multihead.heads.patch_scan` against TransformerLens 4
(`transformer_lens.patching.get_act_patch_attn_head_out_all_pos` on a TransformerBridge
wrapping the same transformers model), fp32, CPU.

    .venv/bin/python benchmarks/heads.py            # GPT-2-shaped: 6 layers, 8 heads, C 512, B 4, T 256
    .venv/bin/python benchmarks/heads.py --quick    # a smoke run (2 layers, T 32)

Both sides start from the clean and corrupted token batches and end with the (layers,
heads) table: TransformerLens' time includes its clean `run_with_cache`, multihead's its
clean recording. Rounds interleave the two in a shuffled order; reported are the medians
of the times and of the per-round ratios, the largest difference between the two tables,
and each side's peak resident memory above what it holds before the scan (sampled every
2 ms in a fresh process, after one warm-up scan). TransformerLens runs its models on eager
attention, one forward per head; multihead keeps the fused kernel and starts each variant
at its own layer from the cached corrupted run.

Two pairs of inputs: the IOI-style one (the corrupted batch is the clean one with the token
at T/2 changed), where multihead's variants also skip the shared prefix (positions before
T/2 are the corrupted run's in every variant of a causal model), and the worst case for
that skip, the first token changed (nothing shared). The target (>= 2x) is read on the first.

Writes a Markdown table to stdout and JSON to benchmarks/results/heads.json (or --json).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, write_json  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def setup(layers: int, heads: int, width: int, B: int, T: int, vocab: int, at: int):
    import transformers

    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    cfg = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=max(T, 64),
                                  vocab_size=vocab)
    torch.manual_seed(0)
    ours = transformers.GPT2LMHeadModel(cfg).eval()
    theirs = transformers.GPT2LMHeadModel(copy.deepcopy(cfg)).eval()
    theirs.load_state_dict(ours.state_dict())
    ours.set_attn_implementation("multihead")
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, vocab, (B, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, at] = (clean[:, at] + torch.randint(1, vocab, (B,), generator=g)) % vocab  # one token changed
    answer, wrong = 3, 4

    def metric(logits):
        return (logits[:, -1, answer] - logits[:, -1, wrong]).mean()

    return ours, theirs, clean, corrupted, metric


def tl_bridge(theirs, vocab: int):
    from tokenizers import Tokenizer, models
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab)}}, unk_token="[UNK]")))
    return TransformerBridge.boot_transformers("gpt2", hf_model=theirs, tokenizer=tok)


def run_ours(ours, clean, corrupted, metric):
    from multihead.heads import patch_scan

    return patch_scan(ours, clean, corrupted, metric)


def run_tl(bridge, clean, corrupted, metric):
    from transformer_lens import patching

    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
        return patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, cache, metric)


def _peak(args) -> int:
    """In this (fresh) process: peak RSS bytes of one scan above the model and inputs."""
    ours, theirs, clean, corrupted, metric = setup(args.layers, args.heads, args.width, args.batch, args.tokens,
                                                   args.vocab, args.at)
    if args.peak == "tl":
        bridge = tl_bridge(theirs, args.vocab)
        fn = lambda: run_tl(bridge, clean, corrupted, metric)  # noqa: E731
    else:
        fn = lambda: run_ours(ours, clean, corrupted, metric)  # noqa: E731
    fn()  # warm-up: lazily built state (TransformerLens' hooks, kernels) is not the scan's
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def sample():  # resident memory every 2 ms while the scan runs
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    fn()
    done.set()
    t.join()
    print(json.dumps({"peak_bytes": max(0, max(peak[0], rss()) - base)}))
    return 0


def _case(args, label: str, at: int) -> dict:
    """Both scans of one pair of inputs: rounds in shuffled order, then each side's peak memory."""
    ours, theirs, clean, corrupted, metric = setup(args.layers, args.heads, args.width, args.batch, args.tokens,
                                                   args.vocab, at)
    bridge = tl_bridge(theirs, args.vocab)
    fns = {"multihead": lambda: run_ours(ours, clean, corrupted, metric),
           "transformer_lens": lambda: run_tl(bridge, clean, corrupted, metric)}
    tables = {name: fn() for name, fn in fns.items()}  # warm-up, and the two tables
    diff = (tables["multihead"] - tables["transformer_lens"]).abs().max().item()
    times = {name: [] for name in fns}
    ratios = []
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(fns)
        rng.shuffle(order)
        got = {}
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            got[name] = time.perf_counter() - t0
            times[name].append(got[name])
        ratios.append(got["transformer_lens"] / got["multihead"])
    peaks = {}
    for side, name in (("ours", "multihead"), ("tl", "transformer_lens")):
        cmd = [sys.executable, __file__, "--peak", side, "--layers", str(args.layers), "--heads", str(args.heads),
               "--width", str(args.width), "--batch", str(args.batch), "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--threads", str(args.threads), "--at", str(at)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        try:
            peaks[name] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
        except (ValueError, IndexError, KeyError):
            peaks[name] = None
    return {"inputs": label, "changed_position": at,
            "results": [{"variant": name, "times_s": times[name], "median_s": statistics.median(times[name]),
                         "peak_bytes": peaks[name]} for name in fns],
            "ratios": ratios, "speedup_median": statistics.median(ratios), "max_abs_diff": diff}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 heads, C 64, T 32, 2 rounds")
    ap.add_argument("--peak", choices=["ours", "tl"], help=argparse.SUPPRESS)
    ap.add_argument("--at", type=int, default=0, help=argparse.SUPPRESS)  # the changed position (--peak runs)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "heads.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.heads, args.width, args.tokens, args.rounds, args.vocab = 2, 4, 64, 32, 2, 101
    torch.set_num_threads(args.threads)
    if args.peak:
        return _peak(args)
    try:
        import transformer_lens  # noqa: F401
    except ImportError as err:
        print(f"skipped: TransformerLens is not installed (pip install 'multihead[tl]'): {err}")
        return 0

    cases = [("one token changed at T/2 (IOI-style)", args.tokens // 2), ("first token changed", 0)]
    report = {
        "meta": {**machine(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "loadavg_start": list(os.getloadavg())},
        "config": {"layers": args.layers, "heads": args.heads, "width": args.width, "batch": args.batch,
                   "tokens": args.tokens, "vocab": args.vocab, "rounds": args.rounds, "threads": args.threads,
                   "quick": args.quick},
        "cases": [],
    }
    print(f"patch_scan (z) of {args.layers} x {args.heads} heads, B={args.batch}, T={args.tokens}, "
          f"C={args.width}, {args.threads} thread(s), {args.rounds} rounds")
    print("| inputs | multihead s | TransformerLens s | speedup | multihead peak MiB | TL peak MiB | max diff |")
    print("|---|---|---|---|---|---|---|")
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    for label, at in cases:
        report["cases"].append(case := _case(args, label, at))
        r = {x["variant"]: x for x in case["results"]}
        print(f"| {label} | {r['multihead']['median_s']:.2f} | {r['transformer_lens']['median_s']:.2f} | "
              f"{case['speedup_median']:.2f}x | {mib(r['multihead']['peak_bytes'])} | "
              f"{mib(r['transformer_lens']['peak_bytes'])} | {case['max_abs_diff']:.1e} |")
    report["meta"]["loadavg_end"] = list(os.getloadavg())
    ioi, worst = report["cases"]
    report["targets"] = [
        {"target": ">= 2x faster than TransformerLens (IOI-style inputs)", "passed": ioi["speedup_median"] >= 2.0,
         "detail": f"median ratio {ioi['speedup_median']:.2f}; with the first token changed (no shared prefix) "
                   f"{worst['speedup_median']:.2f}"},
        {"target": "same numbers (1e-4)", "passed": max(c["max_abs_diff"] for c in report["cases"]) < 1e-4,
         "detail": f"max diff {max(c['max_abs_diff'] for c in report['cases']):.2e}"},
    ]
    print("Targets: " + "; ".join(f"{t['target']}: {'met' if t['passed'] else 'NOT met'} ({t['detail']})"
                                  for t in report["targets"]))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
