"""`multihead lab uptrain` (quick): its fields, its numbers against an independent
re-evaluation of the saved baseline, determinism, Ctrl-C, --from a `lab mla` run."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lab_helpers import assert_png, load_results, numbers
from multihead import convert
from multihead.checkpoint import load_lab_checkpoint
from multihead.lab.mla import MLAConfig, load_corpus, run_mla
from multihead.lab.uptrain import UptrainConfig, run_uptrain

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("uptrain-quick")
    torch.set_num_threads(1)
    run_uptrain(UptrainConfig.quick(), out, progress=False)
    return out


def _val_bpc(model, cfg, seed=0):
    """Validation bits/char computed here, from the corpus and the documented split and windows."""
    text, _ = load_corpus(cfg.corpus, cfg.max_chars)
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text[-int(len(text) * cfg.val_fraction):]])
    gen = torch.Generator().manual_seed(1_000_003 + seed)
    total = 0.0
    for _ in range(cfg.eval_batches):
        starts = torch.randint(0, len(ids) - cfg.context - 1, (cfg.batch_size,), generator=gen).tolist()
        rows = torch.stack([ids[s:s + cfg.context + 1] for s in starts])
        with torch.no_grad():
            logits = model(rows[:, :-1])
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()))
    return total / cfg.eval_batches / math.log(2)


def test_quick_fields(quick):
    cfg = UptrainConfig.quick()
    disk = load_results(quick, required=["mha", "variants", "scratch", "claims", "summary", "table", "corpus"])
    assert disk["experiment"] == "uptrain" and not disk["interrupted"] and not disk["diverged"]
    r = disk["results"]
    H, D, L = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.n_layers
    assert r["mha"]["kv_bytes_per_token"] == 2 * H * D * L * 2  # bf16
    kv = {"MQA": 2 * 1 * D * L * 2, "GQA-2": 2 * 2 * D * L * 2, "MLA-8": 8 * L * 2}
    want = [(t, i, f) for t, inits in (("MQA", cfg.inits), ("GQA-2", cfg.inits), ("MLA-8", ("svd",)))
            for i in inits for f in cfg.fractions]
    assert [(v["target"], v["init"], v["uptrain_fraction"]) for v in r["variants"]] == want
    for v in r["variants"]:
        assert set(v) >= {"target", "init", "uptrain_fraction", "val_bits_per_char", "kv_bytes_per_token"}
        assert v["kv_bytes_per_token"] == kv[v["target"]]
        assert v["uptrain_steps"] == (0 if v["uptrain_fraction"] == 0 else max(1, round(v["uptrain_fraction"] * 80)))
        assert 0 < v["val_bits_per_char"] < 8
    assert [(s["target"], s["kv_bytes_per_token"]) for s in r["scratch"]] == list(kv.items())
    assert all(s["steps"] == cfg.steps and s["val_bits_per_char"] < 5.0 for s in r["scratch"])
    assert r["mha"]["val_bits_per_char"] < 5.0, "the baseline learned more than uniform (5.9 bits/char)"
    for claim in r["claims"].values():
        assert claim["held"] in (True, False, None) and claim["detail"]
    assert "Claim 1" in r["summary"] and "Claim 3" in r["summary"]
    assert disk["plots"] == ["uptrain.png", "frontier.png"] and disk["checkpoint"] == "model"
    assert_png(quick / "uptrain.png")
    assert_png(quick / "frontier.png")


def test_quick_numbers_are_those_of_the_saved_models(quick):
    """The baseline checkpoint, re-evaluated here, gives results.mha; converted here with
    to_gqa / to_mla, it gives the fraction-0 variants."""
    cfg = UptrainConfig.quick()
    r = load_results(quick)["results"]
    model, _, _ = load_lab_checkpoint(quick)
    assert _val_bpc(model, cfg) == pytest.approx(r["mha"]["val_bits_per_char"], abs=1e-5)
    at0 = {(v["target"], v["init"]): v["val_bits_per_char"] for v in r["variants"] if v["uptrain_fraction"] == 0}
    assert _val_bpc(convert.to_gqa(model, 1), cfg) == pytest.approx(at0["MQA", "mean"], abs=1e-5)
    assert _val_bpc(convert.to_gqa(model, 2, init="first"), cfg) == pytest.approx(at0["GQA-2", "first"], abs=1e-5)
    assert _val_bpc(convert.to_mla(model, 8), cfg) == pytest.approx(at0["MLA-8", "svd"], abs=1e-5)
    # the claims are read off these numbers
    g = {(v["target"], v["init"], v["uptrain_fraction"]): v["val_bits_per_char"] for v in r["variants"]}
    pairs = [(t, f) for t in ("MQA", "GQA-2") for f in cfg.fractions]
    wins = sum(g[t, "mean", f] < min(g[t, "first", f], g[t, "random", f]) for t, f in pairs)
    c1 = r["claims"]["mean_beats_first_and_random"]
    assert (c1["wins"], c1["of"], c1["held"]) == (wins, len(pairs), wins == len(pairs))


def test_same_seed_same_numbers(quick, tmp_path):
    run_uptrain(UptrainConfig.quick(), tmp_path, progress=False)
    assert numbers(load_results(tmp_path)["results"]) == numbers(load_results(quick)["results"])


def test_ctrl_c_keeps_what_finished(tmp_path):
    cfg = replace(UptrainConfig.quick(), steps=20, inits=("mean",), ranks=())

    def callback(name, step, loss):
        if "GQA-2" in name and "0.1" in name and step == 1:
            raise KeyboardInterrupt

    run_uptrain(cfg, tmp_path, callback=callback, progress=False)
    disk = load_results(tmp_path)
    assert disk["interrupted"] is True and disk["results"]["scratch"] == []
    got = [(v["target"], v["uptrain_fraction"]) for v in disk["results"]["variants"]]
    assert got == [("MQA", f) for f in cfg.fractions] + [("GQA-2", 0.0), ("GQA-2", 0.025), ("GQA-2", 0.05)]
    assert (tmp_path / "model" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    """A small `lab mla` run (d_model 64, wider than --quick's 32) to start uptraining from."""
    out = tmp_path_factory.mktemp("mla-run")
    torch.set_num_threads(1)
    run_mla(replace(MLAConfig.quick(), ranks=(4,), kv_heads=(), steps=24, finetune_steps=1, eval_batches=2), out,
            seed=3, progress=False)
    return out


def test_from_a_lab_mla_run(mla_run, tmp_path):
    mla = load_results(mla_run)
    cfg = replace(UptrainConfig.quick(), kv_heads=(2,), inits=("mean",), ranks=(), fractions=(0.0, 0.1),
                  from_checkpoint=str(mla_run))
    res = run_uptrain(cfg, tmp_path / "up", progress=False)
    r = res["results"]
    # the MHA of the mla run, validated on the same held-out windows: the same number
    assert r["mha"]["val_bits_per_char"] == pytest.approx(mla["results"]["runs"][0]["val_bpc"], abs=1e-9)
    assert r["mha"]["source"] == str(mla_run) and res["seed"] == 3
    assert res["config"]["d_model"] == mla["config"]["d_model"] == 64 and res["config"]["steps"] == 24
    assert [(v["target"], v["uptrain_steps"]) for v in r["variants"]] == [("GQA-2", 0), ("GQA-2", 2)]
    assert [s["target"] for s in r["scratch"]] == ["GQA-2"]


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from multihead.cli import main

    for argv, message in (
            (["--from", str(tmp_path / "nothing")], "--from"),
            (["--fractions", "0,2"], "fractions in [0, 1]"),
            (["--inits", "mean,avg"], "expected some of mean,first,random"),
            (["--kv-head-counts", "3"], "n_heads (4) must be divisible by n_kv_heads (3), a count below n_heads; "
                                    "valid: 1, 2"),
            (["--kv-ranks", "64"], "kv_rank must be at most d_model (32)"),
    ):
        assert main(["lab", "uptrain", "--quick", "--out", str(tmp_path / "o"), *argv]) == 2, argv
        text = capsys.readouterr().err
        assert message in text and "Traceback" not in text, (argv, text)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text('{"experiment": "heads", "config": {}, "seed": 0}')
    assert main(["lab", "uptrain", "--quick", "--out", str(tmp_path / "o2"), "--from", str(tmp_path / "run")]) == 2
    assert "a `lab heads` run; valid: the folder of a `lab mla` run" in capsys.readouterr().err


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    import json
    import shutil

    shutil.copytree(src, dst)
    res = json.loads((dst / "results.json").read_text())
    edit(res)
    (dst / "results.json").write_text(json.dumps(res))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["config"].update(d_model=None), "has config.d_model null; valid: a positive integer"),
    (lambda r: r["config"].update(steps="24"), 'has config.steps "24" (str); valid: a positive integer'),
    (lambda r: r["config"].update(n_heads=4.0), "has config.n_heads 4.0 (float); valid: a positive integer"),
    (lambda r: r["config"].update(lr=[1]), "has config.lr [1] (list); valid: a positive number"),
    (lambda r: r["config"].update(corpus=3), "has config.corpus 3 (int); valid: a path (a string) or null"),
    (lambda r: r.update(config=None), "has config null; valid: the settings of the run (an object)"),
    (lambda r: r.update(seed="3"), 'has seed "3" (str); valid: an integer'),
])
def test_from_a_run_with_a_null_or_mistyped_field_is_one_line_exit_2(mla_run, tmp_path, capsys, edit, message):
    from multihead.cli import main

    bad = _broken_copy(mla_run, tmp_path / "run", edit)
    assert main(["lab", "uptrain", "--quick", "--out", str(tmp_path / "o"), "--from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_from_a_run_checks_the_targets_against_the_runs_width(mla_run, tmp_path, capsys):
    """--quick's width is 32, the run's 64: --kv-ranks 40 fits the run (it is uptrained), 80
    does not, and the message says the run's width."""
    from multihead.cli import main

    argv = ["lab", "uptrain", "--quick", "--from", str(mla_run), "--kv-head-counts", "2", "--inits", "mean",
            "--fractions", "0", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "o80"), "--kv-ranks", "80"]) == 2
    err = capsys.readouterr().err
    assert "kv_rank must be at most d_model (64)" in err and "Traceback" not in err, err
    assert main([*argv, "--out", str(tmp_path / "o40"), "--kv-ranks", "40"]) == 0
    r = load_results(tmp_path / "o40")
    assert r["config"]["d_model"] == 64 and [v["target"] for v in r["results"]["variants"]] == ["GQA-2", "MLA-40"]


