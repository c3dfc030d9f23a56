"""Smoke test of benchmarks/heads.py --quick: the script runs, both sides produce the same
table, and the JSON is complete (not a timing assertion)."""

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
        assert {x["variant"] for x in case["results"]} == {"multihead", "transformer_lens"}
        for x in case["results"]:
            assert len(x["times_s"]) == 2 and all(t > 0 for t in x["times_s"])
            assert x["peak_bytes"] is not None and x["peak_bytes"] >= 0
        assert case["speedup_median"] > 0
    assert len(r["targets"]) == 2
