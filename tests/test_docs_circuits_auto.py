"""docs/heads-circuits-auto.md quotes its runs: every number in a results section is in that run's results.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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


# (the section's markers, its run's folder, the curve points its table quotes)
RUNS = {"smollm2": ("results", FOLDER, (0, 2, 3, 6)), "gemma3": ("results gemma3", FOLDER / "gemma3", (0, 1, 3, 6))}


def _results_text(run: str = "smollm2") -> str:
    text = PAGE.read_text()
    marker = RUNS[run][0]
    return text[text.index(f"<!-- {marker} -->"):text.index(f"<!-- /{marker} -->")]


def _results(run: str) -> dict:
    return json.loads((RUNS[run][1] / "results.json").read_text())


@pytest.mark.parametrize("run", RUNS)
def test_the_run_is_committed_with_its_figure(run):
    folder = RUNS[run][1]
    assert (folder / "results.json").is_file() and (folder / "curves.png").is_file()
    assert f"{folder.relative_to(ROOT / 'docs').as_posix()}/curves.png" in _results_text(run)


@pytest.mark.parametrize("run", RUNS)
def test_the_section_names_its_pairs_and_metric(run):
    r, text = _results(run), _results_text(run)
    c = r["eap-ig"]["curve"]
    assert f"**{r['n']} pairs**" in text
    assert f"{c['metric_clean']:.3f} clean" in text and f"{c['metric_corrupted']:.3f} corrupted" in text


@pytest.mark.parametrize("run", RUNS)
def test_every_decimal_quoted_is_a_number_of_the_results(run):
    values = [abs(v) for v in _numbers(_results(run))]
    text = re.sub(r"\d+(\.\d+)?%", "", _results_text(run))  # fractions written as percentages
    text = re.sub(r"`[^`]*`", "", text)  # edge and head names (a23.h3, 23.3 ...) are names, not results
    text = re.sub(r"\b\d{1,2}\.\d\b", "", text)  # layer.head names in prose (23.3, 19.2)
    quoted = re.findall(r"\d+\.\d{3,}", text)
    assert quoted, "the results section quotes no decimals"
    for q in quoted:
        digits = len(q.split(".")[1])
        assert any(round(v, digits) == float(q) for v in values), f"{q} is not in results.json"


@pytest.mark.parametrize("run", RUNS)
def test_the_table_is_the_results(run):
    r, points = _results(run), RUNS[run][2]
    rows = {"EAP-IG, 5 steps": "eap-ig", "EAP": "eap", "random": "random"}
    seen = set()
    for line in _results_text(run).splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] in rows:
            c = r[rows[cells[0]]]["curve"]
            assert cells[1] == f"{c['cpr']:.3f} ({c['cpr_interval'][0]:.3f}, {c['cpr_interval'][1]:.3f})"
            assert cells[2] == f"{c['cmd']:.3f} ({c['cmd_interval'][0]:.3f}, {c['cmd_interval'][1]:.3f})"
            # a -0.000 (a curve point a hair below the corrupted run) is written 0.000
            assert cells[3:] == [f"{c['faithfulness'][i] + 0.0:.3f}".replace("-0.000", "0.000") for i in points]
            seen.add(cells[0])
        if cells and cells[0] == "scores":  # the header: the fractions and edge counts of the columns
            assert cells[3:] == [f"F at {_percent(c)} ({n:,} edges)" if k == 0 else f"{_percent(c)} ({n:,})"
                                 for k, (c, n) in enumerate(_columns(r, points))]
    assert seen == set(rows)


def _percent(p: float) -> str:
    return f"{p * 100:g}%"


def _columns(r: dict, points) -> list[tuple[float, int]]:
    c = r["eap-ig"]["curve"]
    return [(c["fractions"][i], c["edges_kept"][i]) for i in points]


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
