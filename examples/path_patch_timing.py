"""How long `heads.path_patch_scan` takes, against `heads.patch_scan` of the same inputs and
against a loop of `heads.path_patch`, one sender at a time.

    python examples/path_patch_timing.py [--smollm2]   # writes docs/heads-circuit/timings.json

The model is GPT-2-shaped and random (6 layers x 8 heads, C 256, vocabulary 1000), B 4,
T 64, one token changed at T/2 (an IOI-style pair: both scans skip the shared prefix);
one torch thread; each scan `--rounds` times, interleaved, the best kept. The loop runs
once (every head as the sender, receivers the 8 heads of layer 4 via q). With --smollm2,
also the real model on `tasks.ioi(8)`: patch_scan, the direct-path scan and the scan to
three receivers' queries, once each (minutes), and the loop on the 9 heads of layer 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from multihead import heads

OUT = Path(__file__).resolve().parent.parent / "docs" / "heads-circuit" / "timings.json"


def _time(f) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = f()
    return time.perf_counter() - t0, r


def gpt2_shaped(rounds: int) -> dict:
    import transformers

    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    L, H, C, B, T = 6, 8, 256, 4, 64
    cfg = transformers.GPT2Config(n_embd=C, n_layer=L, n_head=H, n_positions=T, vocab_size=1000, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.set_attn_implementation("multihead")
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 1000, (B, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, T // 2] = (corrupted[:, T // 2] + 7) % 1000

    def metric(logits):
        return (logits[:, -1, 3] - logits[:, -1, 4]).mean()
    layer4 = [(4, h) for h in range(H)]
    later = [(i, h) for i in range(1, L) for h in range(H)]
    runs = {"patch_scan": lambda: heads.patch_scan(model, clean, corrupted, metric),
            "path_q_layer4": lambda: heads.path_patch_scan(model, clean, corrupted, metric, layer4, via="q"),
            "path_q_all_later": lambda: heads.path_patch_scan(model, clean, corrupted, metric, later, via="q"),
            "path_v_all_later": lambda: heads.path_patch_scan(model, clean, corrupted, metric, later, via="v"),
            "path_logits": lambda: heads.path_patch_scan(model, clean, corrupted, metric, "logits")}
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            seconds[k].append(round(_time(f)[0], 3))
    loop_s, loop = _time(lambda: torch.tensor([[heads.path_patch(model, clean, corrupted, metric, [(i, h)], layer4)
                                                for h in range(H)] for i in range(L)]))
    scan = heads.path_patch_scan(model, clean, corrupted, metric, layer4)
    best = {k: min(v) for k, v in seconds.items()}
    return {"config": {"layers": L, "heads": H, "width": C, "batch": B, "positions": T, "changed": T // 2},
            "seconds": seconds, "best": best,
            "ratio_to_patch_scan": {k: round(v / best["patch_scan"], 2) for k, v in best.items()},
            "loop_q_layer4_seconds": round(loop_s, 2),
            "loop_over_scan": round(loop_s / best["path_q_layer4"], 1),
            "loop_vs_scan_max_diff": float((scan - loop).abs().max())}


def smollm2() -> dict:
    from multihead.heads import tasks
    from multihead.interop.loaders import load_model

    loaded = load_model("smollm2")
    model = loaded.model
    task = tasks.ioi(8, seed=0, tokenizer=loaded.tokenizer)
    args = (model, task.clean, task.corrupted, task.metric)
    out = {"patch_scan": _time(lambda: heads.patch_scan(*args))[0],
           "path_logits": _time(lambda: heads.path_patch_scan(*args, "logits"))[0]}
    movers = [(23, 3), (29, 1), (23, 0)]
    out["path_q_3_receivers"] = _time(lambda: heads.path_patch_scan(*args, movers, via="q"))[0]
    loop = _time(lambda: [heads.path_patch(*args, [(0, h)], movers) for h in range(9)])[0]
    n = model.config.num_hidden_layers * model.config.num_attention_heads
    out = {k: round(v, 1) for k, v in out.items()}
    return {"task": "tasks.ioi(8, seed=0)", "seconds": out,
            "ratio_to_patch_scan": {k: round(v / out["patch_scan"], 2) for k, v in out.items()},
            "loop_9_senders_seconds": round(loop, 1), "loop_all_senders_estimate_seconds": round(loop / 9 * n),
            "loop_estimate_over_scan": round(loop / 9 * n / out["path_q_3_receivers"], 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smollm2", action="store_true", help="also time the real model (minutes)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = {"machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                     "load_at_start": round(os.getloadavg()[0], 2), "threads": 1},
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpt2_shaped": gpt2_shaped(args.rounds)}
    if args.smollm2:
        r["smollm2_ioi"] = smollm2()
    r["machine"]["load_at_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=1) + "\n")
    return r


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
