"""Rows moved so that every row ends where its metric reads: the prefix skip's reach per row,
and the last block's trim.

The prefix skip runs a variant on positions [p, T) where p is the first position at which
clean and corrupted differ in *any* row; IOI prompts of several templates differ and end
at different places. Rolling each row right by T - 1 - its read position puts every read
position at T - 1, so the skip starts at each row's own change, and the variants' last
block can run at T - 1 alone (`multihead.heads._top`; docs/heads.md). The rolled
rows are the same text at the same positions (explicit `position_ids`), the wrapped-around
tail masked out (`attention_mask` 0): a causal model gives the same logits at the read
positions, to float rounding, checked on the corrupted run before the scan uses them.
Taken only for an `AtPositions` metric on a transformers model whose forward takes
`logits_to_keep`, `attention_mask` and `position_ids`, inputs that are a mapping of exactly
those (B, T) tensors (and `input_ids`), and no `positions=` of the caller's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from multihead.heads.engine import forward_takes, is_hf
from multihead.heads.metrics import AtPositions

_KNOWN = ("input_ids", "attention_mask", "position_ids")
_ALIGN = True  # tests turn it off to compare the two layouts


def _roll_rows(x: Tensor, shift: Tensor) -> Tensor:
    """Row r of `x` (B, T, ...) rolled right by shift[r] positions."""
    T = x.shape[1]
    idx = (torch.arange(T)[None, :] - shift[:, None]) % T  # new position j holds old position j - shift
    return torch.gather(x, 1, idx.to(x.device).view(*idx.shape, *([1] * (x.dim() - 2))).expand(x.shape))


def aligned(model, clean, corrupted, metric, positions, last_block: bool = True) -> tuple[object, object, object, str]:
    """(clean, corrupted, metric, "") rolled so that each row's read position is the last, or
    the inputs as given and why not ("" when there is nothing to gain: no row reads before
    the last position, or, without `last_block` (a caller that does not trim its last block
    at the read position), the shared prefix would not grow)."""
    *made, check = unchecked(model, clean, corrupted, metric, positions, last_block)
    why = check() if check is not None else ""
    return (*made,) if not why else (clean, corrupted, metric, why)


def unchecked(model, clean, corrupted, metric, positions, last_block: bool = True
              ) -> tuple[object, object, object, str, Callable | None]:
    """`aligned` without its check: (clean, corrupted, metric, why, check), check None or, where
    rows were rolled, the check to run before the rolled rows' results are used: `check()` is
    "" when they hold, else why not (then the inputs as given are to be used with that reason).
    Two forwards of the corrupted rows: a scan across processes runs it on one rank while the
    others begin their share."""
    if not _ALIGN:
        return clean, corrupted, metric, "turned off", None
    if not isinstance(metric, AtPositions) or positions is not None:
        return clean, corrupted, metric, "" if not isinstance(metric, AtPositions) else "positions= given", None
    if not (is_hf(model) and forward_takes(model, "logits_to_keep", *_KNOWN)):
        return clean, corrupted, metric, "the model's forward does not take logits_to_keep, attention_mask and " \
            "position_ids", None
    given = clean, corrupted, metric  # what goes back unchanged (a tensor stays one: `aligned` is False then)
    if isinstance(clean, Tensor):
        clean, corrupted = {"input_ids": clean}, {"input_ids": corrupted}
    if not (hasattr(clean, "keys") and set(clean.keys()) <= set(_KNOWN) and "input_ids" in clean.keys()):
        return (*given, "inputs other than input_ids, attention_mask and position_ids", None)
    ids = clean["input_ids"]
    if not isinstance(ids, Tensor) or ids.dim() != 2 or any(
            not isinstance(x[k], Tensor) or x[k].shape != ids.shape for x in (clean, corrupted) for k in x.keys()):
        return (*given, "inputs that are not (B, T) tensors of one shape", None)
    B, T = ids.shape
    if len(metric.positions) != B:
        return (*given, "", None)  # the scan refuses it in its own words
    read = metric.absolute(T)
    shift = T - 1 - read
    if not bool((shift > 0).any()):
        return (*given, "", None)  # every row ends where it is read already
    # rolled, every row reads T - 1: the shared prefix can only grow (each row's change moves
    # right by its shift), and a patch scan's last block can run there alone where it does not
    if not last_block and not _prefix_grows(clean, corrupted, shift):
        return (*given, "", None)
    device = ids.device
    out = []
    for x in (clean, corrupted):
        mask = x["attention_mask"] if "attention_mask" in x.keys() else torch.ones_like(ids)
        pos = x["position_ids"] if "position_ids" in x.keys() else torch.arange(T, device=device).expand(B, T)
        mask = _roll_rows(mask, shift)
        mask = mask * (torch.arange(T)[None, :] >= shift[:, None]).to(mask.device, mask.dtype)  # the tail masked
        out.append({"input_ids": _roll_rows(x["input_ids"], shift), "attention_mask": mask,
                    "position_ids": _roll_rows(pos.contiguous(), shift)})
    tail = torch.arange(T)[None, :] < shift[:, None]  # the wrapped-around positions, masked: one content in both
    for k in out[1]:
        out[1][k] = torch.where(tail.to(device), out[0][k], out[1][k])
    last = AtPositions(metric.fn, torch.full((B,), T - 1), metric.name)
    given_corrupted, rolled = corrupted, out[1]
    return out[0], out[1], last, "", lambda: _same_logits(model, given_corrupted, rolled, read, B, T)


def _prefix_grows(clean, corrupted, shift: Tensor) -> bool:
    """Whether rolling each row right by `shift` moves the batch's first change (where the shared
    prefix ends) later."""
    differ = (clean["input_ids"] != corrupted["input_ids"]).to("cpu")
    B, T = differ.shape
    first = torch.where(differ.any(1), differ.int().argmax(1), torch.full((B,), T))
    return int((first + shift).min()) > int(first.min())


def _same_logits(model, given, rolled, read: Tensor, B: int, T: int) -> str:
    """"" when the corrupted run's logits at the read positions are those of its rolled rows at T - 1."""
    rows = torch.arange(B)
    kw = {"use_cache": False} if forward_takes(model, "use_cache") else {}
    keep = torch.unique(read)
    with torch.no_grad():
        want = model(**given, logits_to_keep=keep, **kw).logits[rows, torch.searchsorted(keep, read)]
        got = model(**rolled, logits_to_keep=1, **kw).logits[:, -1]
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * (1 + float(want.abs().max()))):
        diff = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
        return f"the rolled rows' logits differ from the given rows' by {diff:.2e} (the model reads positions " \
            "otherwise than through position_ids and attention_mask)"
    return ""
