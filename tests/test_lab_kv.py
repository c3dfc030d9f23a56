"""`multihead lab kv` (quick): module numbers equal plan's, cache ratios, plot, Ctrl-C."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lab_helpers import assert_png, load_results
from multihead.lab.kv import KVConfig, run_kv


def test_quick_measures_and_agrees_with_plan(tmp_path, one_torch_thread):
    cfg = KVConfig.quick()
    res = run_kv(cfg, tmp_path, progress=False)
    disk = load_results(tmp_path, required=["rows", "plan_agrees", "table", "summary"])
    assert not disk["interrupted"] and disk["results"]["plan_agrees"] is True
    rows = {r["name"]: r for r in disk["results"]["rows"]}
    assert list(rows) == ["MHA", "GQA-2", "MQA", "MLA-32"]
    C, H, N = cfg.d_model, cfg.n_heads, cfg.context
    D = C // H
    for r in rows.values():
        assert r["params"] == r["params_plan"]
        assert r["cache_bytes_fp32"] == r["cache_bytes_fp32_plan"] == 2 * r["cache_bytes_bf16"]
        assert r["decode_us_per_token"] > 0
    assert rows["MHA"]["cache_bytes_fp32"] == 2 * H * D * N * 4
    assert rows["GQA-2"]["cache_vs_mha"] == 0.5 and rows["MQA"]["cache_vs_mha"] == 1 / H
    assert rows["MLA-32"]["cache_bytes_fp32"] == (32 + cfg.mla_rope_dim) * N * 4
    assert rows["MHA"]["params"] == 4 * C * C  # no biases
    assert "decode_naive_us_per_token" in rows["MLA-32"]
    assert res["checkpoint"] is None  # nothing is trained
    assert_png(tmp_path / "kv.png")


def test_ctrl_c_keeps_measured_rows(tmp_path, one_torch_thread):
    def callback(name, step, loss):
        if step == 2:
            raise KeyboardInterrupt

    run_kv(replace(KVConfig.quick(), decode_steps=2), tmp_path, callback=callback, progress=False)
    disk = load_results(tmp_path)
    assert disk["interrupted"] is True
    assert [r["name"] for r in disk["results"]["rows"]] == ["MHA", "GQA-2"]


def test_bad_geometry():
    with pytest.raises(ValueError, match=r"^n_heads \(4\) must be divisible by kv_heads \(3\); valid: 1, 2, 4$"):
        run_kv(replace(KVConfig.quick(), kv_heads=(3,)), "/nonexistent-never-written", progress=False)


def test_ratio_words_never_go_below_one():
    from multihead.lab.kv import _times

    assert _times(120.0, 100.0) == "1.2x slower"  # the bug: printed "0.8x slower"
    assert _times(100.0, 120.0) == "1.2x faster"
    assert _times(50.0, 500.0) == "10.0x faster"
    assert _times(100.0, 100.0) == "1.0x faster"


def test_summary_words_follow_the_measured_times():
    from multihead.lab.kv import _summary

    base = {"plan_agrees": True, "cache_bytes_fp32": 4, "cache_bytes_bf16": 2, "cache_vs_mha": 1.0}
    rows = [dict(base, name="MHA", kind="MHA", decode_us_per_token=100.0),
            dict(base, name="MLA-32", kind="MLA", decode_us_per_token=120.0, decode_naive_us_per_token=100.0)]
    text = _summary(KVConfig.quick(), rows, threads=1)
    assert "MLA-32: the absorbed step is 1.2x slower than decompressing" in text
    assert "Decode times are medians on 1 CPU thread (the kv default" in text
    assert "on 2 CPU threads." in _summary(KVConfig.quick(), rows, threads=2)


def test_the_command_times_decode_on_one_thread_by_default(tmp_path, capsys):
    import torch

    from multihead.cli import main

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["lab", "kv", "--quick", "--no-progress", "--out", str(tmp_path / "a")]) == 0
        res = load_results(tmp_path / "a")
        assert res["results"]["decode_threads"] == 1 and "on 1 CPU thread" in res["results"]["summary"]
        assert main(["lab", "kv", "--quick", "--no-progress", "--threads", "2", "--out", str(tmp_path / "b")]) == 0
        assert load_results(tmp_path / "b")["results"]["decode_threads"] == 2
    finally:
        torch.set_num_threads(before)
