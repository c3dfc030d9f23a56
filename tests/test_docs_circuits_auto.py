"""docs/heads-circuits-auto.md quotes its run: every number in its results section is in results.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "heads-circuits-auto.md"
FOLDER = ROOT / "docs" / "heads-circuits-auto"


def _numbers(obj) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _numbers(v)]
    return []


def _results_text() -> str:
    text = PAGE.read_text()
    return text[text.index("<!-- results -->"):text.index("<!-- /results -->")]


def test_the_run_is_committed_with_its_figure():
    assert (FOLDER / "results.json").is_file() and (FOLDER / "curves.png").is_file()


def test_every_decimal_quoted_is_a_number_of_the_results():
    values = [abs(v) for v in _numbers(json.loads((FOLDER / "results.json").read_text()))]
    text = re.sub(r"\d+(\.\d+)?%", "", _results_text())  # fractions written as percentages
    text = re.sub(r"`[^`]*`", "", text)  # edge and head names (a23.h3, 23.3 ...) are names, not results
    text = re.sub(r"\b\d{1,2}\.\d\b", "", text)  # layer.head names in prose (23.3, 19.2)
    quoted = re.findall(r"\d+\.\d{3,}", text)
    assert quoted, "the results section quotes no decimals"
    for q in quoted:
        digits = len(q.split(".")[1])
        assert any(round(v, digits) == float(q) for v in values), f"{q} is not in results.json"


def test_the_table_is_the_results():
    r = json.loads((FOLDER / "results.json").read_text())
    rows = {"EAP-IG, 5 steps": "eap-ig", "EAP": "eap", "random": "random"}
    for line in _results_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] in rows:
            c = r[rows[cells[0]]]["curve"]
            assert cells[1] == f"{c['cpr']:.3f} ({c['cpr_interval'][0]:.3f}, {c['cpr_interval'][1]:.3f})"
            assert cells[2] == f"{c['cmd']:.3f} ({c['cmd_interval'][0]:.3f}, {c['cmd_interval'][1]:.3f})"
            assert cells[3:] == [f"{c['faithfulness'][i]:.3f}" for i in (0, 2, 3, 6)]


def test_the_timing_table_is_the_benchmark():
    r = json.loads((ROOT / "benchmarks" / "results" / "circuits.json").read_text())
    text = PAGE.read_text()
    section = text[text.index("## How fast"):text.index("<!-- results -->")]
    for key, value in {**r["seconds"], **r["ratios"]}.items():
        assert f"| {value} |" in section or f"| {value} x" in section, (key, value)
    for key, value in r["ratios"].items():
        num, den = key.split(" / ")
        assert abs(r["seconds"][num] / r["seconds"][den] - value) < 1e-3


def test_the_peer_paragraph_is_the_peer_run():
    r = json.loads((ROOT / "benchmarks" / "results" / "circuits_peer.json").read_text())
    text = PAGE.read_text()
    for key in ("seconds_multihead", "seconds_peer", "speedup"):
        assert f"{r[key]}" in text, key
    assert f"{r['max_relative_difference']:.3e}" in text and r["max_relative_difference"] < 1e-4
