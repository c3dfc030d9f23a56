"""Smoke test of `benchmarks/decode_split.py`: it runs (re-executing itself with
OMP_WAIT_POLICY=PASSIVE), checks that the split step equals the one call at an even and
an odd L (the script asserts 1e-6), and writes a row per geometry and length. Not a
timing assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_decode_split_quick(tmp_path):
    out = tmp_path / "decode_split.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_split.py"), "--lengths", "64", "65",
                           "--rounds", "1", "--rotate-mib", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["threads"] == 2 and "PASSIVE" in report["method"]
    rows = report["rows"]
    assert [(r["geometry"], r["L"]) for r in rows] == [(g, L) for g in ("9/3 x 64", "9/3 x 128") for L in (64, 65)]
    assert all(r["split_s_even"] > 0 and r["unsplit_s_odd"] > 0 and r["x_even"] > 0 for r in rows)
