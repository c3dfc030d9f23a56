"""SmolLM2-135M converted to a cheaper KV cache, before any training: held-out perplexity
per method and KV budget (docs/mla.md's table; writes docs/lab/uptrain-smollm2/conversion.json).

    .venv/bin/python benchmarks/convert_smollm2.py              # every row, in one run (about 5 minutes on one thread)
    .venv/bin/python benchmarks/convert_smollm2.py --quick      # 2 windows, 1,024 calibration tokens

Held-out text: the KJV's Romans to Revelation (the books `lab uptrain` never trains on), in
`--windows` windows of `--context` tokens spread evenly over it; perplexity is exp(mean
next-token NLL) over every predicted token. Calibration: `--calibration-tokens` of the
training split (Genesis to Acts), in windows of 256 tokens spread evenly over it. KV bytes
per token are measured from the cache a greedy `generate()` leaves (float32). Each row
also says whether the converted model's first 8 greedy tokens after a held-out prompt are
the base model's. Each data-aware MLA row also says what its DeepSeek-V2 export costs:
its layers keep different rotary pairs, so `to_deepseek_v2(..., widen_rope=True)` writes one
RoPE key that holds each kept frequency as often as the layer that keeps it most often
(`deepseek_export.rope_slots`): the distinct frequencies, the pairs and the key's width.

Methods (multihead.convert):
- "weight SVD": to_mla(R, rope_dim=r) with no data: the r/2 fastest rotary pairs kept,
  the SVD of [W_k,nope ; W_v]; to_gqa(1): the mean of the KV heads (Ainslie et al.).
- "MHA2MLA": keep="norm", basis="weights": the pairs of largest query-key norm product
  on the calibration tokens (Ji et al., 2025), then the joint SVD of the weights.
- "activation-aware": keep="norm", basis="activations": the same pairs, the principal
  directions of the K/V features on the calibration tokens (ASVD/Palu's W X, not W).
- "multihead": the default with calibration: keep="rotation", basis="output" for MLA,
  init="aligned" for MQA (docs/mla.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "lab" / "uptrain-smollm2" / "conversion.json"

# (target, budget in KV bytes per token, method, kind, kv_rank, rope_dim, options)
ROWS = [
    ("MQA", 15_360, "weight SVD", "gqa", 1, None, dict(init="mean")),
    ("MQA", 15_360, "multihead", "gqa", 1, None, dict(init="aligned", calibration=True)),
    ("MLA", 25_920, "weight SVD", "mla", 192, 24, dict(keep="high", basis="weights")),
    ("MLA", 25_920, "MHA2MLA", "mla", 192, 24, dict(keep="norm", basis="weights", calibration=True)),
    ("MLA", 25_920, "activation-aware", "mla", 192, 24, dict(keep="norm", basis="activations", calibration=True)),
    ("MLA", 25_920, "multihead", "mla", 192, 24, dict(calibration=True)),
    ("MLA", 25_920, "multihead", "mla", 144, 72, dict(calibration=True)),
    ("MLA", 10_560, "weight SVD", "mla", 64, 24, dict(keep="high", basis="weights")),
    ("MLA", 10_560, "MHA2MLA", "mla", 64, 24, dict(keep="norm", basis="weights", calibration=True)),
    ("MLA", 10_560, "activation-aware", "mla", 64, 24, dict(keep="norm", basis="activations", calibration=True)),
    ("MLA", 10_560, "multihead", "mla", 64, 24, dict(calibration=True)),
    ("MLA", 10_560, "multihead", "mla", 40, 48, dict(calibration=True)),
]


def _windows(ids: torch.Tensor, n: int, length: int) -> torch.Tensor:
    starts = torch.linspace(0, len(ids) - length, n).long()
    return torch.stack([ids[s:s + length] for s in starts])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 windows, 1,024 calibration tokens, two rows")
    p.add_argument("--windows", type=int, default=8, help="held-out windows (default 8)")
    p.add_argument("--context", type=int, default=256, help="tokens per held-out window (default 256)")
    p.add_argument("--calibration-tokens", type=int, default=4096, help="calibration tokens (default 4,096)")
    p.add_argument("--out", type=Path, default=OUT, help=f"the JSON written (default {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    from machine_info import finish  # now: it takes the load at the start (benchmarks/ is on sys.path)
    if args.quick:
        args.windows, args.calibration_tokens = 2, 1024
    from multihead import convert
    from multihead.corpus import split_kjv
    from multihead.files import write_json
    from multihead.interop.loaders import load_model
    from multihead.lab.uptrain_hf import held_out_ppl, kv_bytes_per_token

    torch.set_num_threads(1)
    loaded = load_model("smollm2")
    model, tok = loaded.model.eval(), loaded.tokenizer
    train, held = split_kjv(None)
    held_ids = torch.tensor(tok(held)["input_ids"], dtype=torch.long)
    train_ids = torch.tensor(tok(train)["input_ids"], dtype=torch.long)
    windows = _windows(held_ids, args.windows, args.context + 1)
    cal = _windows(train_ids, args.calibration_tokens // 256, 256)
    prompt = held_ids[None, :16]
    dev = torch.device("cpu")

    def greedy(m) -> list[int]:
        with torch.no_grad():
            return m.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 16:].tolist()

    res = {"model": "smollm2 (SmolLM2-135M-Instruct, float32)", "held_out": "KJV Romans to Revelation",
           "windows": args.windows, "context": args.context, "eval_tokens": args.windows * args.context,
           "calibration": "KJV Genesis to Acts", "calibration_tokens": int(cal.numel()),
           "torch_version": torch.__version__, "machine": platform.machine(), "python": sys.version.split()[0],
           "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "rows": []}
    t0 = time.perf_counter()
    base_tokens = greedy(model)
    res["base"] = {"val_ppl": held_out_ppl(model, windows, dev),
                   "kv_bytes_per_token": kv_bytes_per_token(model, prompt, 8)}
    rows = ROWS[:2] if args.quick else ROWS
    for target, budget, method, kind, size, rope_dim, options in rows:
        kw = {k: (cal if k == "calibration" else v) for k, v in options.items()}
        t = time.perf_counter()
        if kind == "gqa":
            new, report = convert.to_gqa(model, size, return_report=True, **kw)
        else:
            new, report = convert.to_mla(model, size, rope_dim=rope_dim, return_report=True, **kw)
        seconds = time.perf_counter() - t
        ppl = held_out_ppl(new, windows, dev)
        row = {"target": target, "budget": budget, "method": method, "kv_rank": size if kind == "mla" else None,
               "rope_dim": rope_dim, "n_kv_heads": size if kind == "gqa" else None,
               "options": {k: ("given" if k == "calibration" else v) for k, v in options.items()},
               "init": report.init, "val_ppl": ppl, "ratio_to_base": ppl / res["base"]["val_ppl"],
               "kv_bytes_per_token": kv_bytes_per_token(new, prompt, 8), "convert_seconds": seconds,
               "greedy_tokens_equal_base": greedy(new) == base_tokens,
               "kv_reconstruction_error": [round(e, 6) for e in report.errors]}
        if kind == "mla":
            row["rope_pairs"] = [list(map(list, layer.rope_pairs)) for layer in report.layers]
            if "calibration" in options and options.get("keep") is None:
                row["deepseek_rope"] = _deepseek_rope(new)
        res["rows"].append(row)
        res["elapsed_s"] = time.perf_counter() - t0
        write_json(args.out, res)
        print(f"{target} {budget:,} {method} R={size} r={rope_dim}: {ppl:.2f} ({row['ratio_to_base']:.2f}x base "
              f"{res['base']['val_ppl']:.2f}), {seconds:.0f} s", flush=True)
    res["table"] = table(res)
    write_json(args.out, finish(res))
    print(res["table"])
    return 0


def _deepseek_rope(model) -> dict:
    """What the one RoPE key of the model's DeepSeek-V2 export (`widen_rope=True`) holds:
    its distinct frequencies, its pairs (each frequency as often as the layer that keeps it
    most often) and its width in cached values per token and layer."""
    from multihead.interop.hf.deepseek_export import rope_slots

    freqs, _ = rope_slots(model)
    return {"distinct_frequencies": int(freqs.unique().numel()), "pairs": int(freqs.numel()),
            "rope_dims": 2 * int(freqs.numel())}


def table(res: dict) -> str:
    """The markdown table docs/mla.md quotes."""
    base = res["base"]["val_ppl"]
    lines = ["| target | KV bytes/token | method | R + rope_dim | perplexity | x base |", "|:--|--:|:--|--:|--:|--:|",
             f"| base (MHA-3 KV heads) | {res['base']['kv_bytes_per_token']:,} | - | - | {base:.2f} | 1.00 |"]
    for r in res["rows"]:
        shape = f"{r['kv_rank']} + {r['rope_dim']}" if r["kv_rank"] is not None else f"{r['n_kv_heads']} KV head"
        lines.append(f"| {r['target']} | {r['kv_bytes_per_token']:,} | {r['method']} | {shape} | "
                     f"{r['val_ppl']:,.2f} | {r['ratio_to_base']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
