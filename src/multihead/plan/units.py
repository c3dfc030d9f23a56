"""Sizes as people write them (125M, 1.3B, 32k, 80GiB), dtypes by name, and display.

Parameter counts are decimal (7B = 7,000,000,000), context lengths are binary the way
model cards use them (32k = 32,768 tokens, 128K = 131,072), byte sizes follow their
unit (80GB = 80e9 bytes, 80GiB = 80 * 2**30). Parsing is exact (Decimal), so 1.3B is
1,300,000,000 and not a float that rounds.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

# Bits per element of the cache / weight dtypes plan knows. The canonical names come
# first; the others are accepted spellings (torch's, numpy's).
DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
    "uint8": "int8",
}

_NUMBER = r"([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)"
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_TOKEN_SUFFIX = {"": 1, "k": 2**10, "m": 2**20}
_BYTE_UNIT = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip

COUNT_EXAMPLES = "125M, 1.3B, 7b, 70B, 1.2T"
TOKEN_EXAMPLES = "512, 4096, 32k, 128K, 1M"
BYTE_EXAMPLES = "24GB, 80GiB, 141GB, 512MiB"
BANDWIDTH_EXAMPLES = "3.35TB/s, 900GB/s, 2039GB/s"


def _parse(text, suffixes: dict[str, int], what: str, examples: str, strip: str = "") -> int:
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise TypeError(f"{what} must be a string like {examples}; received {text!r}")
    raw = str(text)
    s = raw.strip().lower().replace(",", "").replace("_", "").replace(" ", "")
    if strip and s.endswith(strip):
        s = s[: -len(strip)]
    m = re.fullmatch(_NUMBER + r"([a-z]*)", s)
    if m is None or m.group(2) not in suffixes:
        raise ValueError(f"could not read {what} {raw!r}; write it like {examples}")
    try:
        value = Decimal(m.group(1)) * suffixes[m.group(2)]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"could not read {what} {raw!r}; write it like {examples}") from None
    if value <= 0:
        raise ValueError(f"{what} must be positive; received {raw!r} (e.g. {examples})")
    if value != value.to_integral_value():
        raise ValueError(f"{what} {raw!r} is not a whole number ({value}); e.g. {examples}")
    return int(value)


def parse_count(text) -> int:
    """A parameter count: '125M' -> 125_000_000, '1.3B' -> 1_300_000_000, '7b', '1.2T'."""
    return _parse(text, _COUNT_SUFFIX, "parameter count", COUNT_EXAMPLES)


def parse_tokens(text) -> int:
    """A context length in tokens: '32k' -> 32_768, '128K' -> 131_072, '4096' -> 4096."""
    return _parse(text, _TOKEN_SUFFIX, "context length", TOKEN_EXAMPLES)


def parse_bytes(text) -> int:
    """A memory size: '80GB' -> 80e9 bytes, '80GiB' -> 80 * 2**30 bytes."""
    return _parse(text, _BYTE_UNIT, "memory size", BYTE_EXAMPLES)


def parse_bandwidth(text) -> int:
    """A bandwidth in bytes/s: '3.35TB/s' -> 3.35e12, '900GB/s' -> 9e11."""
    return _parse(text, _BYTE_UNIT, "bandwidth", BANDWIDTH_EXAMPLES, strip="/s")


def dtype_name(dtype) -> str:
    """Canonical name of a cache/weight dtype: a name plan knows, or a torch dtype.

    torch dtypes are accepted by duck typing (`.itemsize`), so plan never imports torch.
    """
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        key = _DTYPE_ALIASES.get(key, key)
        if key in DTYPE_BITS:
            return key
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BITS)}")
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and itemsize > 0:
        name = str(dtype).removeprefix("torch.")
        return _DTYPE_ALIASES.get(name, name)
    raise TypeError(f"dtype must be a name ({', '.join(DTYPE_BITS)}) or a torch dtype; "
                    f"received {dtype!r}")


def dtype_bits(dtype) -> int:
    """Bits per element: 'bf16' -> 16, 'int4' -> 4, torch.float32 -> 32."""
    if not isinstance(dtype, str) and isinstance(getattr(dtype, "itemsize", None), int):
        dtype_name(dtype)  # validates
        return 8 * dtype.itemsize
    return DTYPE_BITS[dtype_name(dtype)]


def bytes_for(elements: int, dtype) -> int:
    """Bytes to store `elements` values of `dtype` (payload only, rounded up to a byte).

    Quantised caches (fp8/int8/int4) also store scales, typically a few percent more;
    that overhead depends on the kernel's group size and is not counted.
    """
    return math.ceil(elements * dtype_bits(dtype) / 8)


# --- display -----------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """Binary units, as device memory is sold: 131072 -> '128 KiB', 3.4e10 -> '31.7 GiB'."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    """Decimal units, as parameter counts are written: 8030261248 -> '8.03B'."""
    n = float(n)
    units = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))
    for i, (unit, size) in enumerate(units):
        if abs(n) >= size:
            text = f"{n / size:.3g}"
            if float(text) >= 1000 and i > 0:  # 999,885,952 rounds to 1000M: say 1B
                unit, size = units[i - 1]
                text = f"{n / size:.3g}"
            return f"{text}{unit}"
    return f"{n:.0f}"


def fmt_tokens(n: int) -> str:
    """Binary k for contexts: 32768 -> '32K', 4096 -> '4K', 1000 -> '1000'."""
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10}K"
    return str(n)


def fmt_flops(n: float) -> str:
    n = float(n)
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} FLOP"


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """An aligned text table; columns in `right` are right-aligned (numbers)."""
    right = right or set()
    cells = [headers, *rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(headers))]

    def line(r):
        parts = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])
