"""Per-head summaries (`multihead.inspect.summaries`) of Gemma 3 270M over long texts of the
KJV (`<bos>` first): the peak resident memory above the loaded model, and the time.

    .venv/bin/python benchmarks/gemma3_summaries.py --tokens 2048            # a smoke run
    .venv/bin/python benchmarks/gemma3_summaries.py --tokens 32768 --threads 1   # the full context (slow)

Each length runs in a fresh process (this script again, with --one), so one length's freed
heap does not count against the next: the model is loaded, the peak resident set is reset
(writing 5 to /proc/self/clear_refs, where allowed) and the resident size read, then
`summaries(loaded, text, max_tokens=T)` runs on every head (top-8 keys, no patterns); the
peak above the model is VmHWM after the call minus VmRSS before it (what torch allocates
outside Python's heap, which tracemalloc does not see, included), with the resident size
sampled every second beside it (where in the pass the peak lies; every 10th sample kept, and
those within 10% of the largest). Reported beside it: wall
and CPU seconds, the load average before and after, and a few of the summaries (per kind of
layer: entropy, mean distance, first-token mass), so a run can be checked against the
8,192-token table of docs/gemma3.md.

Writes a Markdown table to stdout and JSON to benchmarks/results/gemma3_summaries.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, reset_peak_rss, status_kib, write_json  # noqa: E402

GLOBAL_EVERY = 6  # Gemma 3: every 6th layer (5, 11, 17) attends globally, the others through the window


def one(tokens: int, threads: int) -> dict:
    """One length in this process: the model loaded, the peak reset, the summaries."""
    import gc

    import torch

    torch.set_num_threads(threads)
    from multihead.corpus import split_kjv
    from multihead.inspect import summaries
    from multihead.interop.loaders import load_model

    loaded = load_model("gemma3")
    train, _ = split_kjv()
    ids = loaded.tokenizer(train[: 8 * tokens])["input_ids"][:tokens]  # <bos> first
    if len(ids) < tokens:
        raise SystemExit(f"the KJV's first {8 * tokens} characters give {len(ids)} tokens; asked {tokens}")
    gc.collect()
    load_before = os.getloadavg()
    base = status_kib("VmRSS")
    known = reset_peak_rss()
    trace: list[tuple[float, float]] = []  # (seconds, MiB above the model) every second: where the peak lies
    running = threading.Event()
    running.set()

    def sample() -> None:
        while running.is_set():
            trace.append((round(time.perf_counter() - t0, 1), round((status_kib("VmRSS") - base) / 1024, 1)))
            time.sleep(1.0)

    t0, c0 = time.perf_counter(), time.process_time()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    s = summaries(loaded, ids, progress=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = status_kib("VmHWM") if known else None
    running.clear()
    sampler.join()
    L = s.entropy.shape[0]
    kinds = {"windowed": [i for i in range(L) if (i + 1) % GLOBAL_EVERY],
             "global": [i for i in range(L) if (i + 1) % GLOBAL_EVERY == 0]}
    means = {kind: {name: float(getattr(s, name)[rows].mean()) for name in
                    ("entropy", "mean_distance", "first_token_mass")} for kind, rows in kinds.items()}
    return {"tokens": tokens, "threads": threads, "ids_start_with_bos": ids[0] == loaded.tokenizer.bos_token_id,
            "wall_s": wall, "cpu_s": cpu, "model_rss_mib": None if base is None else base / 1024,
            "peak_mib_above_model": None if peak is None or base is None else (peak - base) / 1024,
            "peak_method": "VmHWM after clear_refs minus VmRSS before the call" if known else None,
            "load_before": load_before, "load_after": os.getloadavg(), "by_layer_kind": means,
            "rss_trace_mib_above_model": _thin(trace) if base is not None else None}


def _thin(trace: list[tuple[float, float]], every: int = 10) -> list[tuple[float, float]]:
    """Every `every`-th sample, and every sample within 10% of the largest (where the peak lies)."""
    top = max((mib for _, mib in trace), default=0.0)
    return [x for i, x in enumerate(trace) if i % every == 0 or x[1] >= 0.9 * top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # run one length here, print its JSON
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "gemma3_summaries.json"))
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.tokens[0], a.threads)))
        return 0
    report = {"benchmark": "gemma3_summaries", "machine": machine(), "threads": a.threads,
              "load_start": os.getloadavg(), "argv": sys.argv[1:] if argv is None else list(argv), "rows": []}
    print(f"Gemma 3 270M per-head summaries, every head, top-8 keys, {a.threads} thread(s)\n")
    print("| tokens | peak MiB above the model | wall s | CPU s | load before / after |\n|---|---|---|---|---|")
    for T in a.tokens:
        out = subprocess.run([sys.executable, __file__, "--one", "--tokens", str(T), "--threads", str(a.threads)],
                             stdout=subprocess.PIPE, text=True, check=True)  # its progress goes to stderr
        row = json.loads(out.stdout.strip().splitlines()[-1])
        report["rows"].append(row)
        print(f"| {T} | {row['peak_mib_above_model']:.0f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | "
              f"{row['load_before'][0]:.1f} / {row['load_after'][0]:.1f} |", flush=True)
    report["load_end"] = os.getloadavg()
    report["machine"] = machine()  # its loadavg_end: the run's end
    print(f"\nwrote {write_json(a.json, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
