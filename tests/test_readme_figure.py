"""benchmarks/readme_figure.py: the README's benchmark figure is drawn from the committed
results, the same bytes every time, and each bar is the ratio the results hold."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("readme_figure", ROOT / "benchmarks" / "readme_figure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bars_are_the_results_ratios():
    fig = _module()
    bars = {case: value for case, _, value in fig.cases()}
    decode = json.loads((ROOT / "benchmarks/results/decode.json").read_text(encoding="utf-8"))
    by = {r["variant"]: r for r in decode["rows"] if r["L"] == 16384 and r["kind"] == "kernel"}
    # x_torch: the round-paired ratio (torch's time / multihead's), near the ratio of the medians
    assert bars["GQA decode, L = 16384, 32/8 heads"] == by["GQA"]["x_torch"]
    assert abs(by["GQA"]["x_torch"] / (by["torch GQA"]["median_s"] / by["GQA"]["median_s"]) - 1) < 0.05
    heads = json.loads((ROOT / "benchmarks/results/heads_smollm2.json").read_text(encoding="utf-8"))
    assert bars["patch_scan, SmolLM2-135M, tasks.ioi 8 pairs"] == heads["cases"][0]["speedup_median"]
    assert "Xeon" in fig.machine() and "vCPUs" in fig.machine()


def test_the_figure_is_deterministic_and_committed(tmp_path):
    pytest.importorskip("matplotlib")
    fig = _module()
    a, b = fig.draw(tmp_path / "a.png"), fig.draw(tmp_path / "b.png")
    assert a.read_bytes() == b.read_bytes() and a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "img" / "benchmarks.png").is_file()
    assert "docs/img/benchmarks.png" in (ROOT / "README.md").read_text(encoding="utf-8")
