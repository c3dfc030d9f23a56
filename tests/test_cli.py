"""The `multihead` command: the tour runs and checks itself; bad input exits 2 without a traceback."""

import subprocess
import sys

import multihead
from multihead.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "multihead", *args], capture_output=True, text=True, timeout=300)


def test_tour_checks_every_variant():
    r = run()
    assert r.returncode == 0, r.stderr
    assert "all variants equal the NumPy reference" in r.stdout
    for name in ("MHA", "GQA", "MQA"):
        assert f"\n{name} " in r.stdout


def test_tour_numbers_match_cache_formula(capsys):
    assert main(["tour", "--d-model", "256", "--n-heads", "4", "--context", "1024"]) == 0
    out = capsys.readouterr().out
    # MHA, 4 kv heads of 64, bf16: 2 * 4 * 64 * 2 = 1024 bytes per token
    assert "1,024 B" in out and "1.00 MiB" in out


def test_bad_input_exits_2_with_one_line():
    r = run("tour", "--d-model", "100", "--n-heads", "7")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "--d-model (100) must be a positive multiple of --n-heads (7)" in r.stderr


def test_version_and_light_import():
    r = run("--version")
    assert r.stdout.strip() == f"multihead {multihead.__version__}"
    code = "import sys, multihead; multihead.__version__; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_subcommand_builds_its_parser_without_torch():
    # the parser imports each tool's cli module (and its package): none may wait for torch
    code = ("import sys; from multihead import cli; cli.build_parser(); "
            "assert {'multihead.heads.cli', 'multihead.lab.cli'} <= set(sys.modules); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('multihead'))")
    subprocess.run([sys.executable, "-c", code], check=True)
