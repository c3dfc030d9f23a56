"""`multihead lab` at the command line: the output folder is never lost, divergence and a
missing matplotlib end cleanly, help shows every default, one flag name per concept, and
`lab induction` trains the head geometry `multihead plan` prints, scaled to a CPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import parser_actions, subcommands
from lab_helpers import load_results
from multihead.cli import build_parser, main
from multihead.lab.configs import InductionConfig, scale_induction

KV_TINY = ["--quick", "--decode-steps", "1", "--no-progress"]
HEADS_TINY = ["--quick", "--head-counts", "1", "--seeds", "1", "--steps", "3", "--no-progress"]


def run(*args, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, **kw)


# ------------------------------------------------------------------ the output folder


@pytest.mark.slow
def test_a_non_empty_out_is_refused_and_force_replaces_only_a_complete_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["lab", "kv", *KV_TINY, "--out", str(out)]) == 0
    first = json.loads((out / "results.json").read_text())
    capsys.readouterr()

    assert main(["lab", "kv", *KV_TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--force" in err and "Traceback" not in err
    assert json.loads((out / "results.json").read_text()) == first

    # an interrupted --force run leaves the complete run in place and keeps its own beside it
    import multihead.lab.kv as kv

    real = kv.run_kv

    def interrupted(cfg, out_dir, **kw):
        def boom(name, step, loss):
            raise KeyboardInterrupt

        return real(cfg, out_dir, callback=boom, **kw)

    monkeypatch.setattr(kv, "run_kv", interrupted)  # a Ctrl-C injected mid-run, at a step the test picks
    assert main(["lab", "kv", *KV_TINY, "--out", str(out), "--force"]) == 130
    assert json.loads((out / "results.json").read_text()) == first, "a complete run was replaced by a partial one"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("run.interrupted-")]
    assert len(kept) == 1 and json.loads((kept[0] / "results.json").read_text())["interrupted"] is True
    assert "still holds the earlier run" in capsys.readouterr().out
    monkeypatch.undo()

    # a complete --force run replaces it, with no leftover staging folders, and the usual folder mode
    (out / "stale-plot.png").write_bytes(b"old")
    assert main(["lab", "kv", *KV_TINY, "--out", str(out), "--force", "--seed", "1"]) == 0
    new = json.loads((out / "results.json").read_text())
    assert new["seed"] == 1 and not (out / "stale-plot.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_out_that_cannot_hold_a_run_is_refused_before_training(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert main(["lab", "kv", *KV_TINY, "--out", str(a_file / "sub")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["lab", "kv", *KV_TINY, "--out", str(a_file)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    own = tmp_path / "own"
    own.mkdir()
    (own / "data.csv").write_text("1,2")
    assert main(["lab", "kv", *KV_TINY, "--out", str(own), "--force"]) == 2
    assert "only an earlier lab run's folder" in capsys.readouterr().err
    assert (own / "data.csv").read_text() == "1,2" and a_file.read_text() == "mine"


# ------------------------------------------------------------------ divergence, no matplotlib


@pytest.mark.slow
def test_a_diverging_run_says_so_and_records_the_step(tmp_path, capsys, one_torch_thread):
    out = tmp_path / "d"
    assert main(["lab", "heads", *HEADS_TINY, "--lr", "1e30", "--out", str(out)]) == 2
    cap = capsys.readouterr()
    assert "training diverged at step 2" in cap.out and "training diverged at step 2" in cap.err
    assert "--lr" in cap.err and "Traceback" not in cap.err
    res = load_results(out)
    assert res["diverged"] == [{"run": "heads H=1 seed 0", "step": 2, "reason": "loss nan"}]
    assert res["results"]["runs"][0]["diverged_at"] == 2 and res["checkpoint"] is None


@pytest.mark.slow
def test_induction_diverging_keeps_the_finite_evaluations(tmp_path, one_torch_thread):
    from dataclasses import replace

    from multihead.lab.induction import run_induction

    cfg = replace(InductionConfig.quick(), steps=4, eval_every=1, eval_sequences=8, score_sequences=1, lr=1e30)
    res = run_induction(cfg, tmp_path, progress=False)
    disk = load_results(tmp_path)  # every number finite: the schema check refuses NaN
    step = disk["diverged"][0]["step"]
    assert res["results"]["diverged_at"] == step and step <= 3
    assert [e["step"] for e in disk["results"]["evals"]] == list(range(step))
    assert "Training diverged at step" in disk["results"]["summary"]


NO_MPL = """
import sys
sys.modules["matplotlib"] = None  # `import matplotlib` raises ImportError, as without the package
from multihead.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_without_matplotlib_the_results_and_checkpoint_are_kept(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = run("-c", NO_MPL, "lab", "heads", *HEADS_TINY, "--out", str(tmp_path / "h"), env=env)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    notes = [line for line in r.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "plots skipped" in notes[0] and "pip install -e '.[lab]'" in notes[0]
    res = load_results(tmp_path / "h")
    assert res["plots"] == [] and res["checkpoint"] == "model" and "plots skipped" in res["notes"][0]
    assert not list((tmp_path / "h").glob("*.png"))
    assert (tmp_path / "h" / "model" / "model.safetensors").is_file()


# ------------------------------------------------------------------ help and flag names


def _experiment_parsers() -> dict[str, argparse.ArgumentParser]:
    return subcommands(subcommands(build_parser())["lab"])


def test_help_shows_every_default():
    for name, p in _experiment_parsers().items():
        for action in parser_actions(p):
            if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                       argparse._StoreTrueAction)):
                continue
            assert "default" in action.help, f"lab {name} {action.option_strings}: {action.help!r}"

    def help_of(name, flag):
        return next(a.help for a in parser_actions(_experiment_parsers()[name]) if flag in a.option_strings)

    # the numbers are the config dataclasses' own defaults (and --quick's)
    assert help_of("heads", "--steps").endswith("(default 400; --quick 120)")
    for flag, default in (("--batch-size", "32"), ("--lr", "0.001"), ("--context", "24")):
        assert f"(default {default}" in help_of("heads", flag), flag
    assert "(default 32" in help_of("kv", "--decode-steps") and "(default 2048" in help_of("kv", "--context")
    assert "(default 64" in help_of("mla", "--context")


