"""multihead.files: every file written atomically with the usual mode; user JSON read bounded,
with errors that name the file and the field."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from multihead.files import atomic_path, read_json, usual_mode, write_json, write_text


@pytest.fixture
def umask_027():
    """A umask other than the common 022, so "the usual mode" is not a coincidence."""
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_writes_get_the_mode_open_would_give(tmp_path, umask_027):
    assert usual_mode() == umask_027 and usual_mode(folder=True) == 0o750
    write_text(tmp_path / "a.txt", "x")
    write_json(tmp_path / "b.json", {"a": 1})
    with atomic_path(tmp_path / "c.bin") as tmp:
        tmp.write_bytes(b"y")
    plain = tmp_path / "plain.txt"
    plain.write_text("z")
    for name in ("a.txt", "b.json", "c.bin"):
        assert mode(tmp_path / name) == mode(plain) == 0o640, name


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "page.html"
    write_text(path, "old page")
    with pytest.raises(UnicodeEncodeError):
        write_text(path, "new page with a lone surrogate \udcff")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half a page")
            raise RuntimeError("the writer failed")
    assert path.read_text() == "old page"
    assert [p.name for p in tmp_path.iterdir()] == ["page.html"]


def test_never_replaces_a_folder_device_or_pipe_and_writes_through_symlinks(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    for target in (fifo, tmp_path / "folder"):
        with pytest.raises(ValueError, match="will not replace it"):
            write_text(target, "x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and (tmp_path / "folder").is_dir()
    real = tmp_path / "real.txt"
    real.write_text("old")
    (tmp_path / "link.txt").symlink_to(real)
    write_text(tmp_path / "link.txt", "new")
    assert (tmp_path / "link.txt").is_symlink() and real.read_text() == "new"


def test_save_html_never_truncates_an_existing_page(tmp_path):
    import torch

    from multihead.inspect.capture_types import AttentionCapture
    from multihead.inspect.html import render_html, save_html

    w = torch.softmax(torch.randn(1, 1, 3, 3), -1)
    good = AttentionCapture(tokens=["a", "b", "c"], token_ids=[0, 1, 2], layers=[0], heads=[0], weights=w,
                            n_layers=1, n_heads=1, model="m", meta={})
    path = tmp_path / "view.html"
    assert save_html(good, path) == path.resolve()  # writing returns the path, not the page
    page = render_html(good)
    assert path.read_text(encoding="utf-8") == page and mode(path) == usual_mode()
    bad = AttentionCapture(tokens=["a", "\udcff", "c"], token_ids=[0, 1, 2], layers=[0], heads=[0], weights=w,
                           n_layers=1, n_heads=1, model="m", meta={})
    with pytest.raises(UnicodeEncodeError):
        save_html(bad, path)
    assert path.read_text(encoding="utf-8") == page, "the earlier page must survive a failed write"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]


def test_png_and_checkpoint_files_get_the_usual_mode(tmp_path, umask_027):
    pytest.importorskip("matplotlib")
    import torch

    from multihead.checkpoint import Vocab, save_lab_checkpoint
    from multihead.decoder import LabConfig, LabTransformer
    from multihead.inspect.capture_types import AttentionCapture
    from multihead.inspect.png import save_head

    w = torch.softmax(torch.randn(1, 1, 3, 3), -1)
    cap = AttentionCapture(tokens=["a", "b", "c"], token_ids=[0, 1, 2], layers=[0], heads=[0], weights=w,
                           n_layers=1, n_heads=1, model="m", meta={})
    save_head(cap, 0, 0, tmp_path / "head.png")
    assert (tmp_path / "head.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = LabTransformer(LabConfig(vocab_size=2, max_len=4, d_model=8, n_heads=2))
    save_lab_checkpoint(tmp_path / "model", model, Vocab("symbols", ("a", "b")), experiment="heads")
    for p in (tmp_path / "head.png", tmp_path / "model" / "model.safetensors", tmp_path / "model" / "config.json"):
        assert mode(p) == 0o640, f"{p.name}: {oct(mode(p))}"  # safetensors alone would write 0600
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("content, message", [
    (b'{"a": {"b": [1, 2, ' + b"9" * 400 + b"]}}", ["a.b[2]", "400-digit"]),
    (b"[" * 100_000 + b"]" * 100_000, ["nests", "at most 64"]),
    (b'{"model_type": "llama", "x": "\xff"}', ["not UTF-8", "0xff", "offset 30"]),
    (b'{"x": 1e400}', ["field 'x'", "inf"]),
    (b'{"x": NaN}', ["NaN", "not a valid JSON number"]),
    (b'{"x": 1,}', ["is not JSON", "line 1"]),
    (b"", ["is not JSON"]),
])
def test_read_json_names_the_file_and_the_field(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        read_json(path, what="config.json")
    for part in [str(path), *message]:
        assert part in str(err.value), f"{part!r} not in {err.value}"


def test_read_json_is_bounded(tmp_path):
    with pytest.raises(ValueError, match="larger than 1 MiB"):
        read_json("/dev/zero", max_bytes=2**20)  # would read forever if unbounded
    with pytest.raises(ValueError, match="is a folder"):
        read_json(tmp_path)
    with pytest.raises(ValueError, match="cannot read .* No such file"):
        read_json(tmp_path / "missing.json")
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"n": 10**29, "deep": [[[1.5]]], "s": "[{"}))  # brackets in strings do not nest
    assert read_json(ok) == {"n": 10**29, "deep": [[[1.5]]], "s": "[{"}


def test_read_at_most_reads_exactly_n_bytes_of_a_device_and_all_of_a_pipe_in_pieces(tmp_path):
    import threading

    from multihead.files import read_at_most

    assert read_at_most("/dev/zero", 70_000) == bytes(70_000)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def writer():
        with open(fifo, "wb", buffering=0) as w:
            for piece in (b"In the ", b"beginning ", b"God"):
                w.write(piece)
                time.sleep(0.05)  # the reader sees three short reads

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert read_at_most(fifo, 100) == b"In the beginning God"
    finally:
        t.join(timeout=5)


def test_check_out_apart_protects_a_models_folder_and_only_a_corpus_file(tmp_path):
    from multihead.errors import UsageError
    from multihead.files import check_out_apart

    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.gguf").write_bytes(b"x")
    corpus = tmp_path / "texts" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text("in the beginning")
    for out in (model, model / "run", tmp_path):  # the model's folder, inside it, above it
        with pytest.raises(UsageError, match="--out"):
            check_out_apart("--out", out, model / "weights.gguf", tool="t")
    # A run folder beside a corpus file is harmless; the file itself and the folders above it are not.
    assert check_out_apart("--out", corpus.parent / "run", corpus, tool="t", file_only=True)[0] == \
        (corpus.parent / "run").resolve()
    for out in (corpus, corpus.parent, tmp_path):
        with pytest.raises(UsageError, match="holds the corpus"):
            check_out_apart("--out", out, corpus, tool="t", file_only=True, what="the corpus")
