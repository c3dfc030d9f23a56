"""Lazy exports for package `__init__` files (PEP 562): a name is imported from its module
on first use, so importing a package does not import torch, transformers or matplotlib."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, str], namespace: dict):
    """`__getattr__` and `__dir__` for a package whose names `table` maps to modules."""

    def __getattr__(name: str):
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
