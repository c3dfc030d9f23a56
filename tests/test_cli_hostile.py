"""Hostile input to the `multihead` command: a user's mistake is one line on
stderr and exit code 2, a bug is a traceback and exit code 1, never a traceback for a
mistake, and nothing reads forever.

The cases once found are tested one by one; then hypothesis throws random argv
(every flag of every subcommand, read off the parser) and garbled config files at every
subcommand. Runs are in-process (`multihead.cli.main(argv)` with captured output) except
where the operating system matters (bytes that are not UTF-8 on the command line,
/dev/zero). Lab runs are made tiny (--quick, one step) so each example stays bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import parser_actions, subcommands
from multihead.cli import build_parser, main

SECONDS = 60  # no single command may take longer (the bounded-time promise)


def cli(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """Run `multihead argv` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdin
    sys.stdin = io.StringIO(stdin)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        sys.stdin = old
    took = time.perf_counter() - start
    assert took < SECONDS, f"multihead {argv!r} took {took:.0f} s"
    return code, out.getvalue(), err.getvalue()


def assert_clean(argv, code: int, out: str, err: str) -> None:
    """Exit 0 or 2; no traceback; an error is one line that says which command failed."""
    assert code in (0, 2), f"multihead {argv!r} exited {code}:\n{err[-3000:]}"
    assert "Traceback" not in out + err, f"multihead {argv!r} printed a traceback:\n{err[-3000:]}"
    if code == 2 and "usage:" not in err:  # argparse's own errors come with the usage lines
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1 and lines[0].startswith("multihead"), f"not one error line: {err!r}"


# ------------------------------------------------------------------ hostile files


@pytest.fixture(scope="module", autouse=True)
def in_a_scratch_folder(tmp_path_factory):
    """Random flags name relative paths (`--html x`): let them land in a scratch folder."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)



@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Hostile files and folders, plus one valid tiny lab checkpoint (so inspect can get as
    far as writing --html / --png)."""
    d = tmp_path_factory.mktemp("hostile")
    made = {}

    def write(name: str, data: bytes) -> str:
        (d / name).write_bytes(data)
        made[name] = str(d / name)
        return made[name]

    write("huge_number.json", b'{"model_type": "llama", "hidden_size": ' + b"9" * 400 + b"}")
    write("deep.json", b"[" * 100_000 + b"]" * 100_000)
    write("list_type.json", b'{"model_type": ["llama"]}')
    write("latin1.json", '{"model_type": "llama", "name": "caf\xe9"}'.encode("latin-1"))
    write("nan.json", b'{"model_type": "llama", "hidden_size": NaN}')
    write("inf.json", b'{"model_type": "llama", "hidden_size": 1e999}')
    write("empty.json", b"")
    write("not_json.json", b"model_type = llama")
    write("array.json", b"[1, 2, 3]")
    write("text.txt", b"just some text\n")
    write("binary.bin", bytes(range(256)) * 4)
    for name in ("huge_number", "deep", "list_type", "latin1"):  # the same, as model folders
        (d / f"folder_{name}").mkdir()
        (d / f"folder_{name}" / "config.json").write_bytes((d / f"{name}.json").read_bytes())
        made[f"folder_{name}"] = str(d / f"folder_{name}")
    bad_lab = d / "bad_lab"
    bad_lab.mkdir()
    (bad_lab / "config.json").write_text(json.dumps({"multihead_lab": {"architecture": {"vocab_size": "x"}},
                                                     "tokenizer": {"kind": "char", "tokens": 5}}))
    made["bad_lab"] = str(bad_lab)

    from multihead.checkpoint import Vocab, save_lab_checkpoint
    from multihead.decoder import LabConfig, LabTransformer

    save_lab_checkpoint(d / "lab", LabTransformer(LabConfig(vocab_size=3, max_len=8, d_model=8, n_heads=2)),
                        Vocab("symbols", ("a", "b", "c")), experiment="heads")
    made["lab"] = str(d / "lab")
    made["dir"] = str(d)
    # a non-regular file that is safe to aim writes at (never /dev/null: an atomic replace
    # that forgot to check would put a plain file in its place, system-wide)
    import socket

    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / "socket"))
    made["socket"] = str(d / "socket")
    made["under_a_file"] = str(d / "text.txt" / "sub" / "out.html")
    made["missing"] = str(d / "no" / "such" / "file.json")
    return made


