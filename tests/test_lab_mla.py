"""`multihead lab mla` (quick) and the shipped corpus."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from importlib import resources

import pytest
import torch

from lab_helpers import assert_png, load_results
from multihead.decoder import LabConfig, LabTransformer
from multihead.lab.mla import MLAConfig, convert_model, load_corpus, run_mla

# Uniform over the KJV's ~60 characters is 5.9 bits/char, unigram frequencies ~4.3; the
# quick run gets ~3.4. Below 4.0 means it learned more than character frequencies.
LEARNED_BPC = 4.0


def test_shipped_corpus_matches_its_provenance():
    data = resources.files("multihead").joinpath("data/kjv.txt.xz").read_bytes()
    assert len(data) < 2 * 2**20, "keep the shipped corpus under 2 MB"
    text, name = load_corpus()
    prov = resources.files("multihead").joinpath("data/KJV_PROVENANCE.md").read_text(encoding="utf-8")
    digest = re.search(r"`([0-9a-f]{64})`", prov).group(1)
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == digest
    assert text.startswith("In the beginning God created the heaven and the earth.\n")
    assert text.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert text.count("\n") == 31102 and not any(c.isdigit() for c in text)
    assert "King James" in name


def test_quick_learns_and_validates(tmp_path, one_torch_thread):
    cfg = MLAConfig.quick()
    res = run_mla(cfg, tmp_path, progress=False)
    disk = load_results(tmp_path, required=["runs", "conversions", "corpus", "smallest_rank_within_tolerance",
                                            "table", "summary"])
    assert not disk["interrupted"]
    runs = {r["name"]: r for r in disk["results"]["runs"]}
    assert list(runs) == ["MHA", "MQA", "MLA-4", "MLA-16"]
    for r in runs.values():
        assert r["evals"][0]["val_bpc"] > 5.0, "starts near uniform"
        assert r["val_bpc"] < LEARNED_BPC, f"{r['name']}: {r['val_bpc']:.2f} bits/char"
    H, D, L = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.n_layers
    assert runs["MHA"]["cache_bytes_per_token"] == 2 * H * D * L * 2  # bf16
    assert runs["MLA-4"]["cache_bytes_per_token"] == 4 * L * 2
    assert runs["MLA-4"]["under_budget"] and not runs["MQA"]["under_budget"]
    pick = disk["results"]["smallest_rank_within_tolerance"]
    ok = [r["kv_rank"] for r in runs.values() if r["kind"] == "MLA" and r["under_budget"] and r["within_tolerance"]]
    assert pick == (min(ok) if ok else None)
    conv = disk["results"]["conversions"]
    assert [c["kv_rank"] for c in conv] == [4, 16]
    assert conv[0]["kv_reconstruction_error"][0] > conv[1]["kv_reconstruction_error"][0] > 0
    for c in conv:
        assert c["val_bpc_finetuned"] < LEARNED_BPC
    assert_png(tmp_path / "mla.png")
    assert_png(tmp_path / "curves.png")
    assert res["checkpoint"] == "model"


def test_to_mla_at_full_rank_is_the_same_model(one_torch_thread):
    torch.manual_seed(0)
    model = LabTransformer(LabConfig(vocab_size=11, max_len=16, d_model=16, n_layers=2, n_heads=4)).eval()
    full, errors = convert_model(model, 16)
    x = torch.randint(0, 11, (2, 16))
    torch.testing.assert_close(full(x), model(x), atol=2e-5, rtol=1e-4)
    assert max(errors) < 1e-6
    low, errors = convert_model(model, 2)
    assert min(errors) > 0.1 and low.cfg.kv_rank == 2 and low.cfg.attention == "mla"


def test_any_utf8_corpus(tmp_path, one_torch_thread):
    text = "".join(f"ünïcödé line {i % 7} — the quick brown fox.\n" for i in range(2000))
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    cfg = replace(MLAConfig.quick(), corpus=str(tmp_path / "c.txt"), max_chars=None, ranks=(4,), kv_heads=(),
                  steps=20, finetune_steps=2, eval_batches=1)
    res = run_mla(cfg, tmp_path / "out", progress=False)
    assert res["results"]["corpus"]["vocab_size"] == len(set(text))
    assert res["results"]["runs"][1]["val_bpc"] < res["results"]["runs"][1]["evals"][0]["val_bpc"]
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00 not utf-8" * 100)
    with pytest.raises(ValueError, match="not UTF-8"):
        run_mla(replace(cfg, corpus=str(tmp_path / "bad.txt")), tmp_path / "o2", progress=False)


def test_ctrl_c_during_the_sweep(tmp_path, one_torch_thread):
    cfg = replace(MLAConfig.quick(), steps=6, finetune_steps=2, eval_every=3, eval_batches=1)

    def callback(name, step, loss):
        if "MLA-4" in name and step == 2:
            raise KeyboardInterrupt

    run_mla(cfg, tmp_path, callback=callback, progress=False)
    disk = load_results(tmp_path)
    assert disk["interrupted"] is True
    assert [(r["name"], r["interrupted"]) for r in disk["results"]["runs"]] == [
        ("MHA", False), ("MQA", False), ("MLA-4", True)]
    assert disk["results"]["conversions"] == []
    assert (tmp_path / "model" / "model.safetensors").is_file()


def _run(name, kind, cache, bpc, rank=None):
    return {"name": name, "kind": kind, "cache_bytes_per_token": cache, "val_bpc": bpc, "params": 1000,
            "kv_rank": rank, "interrupted": False, "diverged_at": None}


def test_conclusion_gives_the_unit_and_the_margin():
    from multihead.lab.configs import MLAConfig
    from multihead.lab.mla_report import summarise_mla

    cfg = MLAConfig()  # tolerance 1 bit/char, budget 1/8
    runs = [_run("MHA", "MHA", 1024, 2.000), _run("MLA-16", "MLA", 64, 2.350, 16), _run("MLA-32", "MLA", 96, 2.100, 32)]
    res = {"results": {"runs": runs, "conversions": []}}
    summarise_mla(cfg, res)
    text = res["results"]["summary"]
    assert "validation loss within 1 bit/char of MHA's is kv_rank = 16" in text, text
    assert "at 2.350 bits/char, 0.350 bits/char above MHA, a margin of 0.650 bits/char to the tolerance" in text
    assert "The best MLA rank is 32 at 2.100 bits/char (0.100 bits/char above MHA)" in text
    assert "within 1 of MHA" not in text
    # none within tolerance: how far past it the closest is
    runs = [_run("MHA", "MHA", 1024, 2.0), _run("MLA-16", "MLA", 64, 3.25, 16)]
    res = {"results": {"runs": runs, "conversions": []}}
    summarise_mla(cfg, res)
    assert "the closest, kv_rank 16, is 1.250 bits/char above MHA, 0.250 bits/char past the tolerance" in \
        res["results"]["summary"]
