"""Every input check the floors share, in pure Python (no torch at module level), so the
modules, the kernels, the caches, `plan` and `lab` word a mistake one way.

One function per kind of value: an int in a range (`check_int`), a positive finite
number, a probability in [0, 1), one divisibility rule with its list of divisors (and
`check_kv_heads` for the head counts), and one check that tensors share a dtype and a
device. A value of the wrong type (a str, a float where an int is needed, a bool, tensors
of two dtypes) raises TypeError; a value of the right type outside the range raises
ValueError. Both messages read "<name> must be <what is valid>; received <value>", the
TypeError adding the type.
"""

from __future__ import annotations

import math
import numbers
import operator

__all__ = ["check_divisible", "check_fields", "check_int", "check_kv_heads", "check_nonnegative_int",
           "check_positive_int", "check_positive_number", "check_probability", "check_same_dtype_device",
           "divisibility_error", "divisors", "is_int", "variant_name"]


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def is_int(value) -> bool:
    """Whether `value` is an integer as `check_int` reads one: a Python int, a NumPy int or an
    integer 0-d tensor (what `operator.index` takes), never a bool (NumPy's included)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False) -> int | None:
    """`value` as an int if it is an int in [minimum, maximum] (either bound optional), or
    None when allowed. A Python int, a NumPy int or an integer 0-d tensor is an int; a bool,
    a float or a str is not (TypeError). Out of range: ValueError.

    >>> check_int("batch_size", 8, minimum=1)
    8
    >>> check_int("layer", 12, minimum=0, maximum=11)
    Traceback (most recent call last):
    ValueError: layer must be an int in [0, 11]; received 12
    """
    if value is None and allow_none:
        return None
    if minimum is not None and maximum is not None:
        valid = f"an int in [{minimum}, {maximum}]"
    elif minimum is not None:
        valid = f"an int >= {minimum}"
    elif maximum is not None:
        valid = f"an int <= {maximum}"
    else:
        valid = "an int"
    valid += " or None" if allow_none else ""
    if not is_int(value):
        kind = "bool" if isinstance(value, bool) else type(value).__name__
        raise TypeError(f"{name} must be {valid}; received {value!r} ({kind})")
    n = operator.index(value)
    if (minimum is not None and n < minimum) or (maximum is not None and n > maximum):
        raise ValueError(f"{name} must be {valid}; received {value!r}")
    return n


def check_fields(obj, *names: str, minimum: int, allow_none: bool = False) -> None:
    """`check_int` on each named attribute of `obj` (a config dataclass's fields), in order."""
    for name in names:
        check_int(name, getattr(obj, name), minimum=minimum, allow_none=allow_none)


def check_positive_int(name: str, value, *, allow_none: bool = False) -> int | None:
    """`value` as an int if it is an int >= 1 (or None when allowed)."""
    return check_int(name, value, minimum=1, allow_none=allow_none)


def check_nonnegative_int(name: str, value, *, allow_none: bool = False) -> int | None:
    """`value` as an int if it is an int >= 0 (or None when allowed)."""
    return check_int(name, value, minimum=0, allow_none=allow_none)


def _real(name: str, value, valid: str) -> float:
    """A Python float from an int, a float, a NumPy scalar or a one-element real tensor
    (read by duck typing, so this module needs no torch)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {valid}; received {value!r} (bool)")
    if isinstance(value, numbers.Real):
        return float(value)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None and hasattr(value, "item"):  # a tensor or NumPy scalar
        size = math.prod(shape)
        if size != 1:
            raise ValueError(f"{name} must be {valid}; received a tensor of shape "
                             f"({', '.join(map(str, shape))}) {dtype}")
        item = value.item()
        if isinstance(item, bool) or not isinstance(item, numbers.Real):
            raise TypeError(f"{name} must be {valid}; received a {type(value).__name__} of dtype {dtype}")
        return float(item)
    raise TypeError(f"{name} must be {valid}; received {value!r} ({type(value).__name__})")


def check_positive_number(name: str, value, *, allow_none: bool = False) -> float | None:
    """`value` as a float if it is a finite number > 0 (or None when allowed): a Python,
    NumPy or one-element tensor scalar."""
    if value is None and allow_none:
        return None
    valid = "a positive finite number" + (" or None" if allow_none else "")
    f = _real(name, value, valid)
    if not math.isfinite(f) or f <= 0:
        raise ValueError(f"{name} must be {valid}; received {value!r}")
    return f


def check_probability(name: str, value) -> float:
    """`value` as a float if it is a number in [0, 1) (a dropout probability)."""
    valid = "a float in [0, 1)"
    f = _real(name, value, valid)
    if not 0.0 <= f < 1.0:
        raise ValueError(f"{name} must be {valid}; received {value!r}")
    return f


def divisibility_error(n_name: str, n: int, d_name: str, d: int) -> str | None:
    """The message `check_divisible` raises, or None when d divides n (for callers that
    gather messages before raising, such as every rank of a process group)."""
    if d != 0 and n % d == 0:
        return None
    return f"{n_name} ({n}) must be divisible by {d_name} ({d}); valid: {', '.join(map(str, divisors(n)))}"


def check_divisible(n_name: str, n: int, d_name: str, d: int) -> None:
    """ValueError unless d divides n, listing the valid d (e.g. n_heads and n_kv_heads)."""
    error = divisibility_error(n_name, n, d_name, d)
    if error is not None:
        raise ValueError(error)


def check_kv_heads(n_heads, n_kv_heads, *, n_heads_name: str = "n_heads",
                   n_kv_heads_name: str = "n_kv_heads") -> int:
    """The number of key/value heads, checked: both counts positive ints and n_kv_heads a
    divisor of n_heads (MHA, GQA or MQA); None means n_heads (MHA). The names are the
    caller's spelling (a CLI passes "--n-heads").

    >>> check_kv_heads(12, 5)
    Traceback (most recent call last):
    ValueError: n_heads (12) must be divisible by n_kv_heads (5); valid: 1, 2, 3, 4, 6, 12
    """
    n_heads = check_int(n_heads_name, n_heads, minimum=1)
    n_kv_heads = check_int(n_kv_heads_name, n_kv_heads, minimum=1, allow_none=True)
    if n_kv_heads is None:
        return n_heads
    check_divisible(n_heads_name, n_heads, n_kv_heads_name, n_kv_heads)
    return n_kv_heads


def check_same_dtype_device(**tensors) -> None:
    """TypeError unless the named tensors share one dtype, ValueError unless they sit on one
    device; both messages name each tensor's. Read by duck typing (`.dtype`, `.device`), so
    this module needs no torch. A caller on a per-token path compares first and calls this
    only on a mismatch, for the message.

    >>> import torch
    >>> check_same_dtype_device(q=torch.ones(1), k=torch.ones(1, dtype=torch.float16))
    Traceback (most recent call last):
    TypeError: q, k must share a dtype; received q torch.float32, k torch.float16
    """
    names = ", ".join(tensors)
    dtypes = [t.dtype for t in tensors.values()]
    if any(d != dtypes[0] for d in dtypes):
        got = ", ".join(f"{n} {t.dtype}" for n, t in tensors.items())
        raise TypeError(f"{names} must share a dtype; received {got}")
    devices = [t.device for t in tensors.values()]
    if any(d != devices[0] for d in devices):
        got = ", ".join(f"{n} {t.device}" for n, t in tensors.items())
        raise ValueError(f"{names} must be on one device; received {got}")


def variant_name(n_heads: int, n_kv_heads: int) -> str:
    """MHA (every query head has its own K/V head), MQA (one K/V head) or GQA."""
    if n_kv_heads == n_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else "GQA"
