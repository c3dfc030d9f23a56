"""path_patch_scan on SmolLM2 with tasks.ioi's AtPositions metric: CPU time with and without
what an AtPositions metric gives the scan (the LM head at the read positions only, the rows
rolled to end where the metric reads, forwards of short rows carrying up to
POSITIONS_PER_RUN row-positions), same tables.

"off" turns those three off in-process (`_align._ALIGN = False`, `takes_logits_to_keep`
false for the scan, `POSITIONS_PER_RUN = 0`: 16 rows a forward), which is the scan as it ran
before them; "no_keep", "no_align", "no_positions" turn one off. Rounds interleave off/on;
CPU time is `time.process_time` of one torch thread; the load average is read before every
run.

    OMP_NUM_THREADS=1 python benchmarks/path_patch_positions.py [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager

import torch

CASES = {"name_movers_q": ([(23, 0), (23, 2)], "q"), "logits": ("logits", "q"), "s_inhibition_kv_k": ([(20, 0)], "k")}


# mode -> which of (the read positions' logits, the rolled rows, the row-position bound) are on
MODES = {"off": (False, False, False), "on": (True, True, True), "no_keep": (False, True, True),
         "no_align": (True, False, True), "no_positions": (True, True, False)}


@contextmanager
def _mode(name: str):
    from multihead.heads import _align, path_patching
    from multihead.heads import scan as _scan

    keep, align, positions = MODES[name]
    saved = _align._ALIGN, path_patching.takes_logits_to_keep, _scan.POSITIONS_PER_RUN
    if not align:
        _align._ALIGN = False
    if not keep:
        path_patching.takes_logits_to_keep = lambda m: False
    if not positions:
        _scan.POSITIONS_PER_RUN = 0
    try:
        yield
    finally:
        _align._ALIGN, path_patching.takes_logits_to_keep, _scan.POSITIONS_PER_RUN = saved


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default="off,on", help=f"of {', '.join(MODES)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from machine_info import finish  # now: it takes the load at the start (benchmarks/ is on sys.path)
    torch.set_num_threads(1)
    from multihead import heads
    from multihead.heads import tasks
    from multihead.interop.loaders import load_model

    m = load_model("smollm2")
    task = tasks.ioi(args.n, tokenizer=m.tokenizer)
    out = {"model": "smollm2", "n": args.n, "torch_threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": {}}
    for key in args.cases.split(","):
        receivers, via = CASES[key]
        modes = args.modes.split(",")
        runs = {mode: [] for mode in modes}
        tables = {}
        for r in range(args.rounds):
            for mode in modes:
                load = os.getloadavg()[0]
                t0 = time.process_time()
                with _mode(mode):
                    table = heads.path_patch_scan(m.model, task.clean, task.corrupted, task.metric, receivers, via=via)
                cpu = time.process_time() - t0
                runs[mode].append({"cpu_s": round(cpu, 2), "load1": round(load, 2)})
                tables[mode] = table
                print(key, r, mode, f"{cpu:.2f} s cpu, load {load:.2f}", flush=True)
        ratios = {mode: [a["cpu_s"] / b["cpu_s"] for a, b in zip(runs[mode], runs["on"])] for mode in modes
                  if mode != "on"}
        diff = {mode: float((tables[mode] - tables["on"]).nan_to_num().abs().max()) for mode in modes if mode != "on"}
        out["cases"][key] = {"receivers": receivers, "via": via, "runs": runs,
                             "median_cpu_s": {k: statistics.median(x["cpu_s"] for x in v) for k, v in runs.items()},
                             "ratio_to_on_per_round": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
                             "median_ratio_to_on": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
                             "max_table_diff_to_on": diff}
        print(json.dumps(out["cases"][key]), flush=True)
    if args.out:
        finish(out)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
