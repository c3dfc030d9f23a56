"""Smoke tests of benchmarks/attention.py and benchmarks/masks.py: the scripts run and their JSON is complete.

Not a timing assertion: `--quick` uses N = 256 and 512, and one torch thread so that a
busy machine does not stretch it (OpenMP barriers under oversubscription).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "attention.py"
VARIANTS = {"multihead", "textbook", "torch_mha", "torch_mha_noweights", "sdpa_raw"}


def test_attention_benchmark_quick(tmp_path):
    out = tmp_path / "attention.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| N |" in proc.stdout and "Targets:" in proc.stdout

    report = json.loads(out.read_text())
    assert report["meta"]["matmul"]["gflops"] > 0
    assert len(report["meta"]["loadavg_start"]) == 3 and len(report["meta"]["loadavg_end"]) == 3
    results = report["results"]
    for N in (256, 512):
        for causal in (False, True):
            rows = {r["variant"]: r for r in results if r["N"] == N and r["causal"] == causal}
            expected = VARIANTS if causal else VARIANTS | {"textbook_srcmask"}
            assert set(rows) == expected, (N, causal, sorted(rows))
            for name, r in rows.items():
                assert r["status"] == "ok", (name, N, causal, r.get("reason"))
                assert len(r["times_s"]) >= 1 and all(t > 0 for t in r["times_s"]), (name, N)
                assert r["median_s"] > 0 and r["attn_gflops"] > 0 and r["total_gflops"] > 0
                assert r["peak_bytes"] is not None and r["peak_bytes"] >= 0, (name, N, r.get("mem_error"))
                # every variant computes the same function with the same weights
                assert r["max_abs_diff_vs_multihead"] < 1e-3, (name, N, causal)
            assert rows["sdpa_raw"]["ratio_vs_sdpa_raw"] == 1.0
    weights = {w["variant"]: w for w in report["weights"]}
    assert set(weights) == {"weights_head0", "weights_all"}
    # measured (not an error); at --quick's sizes the allocator may serve a call from pages an
    # earlier one freed, so no growth (0) is a valid reading there, as for the rows above
    assert all(w["peak_bytes"] is not None and w["peak_bytes"] >= 0 for w in weights.values()), weights
    # A target is judged (True/False) exactly when the run measured what it needs, and says
    # "n/a" otherwise: --quick runs N = 256, 512 only, so the N >= 1024 targets must be n/a.
    for t in report["targets"]:
        assert (t["passed"] is None) == t["detail"].startswith("n/a"), t
    by_name = {t["target"]: t for t in report["targets"]}
    assert by_name["multihead within 5% of sdpa_raw, N>=1024"]["passed"] is None


@pytest.mark.slow
def test_masks_benchmark_quick(tmp_path):
    """benchmarks/masks.py at N = 512 (no flex: no compilation): every case timed, every ratio
    computed, and the packed-documents pair fraction right (it is the ideal printed beside it)."""
    out = tmp_path / "masks.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "masks.py"), "--quick", "--threads", "1",
                           "--no-memory", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert all(t > 0 for ts in report["times_s"].values() for t in ts)
    for name in ("window / torch causal", "document / torch causal", "uneven documents / torch causal",
                 "multihead causal / torch causal", "softcap / fused no mod",
                 "dropout fwd+bwd / fused causal fwd+bwd"):
        assert report["ratios"][name] > 0, name
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import masks as bench
    finally:
        sys.path.pop(0)
    ids = bench._uneven_ids(512)  # the benchmark's own document maker: its lengths are what this checks
    lengths = torch.bincount(ids).double()
    assert len(lengths) == bench.DOCS and bool((ids[1:] >= ids[:-1]).all())
    pairs = sum(int((ids[:i + 1] == ids[i]).sum()) for i in range(512))  # allowed (q, kv) pairs, counted
    assert abs(report["ratios"]["uneven documents: allowed pairs / causal's"] - pairs / (512 * 513 / 2)) < 1e-12


def test_local_decode_benchmark_quick(tmp_path):
    """benchmarks/local_decode.py --quick: three layers timed per round, ratios to the plain one."""
    out = tmp_path / "local_decode.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "local_decode.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert set(report["ms_per_token"]) == {"plain", "sliding_window=16", "softcap=50"}
    assert all(len(v) == 2 and min(v) > 0 for v in report["ms_per_token"].values())
    assert set(report["ratios"]) == {"sliding_window=16 / plain", "softcap=50 / plain"}


def test_a_benchmark_rewrites_only_its_section_of_a_docs_page(tmp_path):
    """`doc_section.write_section`: the block between the script's markers is replaced and the
    rest of the page kept (the hand-written sections of docs/benchmarks-decode.md, which a
    whole-page write dropped); a page without them gets the block at its end; a new page a
    title; the committed decode page has its markers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import doc_section
    finally:
        sys.path.pop(0)
    begin, end = doc_section.markers("decode.py")
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nwritten by hand\n\n{begin}\nold table\n{end}\n\n## Later\n\nmore by hand\n")
    doc_section.write_section(page, "new table\n", "decode.py", "Decode benchmark")
    assert page.read_text() == f"# Title\n\nwritten by hand\n\n{begin}\nnew table\n{end}\n\n## Later\n\nmore by hand\n"
    other = tmp_path / "other.md"
    other.write_text("# Other\n\nby hand\n")
    doc_section.write_section(other, "table", "decode.py", "Decode benchmark")
    assert other.read_text() == f"# Other\n\nby hand\n\n{begin}\ntable\n{end}\n"
    new = tmp_path / "sub" / "new.md"
    doc_section.write_section(new, "table", "decode.py", "Decode benchmark")
    assert new.read_text() == f"# Decode benchmark\n\nGenerated by `benchmarks/decode.py`.\n\n{begin}\ntable\n{end}\n"
    committed = (ROOT / "docs" / "benchmarks-decode.md").read_text()
    assert committed.index(begin) < committed.index(end) < committed.index("## How the decode split works")


def test_native_ab_benchmark_quick(tmp_path):
    """benchmarks/native_ab.py --quick: this checkout's kernel against HEAD's, both checked
    against a float64 softmax by the script, a row per geometry, length and thread count whose
    ratio is its two medians'. A revision git does not know is refused by name."""
    from multihead.kernels import native

    if native.library() is None:
        pytest.skip(f"no native library here: {native.unavailable()}")
    out = tmp_path / "ab.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = str(ROOT / "benchmarks" / "native_ab.py")
    proc = subprocess.run([sys.executable, script, "--quick", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["geometry"], r["L"], r["threads"]) for r in rows} == {
        (g, L, 1) for g in ("SmolLM2 9/3 x 64", "GQA 32/8 x 128", "Gemma 3 4/1 x 256") for L in (64, 256)}
    for r in rows:
        assert len(r["base_times_s"]) == len(r["new_times_s"]) == 2 and r["layers"] == 2
        assert r["new_over_base"] == pytest.approx(r["new_us"] / r["base_us"])
    assert len(report["base_commit"]) == 40 and report["machine"]["threads"] >= 1
    proc = subprocess.run([sys.executable, script, "--quick", "--base", "no-such-revision", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 1 and "no-such-revision" in proc.stderr
