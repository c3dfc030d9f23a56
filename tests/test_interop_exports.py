"""`multihead.interop`'s names: every one it lists resolves, so `from multihead.interop import *`
works, and each is the object of the module it names (no stale entry for a moved name)."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("transformers")


def test_star_import_of_interop_gives_every_listed_name():
    namespace: dict = {}
    exec("from multihead.interop import *", namespace)  # noqa: S102 (what a user types)
    interop = importlib.import_module("multihead.interop")
    missing = [name for name in interop.__all__ if name not in namespace]
    assert not missing, missing
    hf = importlib.import_module("multihead.interop.hf")
    assert all(namespace[name] is getattr(hf, name) for name in interop.__all__)
