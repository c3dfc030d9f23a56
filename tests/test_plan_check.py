"""The advice plan gives works: the check command it prints runs."""

import json

import pytest

from multihead.cli import main


@pytest.mark.slow
def test_the_printed_check_command_runs(capsys, tmp_path):
    """The advice works: the command plan prints runs (with --quick, and few steps to stay
    bounded) and trains the pick's head geometry, scaled to a CPU: the same head_dim and
    the same query heads per KV head."""
    assert main(["plan", "--params", "7B", "--context", "32k", "--batch-size", "16", "--json"]) == 0
    out = capsys.readouterr().out
    command = json.loads(out)["check"]["command"]
    argv = command.split()
    assert argv[:3] == ["multihead", "lab", "induction"]
    outdir = tmp_path / "check"
    code = main([*argv[1:], "--quick", "--steps", "10", "--no-progress", "--out", str(outdir)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads((outdir / "results.json").read_text())
    assert results["interrupted"] is False
    cfg = results["config"]  # the pick is GQA-4: 32 heads of 128, 4 KV heads, 2 layers
    assert (cfg["head_dim"], cfg["n_heads"] // cfg["n_kv_heads"], cfg["n_layers"]) == (128, 8, 2)


@pytest.mark.slow
def test_the_printed_mla_check_command_runs(capsys, tmp_path):
    """MLA advice carries --kv-rank and --rope-dim; the lab keeps head_dim and rope_dim."""
    assert main(["plan", "--params", "7B", "--variant", "mla", "--json"]) == 0
    command = json.loads(capsys.readouterr().out)["check"]["command"]
    assert "--variant mla" in command and "--kv-rank 512 --rope-dim 64" in command
    outdir = tmp_path / "check"
    code = main([*command.split()[1:], "--quick", "--steps", "5", "--no-progress", "--out", str(outdir)])
    assert code == 0, capsys.readouterr().err
    cfg = json.loads((outdir / "results.json").read_text())["config"]
    assert (cfg["head_dim"], cfg["rope_dim"], cfg["n_layers"]) == (128, 64, 2) and cfg["kv_rank"] >= 8