def test_one_flag_name_per_concept():
    parsers = _experiment_parsers()
    # --n-kv-heads is one count (induction, as in plan); a list of counts to compare is --kv-head-counts
    assert "--n-kv-heads" in parsers["induction"].format_help()
    for name in ("kv", "mla", "uptrain"):
        text = parsers[name].format_help()
        assert "--kv-head-counts" in text and "--n-kv-heads" not in text, name
        assert "--kv-heads" not in text, name
    for name in ("mla", "induction"):
        text = parsers[name].format_help()
        assert "--n-layers" in text and "--layers" not in text.replace("--n-layers", "").replace("--only-layers", "")
    assert build_parser().parse_args(["lab", "kv", "--kv-head-counts", "4,2"]).kv_heads == (4, 2)
    with pytest.raises(SystemExit):  # no hidden alias: --kv-heads is not a flag
        build_parser().parse_args(["lab", "kv", "--kv-heads", "4,2"])
    assert build_parser().parse_args(["lab", "mla", "--n-layers", "3"]).n_layers == 3
    kv_device = next(a for a in parser_actions(parsers["kv"]) if "--device" in a.option_strings)
    assert "train" not in kv_device.help
    heads_device = next(a for a in parser_actions(parsers["heads"]) if "--device" in a.option_strings)
    assert "train" in heads_device.help


# ------------------------------------------------------------------ the plots


@pytest.fixture
def figures(monkeypatch):
    """Keep the figures the experiments draw instead of saving them."""
    import multihead.lab.plots as plots

    kept = []

    def keep(fig, path):
        kept.append(fig)
        return Path(path).name

    # each experiment calls the save_figure it imported, so it is replaced where each looks it up
    for module in ("heads", "kv", "mla_report", "induction"):
        monkeypatch.setattr(f"multihead.lab.{module}.save_figure", keep)  # the experiment module's own name
    monkeypatch.setattr(plots, "save_figure", keep)  # and at its home, for the callers that look it up there
    return kept


def test_kv_plot_labels_close_parameter_counts_apart(figures):
    pytest.importorskip("matplotlib")
    from multihead.lab.kv import KVConfig, _plot  # the plot alone, from rows: a run to make them trains models

    rows = [{"name": n, "kind": k, "params": p, "cache_bytes_bf16": 1024, "decode_us_per_token": 10.0}
            for n, k, p in (("GQA-2", "GQA", 49_152), ("MLA-32", "MLA", 50_208))]
    _plot(KVConfig.quick(), rows, Path("kv.png"), "cpu")
    labels = [t.get_text() for t in figures[0].axes[0].texts]
    assert labels == ["49,152", "50,208"]


