"""The text the experiments and the head tasks read: the King James Bible shipped in
`multihead/data/kjv.txt.xz` (see its KJV_PROVENANCE.md), or a UTF-8 file of the user's.
One floor below the tools, so that lab and heads read it the same way."""

from __future__ import annotations

import lzma
from importlib import resources
from pathlib import Path

__all__ = ["KJV", "load_corpus"]

KJV = "kjv"


def load_corpus(path: str | None = None, max_chars: int | None = None) -> tuple[str, str]:
    """(text, name): the shipped King James Bible, or a UTF-8 file."""
    if path is None or path == KJV:
        data = resources.files("multihead").joinpath("data/kjv.txt.xz").read_bytes()
        text, name = lzma.decompress(data).decode("utf-8"), "King James Bible (multihead/data/kjv.txt.xz)"
    else:
        try:
            if Path(path).exists() and not Path(path).is_file():  # /dev/zero would be read forever
                raise ValueError(f"corpus {path} is not a regular file; give a UTF-8 text file")
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"corpus {path} is not UTF-8 text ({err})") from None
        except OSError as err:
            raise ValueError(f"cannot read corpus {path}: {err}") from None
        name = str(path)
    if max_chars is not None:
        text = text[:max_chars]
    return text, name
