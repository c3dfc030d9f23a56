"""lab.common: results schema, progress, training loop, checkpoints."""

from __future__ import annotations

import json

# ------------------------------------------------------------------ tests of the shared parts
import os

import pytest
import torch

from multihead.lab.common import (
    Progress,
    ResultsSchemaError,
    check_results,
    new_results,
    train,
    write_json_atomic,
)


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


def test_progress_line_has_steps_loss_rate_and_eta():
    import io

    stream = io.StringIO()
    bar = Progress(100, "demo", stream=stream)
    for step in range(1, 101):
        bar.update(step, 1.0 / step, tokens=64)
    out = stream.getvalue().strip().splitlines()
    assert 5 <= len(out) <= 12, "a non-terminal stream gets about one line per 10%"
    assert out[-1].startswith("demo [" + "#" * 24 + "] 100/100 loss 0.0100 ")
    assert "tok/s ETA 0:00" in out[-1]


def test_train_stops_cleanly_on_ctrl_c(one_torch_thread):
    from multihead.lab.models import LabConfig, LabTransformer

    model = LabTransformer(LabConfig(vocab_size=8, max_len=8, d_model=16, n_heads=2))
    x = torch.randint(0, 8, (4, 8))

    def callback(name, step, loss):
        if step == 3:
            raise KeyboardInterrupt

    hist = train(model, lambda s: (x, x, None), 10, lr=1e-3, callback=callback, progress=False)
    assert hist["interrupted"] and hist["steps_done"] == 3 and len(hist["loss"]) == 3
    assert not model.training


def test_checkpoint_round_trip_and_inspect(tmp_path, one_torch_thread):
    from multihead.lab.checkpoint import Vocab, capture_lab, load_lab_checkpoint, save_lab_checkpoint
    from multihead.lab.models import LabConfig, LabTransformer

    for arch in ({}, {"attention": "mla", "kv_rank": 4}, {"n_kv_heads": 1, "mlp": False}):
        cfg = LabConfig(vocab_size=5, max_len=12, d_model=16, n_layers=2, n_heads=2, **arch)
        model = LabTransformer(cfg).eval()
        vocab = Vocab("symbols", ("a", "b", "c", "d", "SEP"))
        save_lab_checkpoint(tmp_path / "m", model, vocab, experiment="heads")
        loaded, v2, meta = load_lab_checkpoint(tmp_path / "m")
        assert loaded.cfg == cfg and v2 == vocab and meta["experiment"] == "heads"
        x = torch.tensor([vocab.encode("a b c SEP a b")])
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
        cap = capture_lab(tmp_path / "m", "a b c SEP a b", layers=[1], heads=[0])
        assert cap.weights.shape == (1, 1, 6, 6) and cap.tokens[3] == "SEP"
        torch.testing.assert_close(cap.weights.sum(-1), torch.ones(1, 1, 6))
    with pytest.raises(ValueError, match="does not know"):
        capture_lab(tmp_path / "m", "a z")
    with pytest.raises(ValueError, match="out of range"):
        capture_lab(tmp_path / "m", "a b", layers=[2])
    with pytest.raises(ValueError, match="not a multihead lab checkpoint"):
        load_lab_checkpoint(tmp_path)
    # multihead.inspect opens it through its own loader (the same weights)
    from multihead.inspect.capture import capture

    got = capture("a b c SEP a b", model=str(tmp_path / "m"))
    torch.testing.assert_close(got.weights, capture_lab(tmp_path / "m", "a b c SEP a b").weights)


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
    assert "does not divide" in capsys.readouterr().err