# ------------------------------------------------------------------ the cases the issue lists


@pytest.mark.parametrize("name, expect", [
    ("huge_number.json", ["huge_number.json", "hidden_size", "400-digit"]),
    ("deep.json", ["deep.json", "deep"]),
    ("list_type.json", ["list_type.json", "model_type"]),
    ("latin1.json", ["latin1.json", "UTF-8"]),
    ("nan.json", ["nan.json"]),
    ("inf.json", ["inf.json", "hidden_size"]),
    ("empty.json", ["empty.json", "JSON"]),
])
def test_plan_config_errors_name_the_file_and_field(files, name, expect):
    for argv in (["plan", "--model", files[name]], ["plan", "--compare", files[name], files[name]]):
        code, out, err = cli(argv)
        assert_clean(argv, code, out, err)
        assert code == 2
        for part in expect:
            assert part in err, f"{part!r} not in {err!r}"


@pytest.mark.parametrize("name", ["folder_huge_number", "folder_deep", "folder_list_type", "folder_latin1",
                                  "bad_lab", "text.txt", "binary.bin", "missing"])
def test_inspect_refuses_garbled_model_folders(files, name):
    argv = ["inspect", "a b", "--model", files[name]]
    code, out, err = cli(argv)
    assert_clean(argv, code, out, err)
    assert code == 2


def test_inspect_html_and_png_to_places_that_cannot_be_written(files, tmp_path):
    for flag in ("--html", "--png"):
        for target, why in ((files["under_a_file"], "does not exist"), (files["dir"], "is a folder"),
                            ("/proc/multihead-view.out", "")):
            argv = ["inspect", "a b c", "--model", files["lab"], flag, target]
            code, out, err = cli(argv)
            assert_clean(argv, code, out, err)
            assert code == 2 and why in err, err
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        code, out, err = cli(["inspect", "a b", "--model", files["lab"], "--html", str(ro / "v.html")])
        assert code == 2 and "permission denied" in err


def test_writes_never_replace_what_is_not_a_regular_file(files, tmp_path):
    for flag in ("--html", "--png"):
        argv = ["inspect", "a b", "--model", files["lab"], flag, files["socket"]]
        code, out, err = cli(argv)
        assert_clean(argv, code, out, err)
        assert code == 2 and "not a regular file" in err
        assert stat.S_ISSOCK(os.stat(files["socket"]).st_mode), "the socket was replaced by a file"


def test_inspect_html_and_png_over_a_private_file_keep_its_mode(files, tmp_path):
    """An atomic replace keeps the replaced file's mode: a user's 0600 page stays 0600."""
    for flag, name in (("--html", "v.html"), ("--png", "v.png")):
        target = tmp_path / name
        target.write_bytes(b"old")
        target.chmod(0o600)
        argv = ["inspect", "a b c", "--model", files["lab"], flag, str(target)]
        code, out, err = cli(argv)
        assert code == 0, err
        assert target.read_bytes() != b"old"
        assert stat.S_IMODE(os.stat(target).st_mode) == 0o600, f"{flag}: {oct(os.stat(target).st_mode)}"


