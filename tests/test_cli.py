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


def test_tour_json_is_the_table_with_numbers_from_the_formulas(capsys):
    import json

    C, H, T = 256, 4, 1024
    assert main(["tour", "--d-model", str(C), "--n-heads", str(H), "--context", str(T), "--json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # stdout is the JSON alone
    assert doc["schema"] == "multihead.tour/1" and doc["ok"] is True
    assert (doc["d_model"], doc["n_heads"], doc["head_dim"], doc["context"], doc["seed"]) == (C, H, C // H, T, 0)
    rows = {r["variant"]: r for r in doc["variants"]}
    assert {name: r["n_kv_heads"] for name, r in rows.items()} == {"MHA": 4, "GQA": 1, "MQA": 1}
    for r in rows.values():
        kv_width = r["n_kv_heads"] * (C // H)
        # q and o are C x C, k and v C x kv_width, each with a bias
        assert r["params"] == 2 * (C * C + C) + 2 * (C * kv_width + kv_width)
        # a key and a value of kv_width bf16 numbers per token
        assert r["cache_bytes_per_token"] == 2 * kv_width * 2
        assert r["cache_bytes_at_context"] == r["cache_bytes_per_token"] * T
        assert r["max_abs_error_reference"] < 1e-10 and r["max_abs_error_decode"] < 1e-10


def test_bad_input_exits_2_with_one_line():
    r = run("tour", "--d-model", "100", "--n-heads", "7")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "--d-model (100) must be divisible by --n-heads (7); valid: 1, 2, 4, 5, 10, 20, 25, 50, 100" in r.stderr


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