ROOT = Path(__file__).resolve().parent.parent


def doc_rows(res: dict) -> list[str]:
    """The Markdown rows docs/lab.md quotes from results.json: one per (target, init)."""
    r = res["results"]
    fractions = sorted({v["uptrain_fraction"] for v in r["variants"]})
    scratch = {s["target"]: s["val_bits_per_char"] for s in r["scratch"]}
    cells: dict = {}
    for v in r["variants"]:
        cells.setdefault((v["target"], v["init"], v["kv_bytes_per_token"]), {})[v["uptrain_fraction"]] = \
            v["val_bits_per_char"]
    rows = []
    for (target, init, kv), curve in cells.items():
        vals = " | ".join(f"{curve[f]:.3f}" if f in curve else "-" for f in fractions)
        rows.append(f"| {target} | {kv:,} | {init} | {vals} | {scratch.get(target, float('nan')):.3f} |")
    return rows


@pytest.mark.parametrize("folder, summary", [("uptrain", True), ("uptrain-rope", False)])
def test_the_docs_quote_the_committed_results(folder, summary):
    import json

    from multihead.lab.results import check_results

    committed = ROOT / "docs" / "lab" / folder / "results.json"
    if not committed.is_file():
        pytest.skip(f"no committed {folder} run yet")
    res = check_results(json.loads(committed.read_text(encoding="utf-8")),
                        required=["mha", "variants", "scratch", "summary"])  # the checkpoint is not committed
    for plot in res["plots"]:
        assert_png(committed.parent / plot)
    doc = (ROOT / "docs" / "lab.md").read_text(encoding="utf-8")
    section = doc[doc.index("`multihead lab uptrain`"):]
    for row in doc_rows(res):
        assert row in section, f"docs/lab.md lacks the row {row!r} of {committed}"
    if summary:
        assert res["results"]["summary"] in section, "docs/lab.md does not quote results.json's summary"
    mha = res["results"]["mha"]
    assert f"| MHA | {mha['kv_bytes_per_token']:,} | - | {mha['val_bits_per_char']:.3f} |" in section
    assert res["experiment"] == "uptrain" and not res["interrupted"] and res["config"]["steps"] == 1200


