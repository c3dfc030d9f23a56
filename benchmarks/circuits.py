"""How long the circuits tools take on SmolLM2 with IOI pairs, against the model's own forward and backward.

    python benchmarks/circuits.py --n 100 --rounds 2 --out benchmarks/results/circuits.json

Timed, in interleaved rounds (each round runs every item once; the best round per item is
kept, and the ratios are taken within this one run, so a loaded machine slows both sides):

- `forward`: one clean forward of the batch (`model(**clean)`, no gradients);
- `forward_backward`: one clean forward and the backward of the metric into the parameters;
- `eap`: `edge_scores(method="eap")`; `eap_ig`: `edge_scores(method="eap-ig", steps=5)`;
- `curve`: `faithfulness_curve` of the EAP scores (10 fractions, exact edge patching).

Bounds the issue sets: eap <= 2 x forward_backward, eap_ig <= 5 x eap, curve <= 30 x forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from multihead import heads
from multihead.files import write_json
from multihead.heads import tasks
from multihead.interop.loaders import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100, help="IOI pairs (default 100)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    from machine_info import finish  # now: it takes the load at the start (benchmarks/ is on sys.path)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model("smollm2")
    model = lm.model
    task = tasks.ioi(args.n, seed=0, tokenizer=lm.tokenizer)
    clean, corrupted, metric = task.clean, task.corrupted, task.metric
    model.requires_grad_(True)
    scores = heads.edge_scores(model, clean, corrupted, metric, method="eap")

    def forward():
        with torch.no_grad():
            model(**clean)

    def forward_backward():  # the parameters' gradients too, as training computes them
        metric(model(**clean).logits).backward()
        model.zero_grad(set_to_none=True)

    items = {
        "forward": forward,
        "forward_backward": forward_backward,
        "eap": lambda: heads.edge_scores(model, clean, corrupted, metric, method="eap"),
        "eap_ig": lambda: heads.edge_scores(model, clean, corrupted, metric, method="eap-ig", steps=5),
        "curve": lambda: heads.faithfulness_curve(model, clean, corrupted, metric, scores),
    }
    best = {k: float("inf") for k in items}
    for _ in range(args.rounds):
        for name, fn in items.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
            print(f"{name}: {best[name]:.2f} s", flush=True)
    ratios = {"eap / forward_backward": best["eap"] / best["forward_backward"],
              "eap_ig / eap": best["eap_ig"] / best["eap"], "curve / forward": best["curve"] / best["forward"]}
    res = {"model": "SmolLM2-135M-Instruct", "task": "ioi", "n": args.n, "T": int(clean["input_ids"].shape[1]),
           "rounds": args.rounds, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
           "load_average": os.getloadavg(), "seconds": {k: round(v, 3) for k, v in best.items()},
           "ratios": {k: round(v, 3) for k, v in ratios.items()},
           "bounds": {"eap / forward_backward": 2, "eap_ig / eap": 5, "curve / forward": 30}}
    print(json.dumps(res, indent=1))
    if args.out:
        write_json(args.out, finish(res))


if __name__ == "__main__":
    main()