def test_curves_plot_shows_the_first_segment(figures):
    pytest.importorskip("matplotlib")
    from multihead.lab.mla import MLAConfig
    from multihead.lab.mla_report import plot_curves as _plot_curves

    runs = [{"name": "MHA", "kind": "MHA", "interrupted": False, "diverged_at": None,
             "evals": [{"step": 0, "val_bpc": 6.3}, {"step": 40, "val_bpc": 3.1}, {"step": 80, "val_bpc": 2.6}]}]
    _plot_curves(MLAConfig.quick(), {"results": {"runs": runs}}, Path("curves.png"))
    lo, hi = figures[0].axes[0].get_ylim()
    assert lo < 2.6 and hi > 6.3, f"y range {lo:.2f}..{hi:.2f} clips the curve (2.6..6.3)"


def test_induction_plot_labels_the_target_and_chance_lines(figures):
    pytest.importorskip("matplotlib")
    from multihead.lab.induction import _plot  # the plot alone, from evals: a run to make them trains a model

    cfg = InductionConfig.quick()
    evals = [{"step": s, "accuracy": a, "previous_token": [[0.1] * cfg.n_heads] * 2,
              "induction": [[0.2] * cfg.n_heads] * 2} for s, a in ((0, 0.03), (50, 0.9))]
    _plot(cfg, {"results": {"evals": evals, "chance_accuracy": 1 / cfg.vocab, "phase_change_step": 50}},
          Path("induction.png"))
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert "target 95%" in legend and any(t.startswith("chance 3.1%") for t in legend)


# ------------------------------------------------------------------ induction: a plan's head geometry


@pytest.mark.parametrize("C, H, K", [(4096, 32, 4), (4096, 32, 32), (4096, 32, 1), (8192, 64, 8), (2048, 16, 2)])
def test_scaling_keeps_head_dim_and_group_ratio(C, H, K):
    fields, notes = scale_induction(layers=2, d_model=C, n_heads=H, n_kv_heads=K)
    D2 = fields["head_dim"]
    assert D2 == C // H, "head_dim kept"
    assert fields["n_heads"] // fields["n_kv_heads"] == H // K, "group ratio kept"
    assert fields["n_heads"] % fields["n_kv_heads"] == 0 and fields["d_model"] <= 256
    kind = lambda h, k: "MHA" if h == k else "MQA" if k == 1 else "GQA"  # noqa: E731
    assert kind(fields["n_heads"], fields["n_kv_heads"]) == kind(H, K), "the variant stays what it was"
    assert notes and f"head_dim {C // H}" in notes[0] and f"= {H // K} kept" in notes[0] and "d_model" in notes[0]
    InductionConfig(**fields)  # a valid config
    quick, quick_notes = scale_induction(layers=2, d_model=C, n_heads=H, n_kv_heads=K, quick=True)
    assert quick == {**fields, "steps": 100, "batch_size": 16, "eval_every": 25, "eval_sequences": 32}
    assert "smoke run" in quick_notes[-1]


def test_scaling_mla_and_small_geometries():
    fields, notes = scale_induction(layers=2, d_model=5120, n_heads=128, kv_rank=512, rope_dim=64)
    assert fields["attention"] == "mla" and fields["head_dim"] == 40 and fields["rope_dim"] == 64
    assert fields["n_heads"] == 4 and fields["kv_rank"] == 8 and "kv_rank 512 -> 8" in notes[0]
    assert scale_induction() == ({}, [])
    small, notes = scale_induction(d_model=64, n_heads=8, n_kv_heads=2)
    assert notes == [] and small["n_heads"] == 8 and small["n_kv_heads"] == 2  # fits a CPU: trained as asked
    for kw, message in (({"variant": "gqa"}, "needs --n-kv-heads"),
                        ({"n_kv_heads": 3},
                         r"^--n-heads \(4\) must be divisible by --n-kv-heads \(3\); valid: 1, 2, 4$"),
                        ({"variant": "mla"}, "needs --kv-rank"), ({"kv_rank": 8, "n_kv_heads": 2}, "MLA caches"),
                        ({"variant": "mqa", "n_kv_heads": 2}, "has 1 KV head"),
                        ({"rope_dim": 4}, "MLA's"),
                        ({"d_model": 100, "n_heads": 7},
                         r"^--d-model \(100\) must be divisible by --n-heads \(7\); "
                         r"valid: 1, 2, 4, 5, 10, 20, 25, 50, 100$")):
        with pytest.raises(ValueError, match=message):
            scale_induction(**kw)


