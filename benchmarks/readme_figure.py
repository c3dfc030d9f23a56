"""The README's benchmark figure: one bar per case, multihead's speed against its peer's
(the peer's time / multihead's, from the committed benchmarks/results/*.json; right of 1
is faster), the machine named in the title. Deterministic: the same results give the same
bytes (Agg, fixed size and DPI, no timestamp in the PNG).

    python benchmarks/readme_figure.py            # writes docs/img/benchmarks.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img" / "benchmarks.png"


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def _attention(variant: str, causal: bool, key: str) -> float:
    rows = _load("attention")["results"]
    return next(r[key] for r in rows if r["variant"] == variant and r["N"] == 4096 and r["causal"] == causal)


def _decode(variant: str) -> float:
    return next(r["x_torch"] for r in _load("decode")["rows"]
                if r["L"] == 16384 and r["kind"] == "kernel" and r["variant"] == variant)


def _case(name: str, field: str, index: int = 0) -> float:
    return _load(name)["cases"][index][field]


def cases() -> list[tuple[str, str, float]]:
    """(case, peer, peer's time / multihead's) for each benchmark shown."""
    return [
        ("Attention forward, N = 4096, causal", "raw SDPA + 4 Linear",
         1 / _attention("multihead", True, "ratio_vs_sdpa_raw")),
        ("Attention forward, N = 4096, no mask", "the Annotated Transformer",
         _attention("textbook", False, "ratio_vs_multihead")),
        ("GQA decode, L = 16384, 32/8 heads", "torch SDPA enable_gqa", _decode("GQA")),
        ("MQA decode, L = 16384", "torch SDPA enable_gqa", _decode("MQA")),
        ("patch_scan, GPT-2 shape, IOI-style pair", "TransformerLens 4.3", _case("heads", "speedup_median", 0)),
        ("patch_scan, GPT-2 shape, nothing shared", "TransformerLens 4.3", _case("heads", "speedup_median", 1)),
        ("patch_scan, SmolLM2-135M, tasks.ioi 8 pairs", "TransformerLens 4.3 bridge",
         _case("heads_smollm2", "speedup_median")),
        ("patch_scan(group=), 2 ranks, SmolLM2 IOI", "1 process",
         _case("heads_distributed", "speedup_median", 3)),
        ("greedy generate, random 4-layer Llama", "transformers' sdpa", 1 / _load("hf_generate")["generate"]["ratio"]),
        ("greedy generate, SmolLM2-135M, 64 tokens", "transformers' sdpa",
         1 / _load("hf_generate_smollm2")["generate"]["ratio"]),
        ("inspect.summaries, 270 heads at 8,192 tokens", "one plain sdpa forward",
         1 / next(c["ratio"] for c in _load("long_context")["cases"] if c["N"] == 8192)),
    ]


def machine() -> str:
    m = _load("decode")["machine"]
    return f"{m['cpu']}, {m['cores']} vCPUs, torch {m['torch']}, fp32"


def draw(path: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = cases()
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.4), dpi=100)
    labels = [f"{case}\nvs {peer}" for case, peer, _ in rows]
    values = [v for _, _, v in rows]
    y = list(range(len(rows)))[::-1]
    ax.barh(y, values, color=["#2b7bba" if v >= 1 else "#d08c2a" for v in values], height=0.6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(y, labels, fontsize=7)
    for yi, v in zip(y, values):
        ax.text(v * 1.04, yi, f"{v:.2f}x", va="center", fontsize=7)
    ax.set_xlim(0.2, max(values) * 2)
    ax.set_xlabel("peer's time / multihead's (right of 1: multihead faster; log scale)", fontsize=8)
    ax.set_title(f"multihead against each peer, one bar per case\n{machine()}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the PNG to write (default {OUT.relative_to(ROOT)})")
    print(draw(parser.parse_args().out))
