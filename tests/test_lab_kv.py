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
    with pytest.raises(ValueError, match="does not divide"):
        run_kv(replace(KVConfig.quick(), kv_heads=(3,)), "/nonexistent-never-written", progress=False)
