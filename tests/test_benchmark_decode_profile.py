"""Smoke test of `benchmarks/decode.py --profile`: it runs, every way of the decode step it
times agrees with the one folded flash call (the script asserts it), and its JSON holds a
row per geometry, length, thread count and way, beside what an earlier run left there.
Not a timing assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from multihead.kernels import native

ROOT = Path(__file__).resolve().parent.parent
WAYS = {"multihead", "multihead flash", "multihead unsplit", "gemm engine", "one flash call", "split 2", "split 4",
        "two matmuls", "torch enable_gqa"}
NATIVE = {"native engine"}  # where this machine builds the C kernel (kernels.native)


def test_decode_profile_quick(tmp_path):
    out = tmp_path / "decode.json"
    out.write_text(json.dumps({"rows": ["an earlier run's"]}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--profile", "--lengths", "64",
                           "--rounds", "1", "--rotate-mib", "1", "--min-sample-ms", "1", "--profile-threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Decode-step profile" in proc.stdout
    report = json.loads(out.read_text())
    assert report["rows"] == ["an earlier run's"]  # the rest of the JSON is kept
    rows = report["profile"]["rows"]
    ways = WAYS | (NATIVE if native.library() is not None else set())
    assert {(r["geometry"], r["way"]) for r in rows} == {(g, w) for g in ("GQA 32/8 x 128", "SmolLM2 9/3 x 64")
                                                         for w in ways}
    assert all(r["L"] == 64 and r["threads"] == 1 and r["median_s"] > 0 and r["pct_read"] > 0 and r["x_unsplit"] > 0
               for r in rows)
