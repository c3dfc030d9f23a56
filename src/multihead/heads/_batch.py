"""A scan forward's batch: the corrupted run's B rows once per variant.

A block is the element of a `nn.ModuleList` that holds the attention module (the model
itself when there is none). A scan forward carries several variants: the blocks below the
first of them run on one row (their output is unused), a variant's block starts from the
corrupted run's cached input (`keep_inputs`), and a block pre-hook repeats the per-batch
tensors the model hands each block (masks, rotary angles). Row r of a variant is a copy of
corrupted row r % B. Used by every scan (`patch_scan`, `path_patch_scan`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.heads.engine import KEYWORD, WEIGHTS_KEYWORD
from multihead.masks import MaskMod


def block_of(model: nn.Module, module: nn.Module, parents: dict[int, nn.Module]) -> nn.Module:
    """The block (an item of a ModuleList) that holds attention `module`; the model if none does."""
    x = next((m for m in model.modules() if getattr(m, "mla", None) is module), module)  # a layer holding MLA
    while id(x) in parents:
        p = parents[id(x)]
        if isinstance(p, nn.ModuleList):
            return x
        x = p
    return model


def first_output(out) -> Tensor:
    """A block's or model's first output: the hidden states (a tensor, or the head of a tuple)."""
    return out if isinstance(out, Tensor) else out[0]


def with_first(out, x: Tensor):
    """A block's output with its hidden states replaced by `x`."""
    return x if isinstance(out, Tensor) else (x, *out[1:])


def _plain(x) -> bool:
    return isinstance(x, tuple) and not hasattr(x, "_fields")


def grow(x, rows: int, new_rows: int, B: int):
    """x as the grown batch sees it: rows [0, rows) kept, copies of [0, B) appended; a
    per-batch tensor (B rows) repeated; anything else (broadcast dims, 1-D) unchanged."""
    if isinstance(x, Tensor):
        if x.dim() < 2 or new_rows == rows == B:
            return x
        if x.shape[0] == rows:
            extra = (new_rows - rows) // B
            return x if extra == 0 else torch.cat([x, x[:B].repeat(extra, *([1] * (x.dim() - 1)))])
        if x.shape[0] == B:
            return x.repeat(new_rows // B, *([1] * (x.dim() - 1)))
        return x
    if isinstance(x, MaskMod) and new_rows > B:
        fn = x.fn
        return MaskMod(lambda b, h, q, k: fn(b % B, h, q, k), x.name, top_left=x.top_left, relative=x.relative)
    if _plain(x):
        return tuple(grow(t, rows, new_rows, B) for t in x)
    if isinstance(x, list):
        return [grow(t, rows, new_rows, B) for t in x]
    return x


def one_row(x, B: int):
    """A block below every patched layer runs on one row: its result is never used."""
    if isinstance(x, Tensor):
        return x[:1] if x.dim() >= 2 and x.shape[0] == B else x
    if _plain(x):
        return tuple(one_row(t, B) for t in x)
    if isinstance(x, list):
        return [one_row(t, B) for t in x]
    return x


def append(x, cached, rows: int, n: int, B: int):
    """x (the variants so far, `rows` rows) with n copies of the corrupted run's own value appended."""
    if isinstance(x, Tensor) and isinstance(cached, Tensor) and x.dim() >= 2:
        if x.shape[0] == rows:
            c = cached if cached.shape[0] == B else cached.expand(B, *cached.shape[1:])
            return torch.cat([x, c.repeat(n, *([1] * (c.dim() - 1)))])
        return grow(x, rows, rows + n * B, B)
    if _plain(x) and isinstance(cached, tuple) and len(x) == len(cached):
        return tuple(append(a, c, rows, n, B) for a, c in zip(x, cached))
    if isinstance(x, list) and isinstance(cached, list) and len(x) == len(cached):
        return [append(a, c, rows, n, B) for a, c in zip(x, cached)]
    return grow(x, rows, rows + n * B, B)


def keep_rows(x, rows: int, keep: int):
    """x with the batch of `rows` rows cut to its first `keep`; other things unchanged."""
    if isinstance(x, Tensor):
        return x[:keep] if x.dim() >= 2 and x.shape[0] == rows else x
    if _plain(x):
        return tuple(keep_rows(t, rows, keep) for t in x)
    if isinstance(x, list):
        return [keep_rows(t, rows, keep) for t in x]
    return x


def keep_inputs(cache: dict[int, tuple]):
    """A block pre-hook that keeps what the block is handed, `cache[id(block)] = (args,
    kwargs)`, without the engine's own keywords (a later forward brings its own)."""
    def keep(block, args, kwargs):
        cache[id(block)] = (args, {k: v for k, v in kwargs.items() if k not in (KEYWORD, WEIGHTS_KEYWORD)})
    return keep


def check_whole(logits: Tensor, rows: int, model: nn.Module) -> None:
    """A scan forward's logits must carry every row it laid out."""
    if logits.shape[0] != rows:
        raise RuntimeError(f"the scan's batch did not come out whole ({logits.shape[0]} rows, expected {rows}): "
                           f"{type(model).__name__} reshapes its batch between blocks")
