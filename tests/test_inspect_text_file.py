"""`multihead inspect --text-file` says what is wrong with the path it was given, in one
line and exit code 2, before any model loads: a folder is a directory, a missing path is
no such file, and whatever can be read (a device such as /dev/zero, a huge file) is read
only up to the size limit, which the message names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from multihead.cli import main


def _err(capsys, path) -> str:
    code = main(["inspect", "--text-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err


def test_a_folder_is_a_directory(capsys, tmp_path):
    err = _err(capsys, tmp_path)
    assert "is a directory" in err and "no such file" not in err, err


def test_a_missing_path_is_no_such_file(capsys, tmp_path):
    assert "no such file" in _err(capsys, tmp_path / "missing.txt")


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero here")
def test_dev_zero_is_read_up_to_the_limit(capsys):
    err = _err(capsys, "/dev/zero")
    assert "is longer than 16 MiB" in err and "no such file" not in err, err


def test_a_huge_file_is_refused_by_its_size(capsys, tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 1 GiB on paper, nothing on disk
        f.truncate(2**30)
    assert "is longer than 16 MiB" in _err(capsys, big)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_is_read(capsys, tmp_path):
    """A pipe is not a regular file but holds a text: it is read (here an empty one, so the
    message is the empty text's, not a missing file's)."""
    import threading
    import time

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write_nothing():  # opens the pipe once the command does, then closes it: an empty text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError:  # ENXIO: no reader yet (or none coming: the command refused the path)
                time.sleep(0.01)

    writer = threading.Thread(target=write_nothing, daemon=True)
    writer.start()
    err = _err(capsys, fifo)
    assert "is empty" in err, err
