"""The text the experiments and the head tasks read: the King James Bible shipped in
`multihead/data/kjv.txt.xz` (see its KJV_PROVENANCE.md), or a UTF-8 file of the user's.
One floor below the tools, so that lab and heads read it the same way."""

from __future__ import annotations

import lzma
from importlib import resources
from pathlib import Path

__all__ = ["KJV", "load_corpus", "split_kjv"]

KJV = "kjv"
# the first verse of Romans: the held-out books start here (the KJV file has one verse a line, no book names)
_ROMANS = "Paul, a servant of Jesus Christ, called to be an apostle, separated unto the gospel of God,"


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


def split_kjv(max_train_chars: int | None = None) -> tuple[str, str]:
    """(training text: Genesis to Acts, held-out text: Romans to Revelation) of the shipped KJV."""
    text, _ = load_corpus()
    cut = text.find(_ROMANS)
    if cut <= 0 or text[cut - 1] != "\n":
        raise ValueError("the shipped KJV lacks the first verse of Romans at a line start; cannot split it by books")
    train = text[:cut]
    return (train if max_train_chars is None else train[:max_train_chars]), text[cut:]