def test_inspect_png_without_matplotlib_is_one_line_and_keeps_the_rest(files, tmp_path):
    """matplotlib unimportable: exit 2 with one error line after the table; the HTML is written."""
    html, png = tmp_path / "v.html", tmp_path / "v.png"
    # one process, two runs (table, then --json); the first run's page is moved aside
    code = ("import os, sys; sys.modules['matplotlib'] = None; from multihead.cli import main\n"
            f"argv = ['inspect', 'a b c a b', '--model', {files['lab']!r}, '--html', {str(html)!r}, "
            f"'--png', {str(png)!r}]\n"
            "first = main(argv)\n"
            f"os.rename({str(html)!r}, {str(html) + '.first'!r})\n"
            "print('=====', flush=True)\n"
            "second = main(argv + ['--json'])\n"
            "print('exits', first, second, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SECONDS,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1] == "exits 2 2", r.stderr
    assert len(lines) == 3 and all(line.startswith("multihead inspect: error: --png") for line in lines[:2]), r.stderr
    assert all("matplotlib" in line and "HTML view were produced" in line for line in lines[:2])
    table, as_json = r.stdout.split("=====\n")
    assert "roles of the" in table and "HTML head view" in table
    assert json.loads(as_json)["files"] == {"html": str(html.resolve())}
    assert Path(str(html) + ".first").is_file() and html.is_file() and not png.exists()


def test_inspect_text_that_is_not_utf8(files):
    code, out, err = cli(["inspect", "a \udcff b", "--model", files["lab"]])  # how Python sees argv bytes 0xff
    assert code == 2 and "not valid UTF-8" in err and "Traceback" not in err
    r = subprocess.run([sys.executable, "-m", "multihead", "inspect", b"a \xff\xfe b", "--model", files["lab"]],
                       capture_output=True, timeout=SECONDS)
    assert r.returncode == 2 and b"UTF-8" in r.stderr and b"Traceback" not in r.stderr, r.stderr


def test_lab_out_under_a_file(files):
    argv = ["lab", "kv", "--quick", "--out", str(Path(files["text.txt"]) / "run")]
    code, out, err = cli(argv)
    assert_clean(argv, code, out, err)
    assert code == 2 and "is a file, not a folder" in err


def test_config_dev_zero_is_refused_at_once():
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "multihead", "plan", "--model", "/dev/zero"], capture_output=True,
                       text=True, timeout=SECONDS)
    assert r.returncode == 2 and "/dev/zero" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.perf_counter() - start < 30


def test_a_bug_is_a_traceback_and_exit_1_and_debug_shows_every_traceback(monkeypatch, files):
    import multihead.tour as tour

    def broken(args):
        raise RuntimeError("an internal invariant failed")

    monkeypatch.setattr(tour, "main", broken)  # a bug injected: no input makes the real tour raise one
    code, out, err = cli(["tour"])
    assert code == 1 and "Traceback" in err and "RuntimeError: an internal invariant failed" in err
    assert "bug in multihead" in err
    monkeypatch.undo()
    argv = ["plan", "--model", files["deep.json"]]
    assert "Traceback" not in cli(argv)[2]
    for debug in (["--debug", *argv], [*argv, "--debug"]):
        code, out, err = cli(debug)
        assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("multihead plan: error:")


def test_argparse_errors_and_help_return_instead_of_exiting(capsys):
    assert main(["--version"]) == 0
    assert main(["plan", "--help"]) == 0
    assert main(["lab", "heads", "--steps", "ten"]) == 2
    assert main(["no-such-command"]) == 2
    assert main([]) == 2
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------ property: random argv, garbled files


def _flags() -> dict[tuple[str, ...], list[argparse.Action]]:
    """(subcommand path) -> its option actions, read off the real parser."""
    out = {}

    def walk(parser, path):
        subs = subcommands(parser)
        opts = [a for a in parser_actions(parser)
                if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]
        if not subs:
            out[path] = opts
        for name, child in subs.items():
            walk(child, (*path, name))

    walk(build_parser(), ())
    return out


FLAGS = _flags()
HOSTILE_VALUES = ["0", "-1", "1", "2", "3", "4", "7", "8", "16", "64", "9" * 400, "1e400", "1e30", "nan", "inf",
                  "-inf", "0.5", "", " ", "\udcff", "caf\xe9", "1,2", "1,,x", "8,4,2,1", "4,2", "x", "--", "-",
                  "mla", "gqa", "cpu", "cuda", "7B", "32k", "80GB", "h100-80gb", "llama"]
