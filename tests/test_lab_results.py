"""lab.results: the results.json skeleton, its atomic write and its schema."""

from __future__ import annotations

import json
import os

import pytest

from multihead.lab.results import ResultsSchemaError, check_results, new_results, write_json_atomic


def test_atomic_write_keeps_the_old_file_when_the_replace_fails(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_json_atomic(path, {"a": 1})

    def boom(src, dst):
        raise KeyboardInterrupt  # Ctrl-C at the worst moment

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_json_atomic(path, {"a": 2, "big": list(range(10_000))})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"], "a temporary file was left behind"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask, "readable like any file the user writes"


def test_atomic_write_refuses_nan_and_unknown_types(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"x": float("nan")})  # NaN becomes null, never invalid JSON
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": None}
    with pytest.raises(TypeError, match="cannot write"):
        write_json_atomic(tmp_path / "r.json", {"x": object()})


def test_schema_check(tmp_path):
    res = new_results("heads", {"steps": 3}, 0, "cpu")
    check_results(res)
    for key, bad in (("seed", "0"), ("interrupted", 1), ("experiment", "nope"), ("plots", "a.png")):
        broken = {**res, key: bad}
        with pytest.raises(ResultsSchemaError):
            check_results(broken)
    broken = dict(res)
    del broken["config"]
    with pytest.raises(ResultsSchemaError, match="config"):
        check_results(broken)
    with pytest.raises(ResultsSchemaError, match="lacks 'x'"):
        check_results(res, required=["x"])
    with pytest.raises(ResultsSchemaError, match="missing"):
        check_results({**res, "plots": ["gone.png"]}, tmp_path)
    with pytest.raises(ResultsSchemaError, match="non-finite"):
        check_results({**res, "results": {"v": float("inf")}})


# ------------------------------------------------------- one run per output folder

KV_TINY = ["--quick", "--decode-steps", "1", "--no-progress"]


def _lab(out, **kw):
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "multihead", "lab", "kv", *KV_TINY, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def test_two_lab_runs_started_together_on_one_new_out(tmp_path):
    """Both used to find the new folder empty, both exit 0, one run's results lost: now one
    runs, the other says in one line that the folder is in use and exits 2."""
    out = tmp_path / "run"
    procs = [_lab(out), _lab(out)]
    done = [(p.wait(timeout=240), *p.communicate()) for p in procs]
    codes = sorted(rc for rc, _, _ in done)
    assert codes == [0, 2], [d[0] for d in done] + [d[2][-1500:] for d in done]
    _, _, err = next(d for d in done if d[0] == 2)
    lines = [line for line in err.splitlines() if line.strip()]
    # the second run either found the lock or (started later) the finished folder: one line either way
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "in use by another multihead lab run" in err or "is not empty" in err, err
    check_results(None, out)
    assert not list(tmp_path.glob(".*.lock")), "the lock outlived the run"


def test_a_held_out_folder_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    import subprocess
    import sys

    from multihead.cli import main
    from multihead.errors import UsageError
    from multihead.lab.results import lock_out

    out = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".run.lock").write_text(f"{other.pid}\n")  # a live run holds it
        assert main(["lab", "kv", *KV_TINY, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"in use by another multihead lab run (pid {other.pid}" in err and len(err.strip().splitlines()) == 1
        assert not out.exists()  # nothing written
        with pytest.raises(UsageError, match=str(other.pid)):
            with lock_out(out):
                pass
    finally:
        other.kill()
        other.wait()
    # the holder is gone (killed, never released): its lock is stale and taken over
    with lock_out(out):
        assert (tmp_path / ".run.lock").read_text().strip() == str(os.getpid())
    assert not (tmp_path / ".run.lock").exists()  # released at the end of the block
    with pytest.raises(KeyboardInterrupt):  # and on Ctrl-C
        with lock_out(out):
            raise KeyboardInterrupt
    assert not (tmp_path / ".run.lock").exists()
