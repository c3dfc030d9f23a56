"""Every head of SmolLM2-135M at long context: `multihead.inspect.summaries` (all 30 layers x 9
heads, top-8 keys per query) against one plain forward of the same text on sdpa, fp32, CPU.

    .venv/bin/python benchmarks/long_context.py                    # N = 512 ... 8192
    .venv/bin/python benchmarks/long_context.py --sizes 512 1024   # a shorter curve

For each N the text is the first N tokens of the bundled KJV. Each measurement runs in a
fresh process (the model loaded from `load_model("smollm2")`, one warm-up call at 64
tokens first, so lazily built state is not counted): the wall time of the call, and the
peak resident memory above what the process held just before it (sampled every 5 ms), i.e.
above the loaded model. The plain forward is `model(input_ids, logits_to_keep=1)` on
attn_implementation="sdpa" (the last position's logits only, as a prefill computes them);
summaries run on "multihead" and stop inside the last layer. Targets: peak above the model
<= 1.5 GB at every N, time <= 3x the plain forward.

The machine is shared: the load average at the start and the end of each measurement is
recorded beside it, and times on a busy machine are slower and noisier for both sides.

Writes a Markdown table to stdout and JSON to benchmarks/results/long_context.json (or --json).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, write_json  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TARGET_PEAK = 1.5e9
TARGET_RATIO = 3.0


def _load() -> float:
    return os.getloadavg()[0]


def _one(args) -> int:
    """In this (fresh) process: one measurement of `args.what` at N = args.one; prints JSON."""
    import torch

    from multihead.corpus import load_corpus
    from multihead.inspect import summaries
    from multihead.interop.loaders import load_model

    torch.set_num_threads(args.threads)
    lm = load_model("smollm2")
    text, _ = load_corpus(max_chars=12 * args.one)
    ids = lm.encode(text)[:args.one]
    assert len(ids) == args.one, f"the corpus gave {len(ids)} tokens, fewer than {args.one}"
    model = lm.model
    x = torch.tensor([ids])

    if args.what == "sdpa":
        model.set_attn_implementation("sdpa")

        def fn(t):
            with torch.no_grad():
                model(input_ids=t, logits_to_keep=1)
        fn(x[:, :64])
        call = lambda: fn(x)  # noqa: E731
    else:
        summaries(lm, ids[:64], progress=False)
        kw = {} if args.block_elements is None else {"block_elements": args.block_elements}
        call = lambda: summaries(lm, ids, progress=False, **kw)  # noqa: E731

    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)
    th = threading.Thread(target=sample, daemon=True)
    load0 = _load()
    th.start()
    t0, c0 = time.perf_counter(), time.process_time()
    out = call()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    done.set()
    th.join()
    above = max(0, max(peak[0], rss()) - base)
    result = {"what": args.what, "N": args.one, "wall_s": wall, "cpu_s": cpu, "peak_above_model_bytes": above,
              "model_rss_bytes": base, "load_start": load0, "load_end": _load()}
    if args.what == "summaries":
        result["heads"] = len(out.layers) * len(out.heads)
        result["top_k_bytes"] = out.top_index.numel() * 4 + out.top_weight.numel() * 2
    print(json.dumps(result))
    return 0


def _measure(args, what: str, N: int) -> dict:
    cmd = [sys.executable, __file__, "--one", str(N), "--what", what, "--threads", str(args.threads)]
    if args.block_elements is not None:
        cmd += ["--block-elements", str(args.block_elements)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        return {"what": what, "N": N, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-elements", type=int, help="summaries' block_elements (default: the library's)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved sdpa / summaries rounds per N (median ratio)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per measurement")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--what", choices=["sdpa", "summaries"], help=argparse.SUPPRESS)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "long_context.json"))
    args = ap.parse_args(argv)
    if args.one is not None:
        return _one(args)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for N in args.sizes:
        rounds = []
        for _ in range(args.rounds):  # interleaved: each round's ratio pairs two neighbouring runs
            plain = _measure(args, "sdpa", N)
            summ = _measure(args, "summaries", N)
            rounds.append({"sdpa": plain, "summaries": summ})
        good = [r for r in rounds if "error" not in r["sdpa"] and "error" not in r["summaries"]]
        row = {"N": N, "sdpa": rounds[-1]["sdpa"], "summaries": rounds[-1]["summaries"], "rounds": rounds}
        if good:
            ratios = sorted(r["summaries"]["wall_s"] / r["sdpa"]["wall_s"] for r in good)
            cpu = sorted(r["summaries"]["cpu_s"] / r["sdpa"]["cpu_s"] for r in good)
            row["ratio"] = ratios[len(ratios) // 2]  # the median round
            row["cpu_ratio"] = cpu[len(cpu) // 2]
            row["ratio_range"] = [ratios[0], ratios[-1]]
            row["peak_ok"] = max(r["summaries"]["peak_above_model_bytes"] for r in good) <= TARGET_PEAK
            row["ratio_ok"] = row["ratio"] <= TARGET_RATIO
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        report = {"meta": {"started": started, "machine": machine(),
                           "model": "smollm2 (SmolLM2-135M-Instruct, fp32)",
                           "note": "shared machine: see load_start / load_end of each measurement"},
                  "config": {"sizes": args.sizes, "threads": args.threads, "rounds": args.rounds, "top_k": 8,
                             "block_elements": args.block_elements,
                             "heads": "all 30 x 9"},
                  "targets": {"peak_above_model_bytes": TARGET_PEAK, "ratio_to_sdpa_forward": TARGET_RATIO},
                  "cases": rows}
        write_json(args.json, report)  # after every size: a long run that is stopped keeps what it measured
    print("| N | sdpa forward (s) | summaries (s) | ratio (wall) | ratio (CPU) | peak above model, summaries (MiB) | "
          "peak above model, sdpa (MiB) | load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, s = r["sdpa"], r["summaries"]
        if "ratio" not in r:
            print(f"| {r['N']} | {p.get('error', '')} | {s.get('error', '')} | | | | | |")
            continue
        print(f"| {r['N']} | {p['wall_s']:.1f} | {s['wall_s']:.1f} | {r['ratio']:.2f} | {r['cpu_ratio']:.2f} | "
              f"{s['peak_above_model_bytes'] / 2**20:.0f} | {p['peak_above_model_bytes'] / 2**20:.0f} | "
              f"{s['load_start']:.1f}-{s['load_end']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
