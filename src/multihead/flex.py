"""The opt-in "flex" backend's old module name: the code is `multihead.kernels.flex`; the
public names stay importable from here."""

from __future__ import annotations

from multihead.kernels.flex import CACHE_SIZE, RECOMPILE_LIMIT, attention, clear_cache

__all__ = ["CACHE_SIZE", "RECOMPILE_LIMIT", "attention", "clear_cache"]
