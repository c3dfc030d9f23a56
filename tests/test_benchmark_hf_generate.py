"""Smoke test of benchmarks/hf_generate.py: it runs, both implementations give the same tokens,
and its JSON holds every figure the README quotes. Not a timing assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


def test_hf_generate_benchmark_quick(tmp_path):
    out = tmp_path / "hf_generate.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_generate.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ratio multihead / sdpa" in proc.stdout
    report = json.loads(out.read_text())
    gen = report["generate"]
    assert gen["same_tokens"] is True  # greedy decoding through multihead picks transformers' tokens
    assert len(gen["ratios"]) == report["config"]["rounds"] and gen["ratio"] > 0
    assert set(gen["seconds"]) == {"sdpa", "multihead"} and min(gen["seconds"].values()) > 0
    assert gen["cpu_ratio"] > 0 and len(gen["cpu_ratios"]) == len(gen["load_per_round"]) == len(gen["ratios"])
    steps = report["paired_steps"]  # the implementations in turn, step by step, inside each generate
    assert steps["same_tokens_every_round"] is True
    for clock in ("wall", "cpu"):
        for what in ("decode_step", "prefill"):
            assert steps[clock][what]["cycles"] > 0 and steps[clock][what]["multihead_ratio"] > 0
        assert steps[clock]["generate_ratio_estimate"]["multihead"] > 0
    call = report["per_call"]
    assert call["us_per_call"]["multihead"] > 0 and call["us_per_call"]["sdpa"] > 0
    names = [row["function"] for row in call["profiled_breakdown"]]
    assert "registry.attention_forward" in names  # the profile saw multihead's entry point
    loop = report["in_loop"]
    assert loop["decode_calls"] > 0
    assert {"multihead: attention function", "multihead: torch's fused kernel", "multihead: native kernel",
            "multihead: NaN-rule check", "sdpa: attention function",
            "sdpa: torch's fused kernel"} <= set(loop["us_per_call"])
    parts = loop["us_per_call"]  # the kernels and the check run inside the function that times them all
    kernel = parts["multihead: torch's fused kernel"] + parts["multihead: native kernel"]
    assert parts["multihead: attention function"] > kernel > 0


def test_hf_generate_benchmark_cache_bytes_and_no_prefill_cycles(tmp_path):
    """--cache reports the K/V cache a generate leaves (the random Llama holds every position in
    every layer: 2 layers x (64 + 8 - 1) positions x Hkv 2 x D 32 x K and V x 4 bytes), the same
    under both implementations; --prefill-rounds 0 leaves out the prefill cycles and the estimate."""
    out = tmp_path / "hf_generate.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_generate.py"), "--quick", "--generate-only",
                           "--cache", "--prefill-rounds", "0", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    expect = 2 * (64 + 8 - 1) * 2 * 32 * 2 * 4
    for impl in ("sdpa", "multihead"):
        cache = report["cache"][impl]
        assert cache["bytes"] == cache["every_position_bytes"] == expect
        assert [x["keys"] for x in cache["layers"]] == [64 + 8 - 1] * 2
    for clock in ("wall", "cpu"):
        assert report["paired_steps"][clock]["prefill"] is None
        assert report["paired_steps"][clock]["generate_ratio_estimate"] is None
        assert report["paired_steps"][clock]["decode_step"]["multihead_ratio"] > 0
