"""Smoke tests of benchmarks/heads.py --quick (GPT-2-shaped, and SmolLM2's first layers): the
script runs, both sides produce the same table, a difference fails it, and the JSON is
complete (not timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # about two minutes: four fresh processes import transformers and TransformerLens for the peaks
def test_heads_benchmark_quick(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "heads.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "heads.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        assert "skipped: TransformerLens is not installed" in proc.stdout
        return
    assert "| inputs |" in proc.stdout and "Targets:" in proc.stdout
    r = json.loads(out.read_text())
    assert [c["changed_position"] for c in r["cases"]] == [16, 0]  # T/2 (quick: T = 32), then the first token
    for case in r["cases"]:
        assert case["max_abs_diff"] < 1e-4
        assert {x["variant"] for x in case["results"]} == {"multihead", "transformer_lens", "multihead, plain metric"}
        for x in case["results"]:
            assert len(x["times_s"]) == 2 and all(t > 0 for t in x["times_s"])
            if x["variant"] != "multihead, plain metric":  # peaks: the two compared sides only
                assert x["peak_bytes"] is not None and x["peak_bytes"] >= 0
        assert case["speedup_median"] > 0
        # TransformerLens runs one clean forward and one forward per head (2 layers x 4 heads
        # at --quick), each a full forward of B 4 x T 32 positions: 12 C^2 multiply-adds per
        # position in a block's four matrix products (C 64), C x V in the output head (V 101)
        flops = case["flops"]
        per_forward = 2 * 4 * 32 * (2 * 12 * 64 * 64 + 64 * 101)
        assert flops["transformer_lens"]["linear"] == (1 + 2 * 4) * per_forward
        ours, theirs = flops["multihead"]["linear"], flops["transformer_lens"]["linear"]
        assert 0 < ours < theirs and flops["linear_ratio"] == pytest.approx(theirs / ours)
    assert len(r["targets"]) == 3  # T/2 and first-token speed-ups, then the same numbers
    assert r["targets"][2]["passed"] is True


def _bench():
    """benchmarks/heads.py as a module (it is a script, not a package member)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("heads_bench", ROOT / "benchmarks" / "heads.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _main_one_thread(bench, argv) -> int:
    import torch

    threads = torch.get_num_threads()
    try:
        return bench.main(argv)
    finally:
        torch.set_num_threads(threads)  # the benchmark sets 1 thread for this whole process


@pytest.mark.slow  # SmolLM2's first 2 layers, 1 IOI pair: 18 heads a side, in this process (the shared model)
def test_heads_benchmark_smollm2_quick(smollm2, tmp_path):
    pytest.importorskip("transformer_lens")
    bench = _bench()
    out = tmp_path / "heads_smollm2.json"
    assert _main_one_thread(bench, ["--model", "smollm2", "--quick", "--rounds", "1", "--no-peaks",
                                    "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    (case,) = r["cases"]
    assert (case["pairs"], case["layers"], case["heads"]) == (1, 2, 9)
    assert case["prefix_skip"]["skipped"] and case["prefix_skip"]["prefix"] == case["changed_positions"][0]
    assert 0 <= case["max_abs_diff"] < 1e-4
    assert [len(x["times_s"]) for x in case["results"]] == [1, 1, 1] and case["speedup_median"] > 0
    assert [x["variant"] for x in case["results"]][2] == "multihead, plain metric"
    assert case["plain_metric_speedup_median"] > 0 and len(case["plain_metric_ratios"]) == 1
    assert [t["passed"] for t in r["targets"]][1] is True  # the same-numbers target (both multihead tables)


@pytest.mark.slow
def test_heads_benchmark_smollm2_tables_agree_and_a_difference_fails(smollm2, tmp_path, monkeypatch, capsys):
    """The two sides' tables, compared here (not by the benchmark): they agree, are not
    trivially zero, and a TransformerLens table off by 1e-3 makes the benchmark exit 1."""
    pytest.importorskip("transformer_lens")
    import argparse

    bench = _bench()
    s = bench.setup_smollm2(argparse.Namespace(seed=0, layers=1), 1)
    assert s.theirs is not smollm2.model and s.ours is not smollm2.model  # one layer: a truncated copy
    info = {}
    ours = bench.run_ours(s.ours, s.ours_clean, s.ours_corrupted, s.metric, info)
    theirs = bench.run_tl(s.bridge(), s.tl_clean, s.tl_corrupted, s.metric)
    assert ours.shape == theirs.shape == (1, 9) and info["skipped"]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert ours.abs().max().item() > 1e-3  # patching a head of layer 0 moves the metric

    run_tl = bench.run_tl
    monkeypatch.setattr(bench, "run_tl", lambda *a: run_tl(*a) + 1e-3)  # a disagreement injected: it must fail
    out = tmp_path / "off.json"
    assert _main_one_thread(bench, ["--model", "smollm2", "--quick", "--layers", "1", "--rounds", "1",
                                    "--no-peaks", "--json", str(out)]) == 1
    assert "FAILED: the two tables differ" in capsys.readouterr().err
    assert json.loads(out.read_text())["targets"][1]["passed"] is False
