"""What every head tool that compares a clean and a corrupted run (`patch_scan`,
`attribution_scan`, `path_patch`, `path_patch_scan`) checks of its inputs and metric, in
one wording, and how it calls the model on them (without a KV cache: a scan grows and cuts
its batch between blocks, which a cache the caller handed in would not survive)."""

from __future__ import annotations

from torch import Tensor, nn

from multihead.checks import check_int
from multihead.heads.engine import batch_size, check_model, forward_takes

# keywords a clean or corrupted input may not carry, and when a value of them is refused
_REFUSED = (("labels", lambda v: v is not None), ("use_cache", bool), ("past_key_values", lambda v: v is not None))


def _is_mapping(x) -> bool:
    return hasattr(x, "keys") and hasattr(x, "__getitem__")


def _shown(v) -> str:
    return f"a tensor of shape {tuple(v.shape)}" if isinstance(v, Tensor) else repr(v) if len(repr(v)) < 40 \
        else type(v).__name__


def check_pair(clean, corrupted) -> int:
    """Clean and corrupted: one kind, one batch size, the same keywords and shapes, nothing a
    grown batch breaks; returns the batch size B."""
    mapping = [_is_mapping(x) for x in (clean, corrupted)]
    if not all(isinstance(x, Tensor) or m for x, m in zip((clean, corrupted), mapping)) or mapping[0] != mapping[1]:
        raise TypeError(f"clean and corrupted must both be tensors (input_ids) or both mappings of keyword arguments; "
                        f"received {type(clean).__name__} and {type(corrupted).__name__}")
    B = batch_size(corrupted)
    if batch_size(clean) != B:
        raise ValueError(f"clean and corrupted inputs must have the same batch size; received {batch_size(clean)} "
                         f"and {B}")
    if not mapping[0]:
        pairs = {"input_ids": (clean, corrupted)}
    else:
        if set(clean.keys()) != set(corrupted.keys()):
            raise ValueError(f"clean and corrupted must carry the same keywords; received {sorted(clean.keys())} and "
                             f"{sorted(corrupted.keys())}")
        pairs = {k: (clean[k], corrupted[k]) for k in clean.keys()}
        for label, inputs in (("clean", clean), ("corrupted", corrupted)):
            for key, bad in _REFUSED:
                if key in inputs.keys() and bad(inputs[key]):
                    raise ValueError(f"{label} carries {key} ({_shown(inputs[key])}); valid: inputs without it (the "
                                     "head tools read the logits of cache-free forwards whose batch they grow: the "
                                     "metric sees the logits, so leave out labels, use_cache and past_key_values)")
    for key, (a, b) in pairs.items():
        if isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape != b.shape:
            raise ValueError(f"clean and corrupted must have the same shape (a variant is the corrupted run with "
                             f"heads of the clean run written in, position by position); received {key} of shape "
                             f"{tuple(a.shape)} and {tuple(b.shape)}")
    return B


def check_metric(metric) -> None:
    if not callable(metric):
        raise TypeError(f"metric must be callable(logits) -> scalar tensor; received {type(metric).__name__}")


def check_inputs(model, clean, corrupted, metric) -> int:
    """The model, the pair and the metric of a head tool; returns the batch size B."""
    check_model(model)
    check_metric(metric)
    return check_pair(clean, corrupted)


def check_variants_per_run(variants_per_run) -> int | None:
    return check_int("variants_per_run", variants_per_run, minimum=1, allow_none=True)


def scalar(value, where: str) -> float:
    """A metric's value as a float: a real number or a one-element real tensor, else a clear error."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, Tensor):
        raise TypeError(f"metric must return a scalar tensor (or a number); {where} it returned "
                        f"{type(value).__name__}")
    if value.is_complex():
        raise TypeError(f"metric must return a real scalar; {where} it returned a {value.dtype} tensor")
    if value.numel() != 1:
        raise ValueError(f"metric must return a scalar tensor; {where} it returned shape {tuple(value.shape)}")
    return float(value.detach().float().reshape(()))


def takes_use_cache(model: nn.Module) -> bool:
    return forward_takes(model, "use_cache")


def call(model: nn.Module, inputs, no_cache: bool, **extra):
    """model(inputs), with use_cache=False where the model takes it; `extra`: keywords of the
    call (`logits_to_keep`)."""
    if isinstance(inputs, Tensor):
        return model(inputs, use_cache=False, **extra) if no_cache else model(inputs, **extra)
    kw = {**{k: inputs[k] for k in inputs.keys()}, **extra}
    if no_cache:
        kw.setdefault("use_cache", False)
    return model(**kw)


def with_keywords(inputs, extra: dict):
    """The inputs with `extra` keywords added (a tensor becomes {"input_ids": tensor})."""
    if not extra:
        return inputs
    kw = {"input_ids": inputs} if isinstance(inputs, Tensor) else {k: inputs[k] for k in inputs.keys()}
    return {**kw, **extra}
