"""What a mask predicate (`masks.MaskMod`) and a score mod (`score_mods.ScoreMod`) share: a
named callable in flex_attention's signature, the query convention it reads (`top_left`) and
its optional check against an attention's `(B, H, T, S)`."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["NamedMod"]


class NamedMod:
    """A named callable `fn` with its query convention and shape check. `signature` words the
    call it must accept, for the TypeError when `fn` is not callable."""

    def __init__(self, fn: Callable, name: str, *, top_left: bool, check: Callable | None, signature: str):
        if not callable(fn):
            raise TypeError(f"{signature}; received {type(fn).__name__}")
        self.fn = fn
        self.name = name
        self.top_left = top_left
        self._check = check

    def check(self, B: int, H: int, T: int, S: int) -> None:
        """Raise ValueError if the callable does not fit an attention of this shape."""
        if self._check is not None:
            self._check(B, H, T, S)
