"""`multihead inspect`: the role table on the real model, JSON, files, and bad input as one
clear line with exit code 2 (in process, and as a real subprocess: no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from multihead.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TEXT = "The cat sat on the mat."


@pytest.fixture(scope="module", autouse=True)
def minilm():
    from multihead.interop.loaders import load_model

    return load_model("minilm")  # loaded once; main() reuses it


def run(capsys, *argv):
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_prints_the_summary(capsys):
    """Per role its count and strongest heads, in at most 30 lines; MiniLM, an encoder, has no
    causal check and no induction head, and says so; --all puts the full table before it."""
    code, out, err = run(capsys, TEXT)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) <= 30 and not any(line.startswith("rank") for line in lines), out
    assert lines[0].startswith("minilm (sentence-transformers/all-MiniLM-L6-v2): 6 layers x 12 heads")
    assert "tokens: [CLS] the cat sat on the mat . [SEP]" in out
    rows = {line.split()[0]: line.split() for line in lines
            if line.startswith("  ") and not line.startswith("  top ") and line.split()[1].isdigit()}
    assert rows["previous_token"][1:4] == ["1", "L0H2", "1.00"], rows
    assert sum(int(r[1]) for r in rows.values()) == 72  # every head has one role
    assert "causal check: needs a decoder LM's next-token loss (this model is an encoder)" in out
    assert "induction heads (prefix matching on random tokens repeated once): none" in out
    assert lines[-1].startswith("next: multihead inspect")
    code, full, _ = run(capsys, TEXT, "--all")
    assert code == 0 and full.endswith(out)
    table = full[:-len(out)].splitlines()
    assert table[0].split()[:4] == ["rank", "layer", "head", "role"]
    assert len([r for r in table if r[:4].strip().isdigit()]) == 72


def test_roles_shows_every_head_and_score(capsys):
    code, out, _ = run(capsys, TEXT, "--roles", "--only-layers", "0,1")
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("rank"))
    for col in ("prev", "self", "first", "delim", "dup", "prefix", "entropy"):
        assert col in header.split()
    rows = [line for line in lines if line[:4].strip().isdigit()]
    assert len(rows) == 24
    assert rows[0].split()[:4] == ["1", "0", "2", "previous_token"]


def test_json(capsys):
    code, out, _ = run(capsys, TEXT, "--only-layers", "0", "--only-heads", "2,5", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["layers"] == [0] and data["heads"] == [2, 5] and len(data["tokens"]) == 9
    assert data["roles"][0]["layer"] == 0 and data["roles"][0]["head"] == 2
    assert data["roles"][0]["role"] == "previous_token" and data["roles"][0]["score"] > 0.99
    assert set(data["roles"][0]["scores"]) >= {"previous_token", "first_token", "entropy", "prefix_matching"}
    assert data["files"] == {}


def test_html_and_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    html, png, one = tmp_path / "view.html", tmp_path / "grid.png", tmp_path / "head.png"
    code, out, err = run(capsys, TEXT, "--only-layers", "0,3", "--only-heads", "2,5", "--html", str(html),
                         "--png", str(png))
    assert code == 0, err
    assert f"HTML head view: {html}" in out and f"PNG grid: {png}" in out
    page = html.read_text(encoding="utf-8")
    assert "<html" in page.lower() and "previous_token" in page
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, _ = run(capsys, TEXT, "--only-layers", "0", "--only-heads", "2", "--png", str(one))
    assert code == 0 and one.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_text_truncates_with_a_warning(capsys):
    code, out, err = run(capsys, "word " * 600, "--only-layers", "0", "--only-heads", "2", "--json")
    assert code == 0
    assert "multihead inspect: warning: text is 602 tokens, longer than the model's positions (512); " \
           "truncated to the first 512 tokens" in err
    assert len(json.loads(out)["tokens"]) == 512


@pytest.mark.parametrize("argv, message", [
    (["   "], "text is empty"),
    ([TEXT, "--only-layers", "6"], "layer 6 is out of range; valid: 0..5 (the model has 6 layers)"),
    ([TEXT, "--only-heads", "0,12"], "head 12 is out of range; valid: 0..11 (the model has 12 heads)"),
    ([TEXT, "--only-heads", "two"], "--only-heads takes comma-separated integers or ranges, e.g. --only-heads "
                                    "0,3 or --only-heads 0-3,7; received 'two' ('two' is not an integer)"),
    ([TEXT, "--only-heads", "1,,2"], "received '1,,2' (an empty item)"),
    ([TEXT, "--only-heads", "1,"], "received '1,' (an empty item)"),
    ([TEXT, "--only-heads", "3-1"], "(the range '3-1' runs backwards)"),
    ([TEXT, "--only-layers", "0-x"], "('0-x' is not an integer)"),
    ([TEXT, "--only-heads", "two"], "received 'two'"),
    ([TEXT, "--model", "no/such/model"], "model 'no/such/model' not found: no such folder. valid: 'minilm'"),
    ([TEXT, "--html", "no/such/dir/view.html"], "--html 'no/such/dir/view.html': the folder 'no/such/dir' does"),
    ([TEXT, "--max-tokens", "0"], "--max-tokens must be >= 1; received 0"),
])
def test_bad_input_in_process(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("multihead inspect: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert out == ""


def test_folder_that_is_not_a_model(capsys, tmp_path):
    code, _, err = run(capsys, TEXT, "--model", str(tmp_path))
    assert code == 2 and "is not a model folder: it has no config.json" in err


# ------------------------------------------------------------ real subprocesses


def cli(*argv, stdin=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "multihead", "inspect", *argv], input=stdin,
                          capture_output=True, text=True, env=env, timeout=300)


# One real process per kind of exit: the in-process cases above cover the messages.
@pytest.mark.parametrize("argv, message", [
    ([TEXT, "--only-layers", "a"], "--only-layers takes comma-separated integers"),
])
def test_subprocess_fast_errors(argv, message):
    r = cli(*argv)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_subprocess_not_a_model_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"hello": "world"}')
    r = cli(TEXT, "--model", str(tmp_path))
    assert r.returncode == 2 and "not a Hugging Face model folder" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # loads MiniLM in a fresh process: 20 s on 2 busy cores
def test_subprocess_real_model(tmp_path):
    """One real run: a head out of range fails cleanly; stdin text, truncation and JSON work."""
    r = cli(TEXT, "--only-heads", "12")
    assert r.returncode == 2 and "head 12 is out of range; valid: 0..11" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("-", "--only-layers", "0", "--only-heads", "2", "--json", stdin="word " * 600)
    assert r.returncode == 0, r.stderr
    assert "truncated to the first 512 tokens" in r.stderr and "Traceback" not in r.stderr
    assert "Loading weights" not in r.stderr  # progress bars are silenced
    data = json.loads(r.stdout)
    assert len(data["tokens"]) == 512 and data["layers"] == [0] and data["heads"] == [2]
    assert data["meta"]["truncated"]["tokens"] == 602


def test_ranges_are_accepted_and_json_has_the_runner_up(capsys):
    code, out, err = run(capsys, TEXT, "--only-layers", "0-1", "--only-heads", "0-3, 7", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["layers"] == [0, 1] and data["heads"] == [0, 1, 2, 3, 7]
    top = data["roles"][0]
    assert (top["layer"], top["head"], top["role"]) == (0, 2, "previous_token")
    assert top["runner_up"] in top["scores"] and top["runner_up_score"] == top["scores"][top["runner_up"]]


def test_the_command_leaves_the_process_as_it_found_it(capsys, monkeypatch):
    """In a notebook or a test, `main(["inspect", ...])` must not silence transformers for good."""
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    hf_logging.enable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    code, _, err = run(capsys, TEXT, "--only-layers", "0")
    assert code == 0, err
    assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == verbosity
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