def test_a_rope_baseline_converts_to_mla_with_partial_rope(tmp_path):
    cfg = replace(UptrainConfig.quick(), positions="rope", kv_heads=(2,), inits=("mean",), ranks=(8,),
                  mla_rope_dims=(0, 4), fractions=(0.0, 0.1), steps=20)
    res = run_uptrain(cfg, tmp_path, progress=False)
    r = res["results"]
    L = cfg.n_layers
    got = [(v["target"], v["uptrain_fraction"], v["kv_bytes_per_token"]) for v in r["variants"]]
    assert got == [("GQA-2", 0.0, 2 * 2 * 8 * L * 2), ("GQA-2", 0.1, 64), ("MLA-8 rope 0", 0.0, 8 * L * 2),
                   ("MLA-8 rope 0", 0.1, 16), ("MLA-8 rope 4", 0.0, 12 * L * 2), ("MLA-8 rope 4", 0.1, 24)]
    assert [(s["target"], s["kv_bytes_per_token"]) for s in r["scratch"]] == [
        ("GQA-2", 64), ("MLA-8 rope 0", 16), ("MLA-8 rope 4", 24)]
    # the fraction-0 numbers are those of the saved baseline converted here, layer by layer
    model, _, _ = load_lab_checkpoint(tmp_path)
    assert model.cfg.positions == "rope"
    for b in model.blocks:
        b.attn = convert.to_mla(b.attn, 8, rope_dim=4)
    at0 = next(v for v in r["variants"] if v["target"] == "MLA-8 rope 4" and v["uptrain_fraction"] == 0)
    assert _val_bpc(model, cfg) == pytest.approx(at0["val_bits_per_char"], abs=1e-5)
