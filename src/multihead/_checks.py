"""The small checks and names every floor shares, in pure Python (no torch), so the
modules, the caches, `plan` and `lab` word them one way."""

from __future__ import annotations

__all__ = ["check_int", "divisors", "variant_name"]


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_int(name: str, value, minimum: int = 1) -> int:
    """`value` if it is an int >= minimum (bool is not an int here); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; received {value!r}")
    return value


def variant_name(n_heads: int, n_kv_heads: int) -> str:
    """MHA (every query head has its own K/V head), MQA (one K/V head) or GQA."""
    if n_kv_heads == n_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else "GQA"