@pytest.mark.slow
def test_the_command_plan_prints_runs(tmp_path, capsys, one_torch_thread):
    """The exact check `multihead plan --params ...` prints for a GQA geometry, with --quick."""
    out = tmp_path / "ind"
    argv = "lab induction --n-layers 2 --d-model 4096 --n-heads 32 --n-kv-heads 4 --quick --no-progress".split()
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "scaled to train in minutes on a CPU" in printed and "head_dim 128" in printed
    assert "--quick: a smoke run of 100 steps" in printed
    res = load_results(out, required=["geometry", "final_accuracy"])
    assert (res["config"]["steps"], res["config"]["batch_size"]) == (100, 16)
    g = res["results"]["geometry"]
    assert (g["variant"], g["head_dim"], g["n_heads"] // g["n_kv_heads"]) == ("GQA", 128, 8)
    assert "4 KV heads (GQA)" in g["scaled_from"]
    from multihead.checkpoint import load_lab_checkpoint

    model, _, _ = load_lab_checkpoint(out)
    attn = model.blocks[0].attn
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim) == (g["n_heads"], g["n_kv_heads"], 128)


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from multihead.cli import main

    assert main(["lab"]) == 2
    assert "choose an experiment" in capsys.readouterr().err
    assert main(["lab", "mla", "--quick", "--corpus", str(tmp_path / "missing.txt"), "--out", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    assert main(["lab", "mla", "--quick", "--corpus", str(short), "--out", str(tmp_path / "o")]) == 2
    assert "corpus too short" in capsys.readouterr().err
    assert main(["lab", "heads", "--head-counts", "1,x"]) == 2  # argparse's own error, returned
    assert "expected comma-separated integers" in capsys.readouterr().err
    assert main(["lab", "heads", "--quick", "--head-counts", "3", "--out", str(tmp_path / "h")]) == 2
    assert "d_model (64) must be divisible by n_heads (3); valid: 1, 2, 4, 8, 16, 32, 64" in capsys.readouterr().err


def test_an_in_process_run_leaves_torch_threads_as_it_found_them(tmp_path, capsys):
    # lab runs on one thread by default here; main() inside a notebook or a test must not keep it
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["lab", "kv", *KV_TINY, "--threads", "1", "--out", str(tmp_path / "kv")]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def test_a_400_digit_count_is_a_usage_error_not_an_overflow(capsys):
    # found by the random-argv pass: a huge int reached math.isfinite, which converts to float
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["lab", "induction", "--n-layers", "9" * 400])
    assert exit_.value.code == 2
    assert "expected a positive integer of at most 1024" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--lr", "--uptrain-lr"])
def test_a_learning_rate_float32_cannot_step_with_is_a_usage_error(flag, capsys):
    # 1e60 parsed as a float but overflowed the optimizer's float32 step deep inside torch
    experiment = "uptrain" if flag == "--uptrain-lr" else "heads"
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["lab", experiment, flag, "1e60"])
    assert exit_.value.code == 2
    assert "expected a positive learning rate of at most 1e+30; received '1e60'" in capsys.readouterr().err
    assert getattr(build_parser().parse_args(["lab", experiment, flag, "3e-4"]), flag[2:].replace("-", "_")) == 3e-4


@pytest.mark.parametrize("argv", [["kv", *KV_TINY], ["heads", *HEADS_TINY],
                                  ["induction", "--n-layers", "2", "--d-model", "4096", "--n-heads", "32",
                                   "--n-kv-heads", "4", "--quick", "--steps", "2", "--no-progress"]],
                         ids=lambda a: a[0])
def test_json_prints_the_results_json_and_nothing_else(argv, tmp_path, capsys, one_torch_thread):
    import json

    out = tmp_path / argv[0]
    assert main(["lab", *argv, "--json", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)  # stdout is the JSON alone
    assert printed == json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert printed["experiment"] == argv[0] and "results.json" not in captured.out
    if argv[0] == "induction":  # the scaling notes still reach the user, on stderr
        assert "multihead lab induction:" in captured.err and "head_dim 128" in captured.err