FILE_KEYS = ["huge_number.json", "deep.json", "list_type.json", "latin1.json", "nan.json", "empty.json",
             "not_json.json", "array.json", "text.txt", "binary.bin", "folder_deep", "bad_lab", "dir", "missing",
             "under_a_file", "socket", "/proc"]


@st.composite
def argvs(draw, files: dict[str, str], commands: list[tuple[str, ...]]):
    path = draw(st.sampled_from(commands))
    actions = FLAGS[path]
    value = st.one_of(st.sampled_from(HOSTILE_VALUES), st.integers(-2, 64).map(str),
                      st.sampled_from(FILE_KEYS).map(lambda k: files.get(k, k)), st.text(max_size=6))
    argv = list(path)
    if path == ("inspect",):
        argv.append(draw(st.one_of(st.sampled_from(["a b", "a b c a b", "", " ", "-", "\udcff", "z"]),
                                   st.text(max_size=8))))
    for _ in range(draw(st.integers(0, 5))):
        action = draw(st.sampled_from(actions))
        argv.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs != 0:
            argv += [draw(value) for _ in range(2 if action.nargs == "+" and draw(st.booleans()) else 1)]
    if path == ("inspect",):  # never the bundled MiniLM (seconds to load): a hostile or a tiny model
        argv += ["--model", draw(st.sampled_from([files["lab"], files["lab"], files["bad_lab"],
                                                  files["folder_deep"], files["text.txt"]]))]
    return argv


def _tiny_lab(argv: list[str], out: Path) -> list[str]:
    """Whatever the random flags said, a lab run is tiny: --quick, one step, a fresh --out."""
    tail = ["--quick", "--no-progress", "--out", str(out), "--threads", "1"]
    if argv[1] != "kv":
        tail += ["--steps", "1"]
    else:
        tail += ["--decode-steps", "1"]
    return argv + tail


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_random_argv_for_plan_inspect_tour(files, data):
    commands = [p for p in FLAGS if p[0] in ("plan", "inspect", "tour")]
    argv = data.draw(argvs(files, commands))
    if argv[0] == "tour":  # the tour builds float64 modules: keep its widths small, whatever was drawn
        argv += ["--d-model", "16", "--n-heads", "4", "--context", "64"]
    code, out, err = cli(argv, stdin=data.draw(st.sampled_from(["a b", "", "\udcff"])))
    assert_clean(argv, code, out, err)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_random_argv_for_lab(files, tmp_path_factory, data):
    argv = data.draw(argvs(files, [p for p in FLAGS if p[0] == "lab" and len(p) == 2]))
    argv = [a for a in argv if a not in ("--out", "--force")]  # the tail chooses the folder
    argv = _tiny_lab(argv, tmp_path_factory.mktemp("lab") / "out")
    code, out, err = cli(argv)
    assert_clean(argv, code, out, err)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.one_of(
    st.binary(max_size=300),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                 lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                 max_leaves=12).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"model_type": st.sampled_from(["llama", "gpt2", "bert", "mistral", "deepseek_v2", "x"])},
                          optional={k: st.one_of(st.integers(-5, 10**40), st.floats(), st.text(max_size=4),
                                                 st.lists(st.integers(0, 8), max_size=3), st.none())
                                    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                              "num_hidden_layers", "intermediate_size", "vocab_size",
                                              "head_dim", "kv_lora_rank", "max_position_embeddings")})
    .map(lambda d: json.dumps(d).encode()),
))
def test_garbled_config_files(tmp_path_factory, content):
    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_bytes(content)
    for argv in (["plan", "--model", str(d / "config.json")], ["plan", "--model", str(d)],
                 ["inspect", "a b", "--model", str(d)]):
        code, out, err = cli(argv)
        assert_clean(argv, code, out, err)
