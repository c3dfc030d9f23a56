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
