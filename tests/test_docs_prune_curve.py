"""docs/heads/prune-curve-smollm2/README.md quotes the committed pruning curve: every number
in it is read off its results.json, its table is the results' points in order, and its claims
about which layers keep what are checked here, so a rerun that changes them fails until the
page says the new ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "docs" / "heads" / "prune-curve-smollm2"
DOC = (FOLDER / "README.md").read_text(encoding="utf-8")
R = json.loads((FOLDER / "results.json").read_text(encoding="utf-8"))
PROSE = re.sub(r"```.*?```", "", DOC, flags=re.S)
GRIDS = {"removed", "query_heads_kept_per_layer"}  # per-head lists (and the importance grid): a quote would
# match one of their numbers by chance; the page quotes the named results


def _numbers(obj) -> list[float]:
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    items = [v for k, v in obj.items() if k not in GRIDS and not (k == "importance" and isinstance(v[0], list))] \
        if isinstance(obj, dict) else obj
    return [x for item in items for x in _numbers(item)]


POOL = _numbers(R) + [R["seconds"] / 60, R["cpu_seconds"] / 60]  # the page quotes minutes


def test_the_run_is_the_default_command_with_its_plot():
    from multihead.heads import prune_curve as pc

    assert R["fractions"] == list(pc.FRACTIONS) and R["seeds"] == list(pc.SEEDS)
    assert R["metric"].endswith(f"{pc.EVAL_WINDOWS} windows of {pc.EVAL_LENGTH} tokens spread evenly")
    assert R["importance_text"].endswith(f"{pc.IMP_BATCHES} batches of {pc.IMP_BATCH} x {pc.IMP_LENGTH} tokens")
    assert (FOLDER / "curve.png").read_bytes()[:4] == b"\x89PNG" and "(curve.png)" in DOC
    assert "multihead heads importance --model smollm2 --prune-curve --out docs/heads/prune-curve-smollm2" in DOC


@pytest.mark.parametrize("text", re.findall(r"(?<![\w.])-?\d+\.\d+%?", PROSE))
def test_every_decimal_quoted_is_a_number_of_the_results(text):
    pct = text.endswith("%")
    value = float(text.rstrip("%"))
    places = len(text.rstrip("%").split(".")[1])
    hits = [x for x in POOL if f"{(100 * x if pct else x):.{places}f}" == f"{value:.{places}f}"]
    assert hits, f"the page quotes {text}, which no number of results.json rounds to"


@pytest.mark.parametrize("text", re.findall(r"\d{1,3}(?:,\d{3})+", PROSE))
def test_every_large_integer_quoted_is_one_of_the_results(text):
    assert float(text.replace(",", "")) in POOL, text


def test_the_table_is_the_results():
    lines = PROSE[PROSE.index("| removed |"):].splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:] if line.startswith("|")]
    g, h = R["curves"]["groups"], R["curves"]["heads"]
    want = [[f"{100 * f:.0f}%", str(g["importance"][k]["removed_heads"]), f"{g['importance'][k]['val_ppl']:.2f}",
             f"{g['random'][k]['val_ppl_median']:.2f}", f"{h['importance'][k]['val_ppl']:.2f}",
             f"{h['random'][k]['val_ppl_median']:.2f}"] for k, f in enumerate(R["fractions"])]
    assert rows == want


def test_the_claims_about_layers_and_checkpoints():
    g, h = R["curves"]["groups"], R["curves"]["heads"]
    assert all(p["val_ppl"] < q["val_ppl_median"] for c in (g, h) for p, q in zip(c["importance"][1:], c["random"][1:]))
    seed0 = [q["val_ppl_seeds"][0] for q in g["random"]]
    assert seed0[2] < g["importance"][2]["val_ppl"] and seed0[3] < g["importance"][3]["val_ppl"]
    k10, k20 = g["importance"][1]["query_heads_kept_per_layer"], g["importance"][2]["query_heads_kept_per_layer"]
    assert (k10[0], k20[0], k10[1], k20[1]) == (9, 3, 6, 3)  # two groups of layer 0, one of layer 1
    shrunk = [(u, p["fraction"]) for u, c in R["curves"].items() for p in c["importance"]
              if p["num_attention_heads"] < 9]
    assert shrunk == [("heads", 0.5)]
    p = h["importance"][5]
    assert (p["num_attention_heads"], p["num_key_value_heads"], p["params"]) == (6, 3, 127_879_488)
    assert R["params"] == 134_515_008
    kept = g["importance"][5]["query_heads_kept_per_layer"]
    assert [i for i, k in enumerate(kept) if k == 9] == [9, 19]
    ppl = {u: [p["val_ppl"] for p in c["importance"]] for u, c in R["curves"].items()}
    assert abs(ppl["heads"][1] / ppl["groups"][1] - 1) < 0.01  # "even" at 10%
    assert all(ppl["heads"][k] < ppl["groups"][k] for k in (2, 3))  # query heads cost less at 20% and 30%
    assert all(ppl["groups"][k] < ppl["heads"][k] for k in (4, 5))  # whole groups from 40% on
