"""docs/heads.md's "On a real model" quotes the committed runs on SmolLM2: every number in
that section is read off docs/heads/<run>/results.json, and its tables are the results'
rows in the results' order, so a rerun that changes a number fails here until the page
says the new one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "heads.md").read_text(encoding="utf-8")
RUNS = ("ioi-smollm2", "induction-smollm2")


def results(name: str) -> dict:
    return json.loads((ROOT / "docs" / "heads" / name / "results.json").read_text(encoding="utf-8"))


def section() -> str:
    """The "On a real model" section, without its code blocks (commands, not findings)."""
    start = DOC.index("## On a real model")
    end = DOC.find("\n## ", start + 1)
    text = DOC[start:end if end > 0 else len(DOC)]
    return re.sub(r"```.*?```", "", text, flags=re.S)


def table_after(header_start: str) -> list[list[str]]:
    lines = section().splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


# the per-head grids (270 numbers each) are left out of the pool: a two-decimal quote would
# match one of them by chance; the section quotes the named results, not grid cells
GRIDS = {"table", "induction_score", "previous_token_score", "position", "random_heads"}


def _numbers(obj) -> list[float]:
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    items = [v for k, v in obj.items() if not (k in GRIDS and isinstance(v, list))] if isinstance(obj, dict) else obj
    return [x for item in items for x in _numbers(item)]


def _head(cell: str) -> tuple[int, int]:
    m = re.fullmatch(r"L(\d+)H(\d+)", cell)
    assert m, f"{cell!r} is not a head written LxHy"
    return int(m.group(1)), int(m.group(2))


def test_the_runs_are_committed_with_their_plots():
    for name in RUNS:
        folder = ROOT / "docs" / "heads" / name
        assert (folder / "results.json").is_file(), name
        pngs = list(folder.glob("*.png"))
        assert pngs and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs), name
        assert f"heads/{name}/{pngs[0].name}" in DOC, f"docs/heads.md does not show {name}'s plot"


@pytest.mark.parametrize("text", re.findall(r"(?<![\w.])-?\d+\.\d+%?", section()))
def test_every_decimal_quoted_is_a_number_of_the_results(text):
    """Each decimal in the section equals a number of results.json at the decimals quoted
    (a percentage: 100 times one)."""
    pool = [x for name in RUNS for x in _numbers(results(name))]
    pct = text.endswith("%")
    value = float(text.rstrip("%"))
    places = len(text.rstrip("%").split(".")[1])
    hits = [x for x in pool if f"{(100 * x if pct else x):.{places}f}" == f"{value:.{places}f}"]
    assert hits, f"docs/heads.md quotes {text}, which no number of {', '.join(RUNS)}/results.json rounds to"


def test_ioi_sentence_and_tables_are_the_results():
    r = results("ioi-smollm2")
    text = section()
    assert f"{r['n']} pairs" in text
    assert f"clean {r['metric_clean']:+.2f}" in text and f"corrupted {r['metric_corrupted']:+.2f}" in text
    rows = table_after("| head | patched |")
    assert rows, "no top-heads table"
    for cells, t in zip(rows, r["top"]):
        assert _head(cells[0]) == (t["layer"], t["head"])
        assert cells[1] == f"{t['value']:+.2f}" and cells[2] == f"{100 * t['recovered']:.0f}%"
    rows = table_after("| k | top-k heads |")
    by_k = r["causal_check"]["by_k"]
    assert len(rows) == len(by_k)
    for cells, row in zip(rows, by_k):
        assert cells[0] == str(row["k"])
        assert [_head(c) for c in cells[1].split()] == [tuple(h) for h in row["heads"]]
        assert cells[2] == f"{row['ablated']:+.2f}" and cells[3] == f"{row['random_median']:+.2f}"


def test_induction_tables_are_the_results():
    r = results("induction-smollm2")
    rows = table_after("| head | induction score |")
    assert rows
    for cells, t in zip(rows, r["top"]):
        assert _head(cells[0]) == (t["layer"], t["head"])
        assert cells[1] == f"{t['induction_score']:.3f}" and cells[2] == f"{t['previous_token_score']:.3f}"
    rows = table_after("| ablation | k |")
    want = [(how, row) for how in ("zero", "mean") for row in r["ablation"][how]["by_k"]]
    assert len(rows) == len(want)
    for cells, (how, row) in zip(rows, want):
        assert cells[0] == how and cells[1] == str(row["k"])
        assert cells[2] == f"{row['ablated']:.2f}" and cells[3] == f"{row['random_median']:.2f}"
    rows = table_after("| earlier head |")
    assert rows
    for cells, t in zip(rows, r["feeders"]["heads"]):
        assert _head(cells[0]) == (t["layer"], t["head"])
        assert cells[1] == f"{t['loss_raised_by']:+.2f}" and cells[2] == f"{t['previous_token_score']:.3f}"
