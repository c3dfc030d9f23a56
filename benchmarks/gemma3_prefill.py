"""Gemma 3 270M prefill through attn_implementation="multihead" beside transformers' sdpa
(fp32, CPU, B = 1), the last position's logits, at 1K / 2K / 8K tokens of the KJV.

    .venv/bin/python benchmarks/gemma3_prefill.py                       # 1024, 2048, 8192 tokens
    .venv/bin/python benchmarks/gemma3_prefill.py --tokens 1024 --rounds 1   # a smoke run
    .venv/bin/python benchmarks/gemma3_prefill.py --tokens 32768 --rounds 1  # the full context (slow)

Five of Gemma 3's six layers attend through a 512-token sliding window. transformers' sdpa
hands each such layer a dense `(B, 1, T, S)` mask and attends to all S keys; the mask
builder registered with "multihead" hands it transformers' own mask function as a
predicate, and the kernel skips the tiles outside the window (block-sparse). The one
model is switched between the two with `set_attn_implementation`, in alternating order
(A B, then B A), for --rounds rounds per length: the ratio multihead / sdpa is the median
of per-round ratios, so two timed prefills lie seconds apart and the machine's load hits
both alike. Each prefill is timed by wall time and by the process's CPU time, and the
load average is recorded with each round: on a shared machine the CPU-time ratio is the
one to read. The peak resident memory above the loaded model is read per prefill from
/proc (VmHWM, reset before each by writing 5 to /proc/self/clear_refs where allowed).

Writes a Markdown table to stdout and JSON to benchmarks/results/gemma3_prefill.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, reset_peak_rss, status_kib, write_json  # noqa: E402

IMPLS = ("multihead", "sdpa")


def prefill(model, ids: torch.Tensor, impl: str) -> tuple[float, float, int | None, torch.Tensor]:
    """(wall s, CPU s, peak KiB above the start, last logits) of one prefill on `impl`."""
    model.set_attn_implementation(impl)
    base = status_kib("VmRSS")
    peak_known = reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        logits = model(ids, logits_to_keep=1, use_cache=False).logits[0, -1]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = status_kib("VmHWM") if peak_known else None
    return wall, cpu, None if peak is None or base is None else peak - base, logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 8192])
    ap.add_argument("--rounds", type=int, default=3, help="A B / B A rounds per length (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "gemma3_prefill.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from multihead.corpus import split_kjv
    from multihead.interop.loaders import load_model

    loaded = load_model("gemma3")
    model, tok = loaded.model, loaded.tokenizer
    train, _ = split_kjv()
    ids_all = tok(train[: 8 * max(a.tokens)], return_tensors="pt")["input_ids"]  # <bos> first
    load_start = os.getloadavg()
    rows = []
    print(f"Gemma 3 270M prefill, fp32, {a.threads} threads, B = 1, last position's logits; load at start "
          f"{load_start[0]:.2f}\n")
    print("| tokens | multihead s (wall / CPU) | sdpa s (wall / CPU) | ratio wall | ratio CPU | peak MiB above "
          "(mh / sdpa) | max logit diff | load |")
    print("|---|---|---|---|---|---|---|---|")
    for T in a.tokens:
        ids = ids_all[:, :T]
        runs = {impl: [] for impl in IMPLS}
        ratios_wall, ratios_cpu, loads, diffs = [], [], [], []
        for r in range(a.rounds):
            order = IMPLS if r % 2 == 0 else IMPLS[::-1]
            out = {}
            for impl in order:
                out[impl] = prefill(model, ids, impl)
                runs[impl].append(out[impl][:3])
            ratios_wall.append(out["multihead"][0] / out["sdpa"][0])
            ratios_cpu.append(out["multihead"][1] / out["sdpa"][1])
            diffs.append((out["multihead"][3] - out["sdpa"][3]).abs().max().item())
            loads.append(os.getloadavg()[0])
        model.set_attn_implementation("multihead")
        med = {impl: [statistics.median(x[i] for x in runs[impl]) for i in (0, 1)] for impl in IMPLS}
        peaks = {impl: max((x[2] for x in runs[impl] if x[2] is not None), default=None) for impl in IMPLS}
        row = {"tokens": T, "ids_start_with_bos": bool(ids[0, 0] == tok.bos_token_id),
               "multihead_s": med["multihead"], "sdpa_s": med["sdpa"],
               "ratio_wall": statistics.median(ratios_wall), "ratio_cpu": statistics.median(ratios_cpu),
               "ratios_wall": ratios_wall, "ratios_cpu": ratios_cpu,
               "peak_mib_above": {k: None if v is None else round(v / 1024, 1) for k, v in peaks.items()},
               "max_abs_logit_diff": max(diffs), "load_1min": loads}
        rows.append(row)
        pk = row["peak_mib_above"]
        print(f"| {T} | {med['multihead'][0]:.2f} / {med['multihead'][1]:.2f} | {med['sdpa'][0]:.2f} / "
              f"{med['sdpa'][1]:.2f} | {row['ratio_wall']:.3f} | {row['ratio_cpu']:.3f} | {pk['multihead']} / "
              f"{pk['sdpa']} | {row['max_abs_logit_diff']:.1e} | {', '.join(f'{x:.1f}' for x in loads)} |",
              flush=True)
    write_json(a.json, {"benchmark": "gemma3_prefill", "machine": machine(), "threads": a.threads,
                        "rounds": a.rounds, "load_start": load_start, "load_end": os.getloadavg(), "rows": rows})
    print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
