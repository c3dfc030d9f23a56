"""The learning rate of each `lab uptrain --model` training, chosen on a few probe steps.

A converted model starts far from where its pretraining left it, and how far differs per
target: a rate that helps MQA can throw an MLA model further off than it was converted
(the committed SmolLM2 run: MLA-128 went from 1,183 to 2,312 held-out perplexity at 3e-4).
So every training (the control too, which keeps the comparison fair) first tries its peak
rate `lr` and smaller ones, `PROBE_FACTORS` times it, for `probe_steps` AdamW steps each
from the same weights, on batches drawn for the probe only (never the run's, never the
held-out text), and measures the loss on one more such batch. The largest rate whose
probe loss is the lowest, within `PROBE_TIE` of it, wins; when no rate lowers the
probe loss below where it started, the smallest is taken. Then the weights go back and
the run trains at the chosen rate. results.json keeps every candidate's probe loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["PROBE_FACTORS", "PROBE_TIE", "choose_lr"]

PROBE_FACTORS = (1.0, 1 / 3, 1 / 10, 1 / 30)
PROBE_TIE = 0.002  # relative: a larger rate within 0.2% of the best probe loss is preferred (it moves faster)


def choose_lr(params: list[torch.nn.Parameter], loss_fn: Callable[[torch.Tensor], torch.Tensor],
              probe_batches: list[torch.Tensor], check_batch: torch.Tensor, lr: float, *,
              betas=(0.9, 0.95), clip: float = 1.0) -> tuple[float, dict]:
    """(the chosen peak rate, {"start": the check loss before, "candidates": {rate: loss}}).

    `params` are restored to their values on return, whatever the probes did; a probe whose
    loss is not finite counts as infinitely bad."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        start = float(loss_fn(check_batch))
    losses: dict[float, float] = {}
    try:
        for factor in PROBE_FACTORS:
            rate = lr * factor
            opt = torch.optim.AdamW(params, lr=rate, betas=betas, weight_decay=0.0)
            for batch in probe_batches:
                loss = loss_fn(batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, clip)
                opt.step()
            with torch.no_grad():
                after = float(loss_fn(check_batch))
            losses[rate] = after if math.isfinite(after) else math.inf
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        for p in params:
            p.grad = None
    best = min(losses.values())
    if not best < start:
        chosen = min(losses)
    else:
        chosen = max(rate for rate, loss in losses.items() if loss <= best + PROBE_TIE * abs(best))
    shown = {f"{rate:.3g}": (loss if math.isfinite(loss) else None) for rate, loss in losses.items()}
    return chosen, {"start": start, "chosen": chosen, "candidates": shown}
