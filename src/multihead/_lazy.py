"""Lazy exports for package `__init__` files (PEP 562): a name is imported from its module
on first use, so importing a package does not import torch, transformers or matplotlib."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, modules: dict[str, tuple[str, ...]], namespace: dict):
    """`__getattr__`, `__dir__` and the exported names (in order) of a package whose
    `modules` maps each module to the names it exports."""
    table = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__, list(table)
