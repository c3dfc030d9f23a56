"""What a converted model costs when it generates, measured on a real greedy `generate()`:
the bytes its cache holds per token (`kv_bytes_per_token`) and its milliseconds per decoded
token paired with the base's (`decode_ms_per_token`). Used by `multihead.lab.uptrain_hf`.
"""

from __future__ import annotations

import time

import torch

__all__ = ["decode_ms_per_token", "kv_bytes_per_token"]


def kv_bytes_per_token(model, prompt: torch.Tensor, new_tokens: int) -> int:
    """Bytes per cached token of the cache a real greedy `generate()` leaves: every key and
    value tensor (MLA: the latent) of every layer, over the tokens it holds."""
    from multihead.interop.hf import latent_cache_bytes

    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             use_cache=True, return_dict_in_generate=True,
                             pad_token_id=getattr(model.config, "pad_token_id", None) or 0)
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # transformers 5 names it cache
    tokens = cache.get_seq_length() * prompt.shape[0]
    total = latent_cache_bytes(cache)
    assert total % tokens == 0, (total, tokens)
    return total // tokens


def _step_times(model, prompt: torch.Tensor, new_tokens: int) -> list[float]:
    """Seconds of each decode step of a real greedy `generate()` (after the prefill): the
    intervals between its calls to the logits processors, one per new token."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self):
            self.at: list[float] = []

        def __call__(self, input_ids, scores):
            self.at.append(time.perf_counter())
            return scores

    clock = Clock()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                       logits_processor=LogitsProcessorList([clock]),
                       pad_token_id=getattr(model.config, "pad_token_id", None) or 0)
    return [b - a for a, b in zip(clock.at, clock.at[1:])]


def decode_ms_per_token(model, base, prompt: torch.Tensor, new_tokens: int, rounds: int = 3) -> dict | None:
    """Median milliseconds per decoded token of `model` and of `base`, timed in alternating
    rounds of greedy `generate()` (so a change of the machine's load falls on both alike);
    None when `new_tokens` < 2 leaves no decode step to time."""
    if new_tokens < 2:
        return None
    was = model.training, base.training
    model.eval()
    base.eval()
    mine, theirs = [], []
    for _ in range(rounds):
        theirs += _step_times(base, prompt, new_tokens)
        mine += _step_times(model, prompt, new_tokens)
    model.train(was[0])
    base.train(was[1])
    ms, base_ms = 1e3 * float(torch.tensor(mine).median()), 1e3 * float(torch.tensor(theirs).median())
    return {"ms_per_token": round(ms, 3), "base_ms_per_token": round(base_ms, 3), "ratio": round(ms / base_ms, 3)}
