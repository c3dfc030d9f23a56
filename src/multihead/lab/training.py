"""The lab's training loop: AdamW with warmup and cosine decay, gradient clipping, a
progress bar, clean Ctrl-C, and a divergence check that stops a training whose loss,
gradient or evaluation stops being a finite number (reported in results.json "diverged")."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import torch

from multihead.lab.progress import Overall, Progress

__all__ = ["StepCallback", "diverged_entry", "train"]

# A hook called after every training step as callback(run_name, step, loss); the tests
# raise KeyboardInterrupt from it to simulate Ctrl-C at a chosen step.
StepCallback = Callable[[str, int, float], None]


def train(
    model: torch.nn.Module,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    steps: int,
    *,
    lr: float,
    name: str = "",
    weight_decay: float = 0.0,
    warmup: int = 0,
    callback: StepCallback | None = None,
    evaluate: Callable[[int], dict] | None = None,
    eval_every: int = 0,
    progress: bool = True,
    log_every: int = 1,
    overall: Overall | None = None,
) -> dict:
    """Train `model` for `steps` AdamW steps on next-token cross-entropy.

    Args:
        batches: step -> (inputs (B, T) int, targets (B, T) int, loss mask (B, T) bool or
            None for every position).
        warmup: linear learning-rate warmup steps, then cosine decay to 10%.
        callback: called as callback(name, step, loss) after every step.
        evaluate: called as evaluate(step) at step 0, every `eval_every` steps and at the
            end; its dicts are collected in "evals".
        overall: progress across several trainings (k/N and the ETA of all).

    Returns:
        {"steps": [...], "loss": [...], "evals": [...], "steps_done": n,
         "interrupted": bool, "diverged_at": step or None, "diverged_loss": str or None,
         "seconds": s, "tokens_per_s": r}. Ctrl-C (KeyboardInterrupt, from the user or the
        callback) ends training after the last finished step and is reported, not raised.
        So does divergence: a loss, gradient norm or evaluation that is not a finite number
        (a learning rate far too high) stops training at that step, before the step is
        applied; "loss"/"evals" keep only the finite values before it.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    log = _Log(name, log_every, steps, Progress(steps, name, enabled=progress, overall=overall), say=progress)
    model.train()
    try:
        if evaluate is not None:
            log.evals.append({"step": 0, **_eval(model, evaluate, 0)})
        for step in range(1, steps + 1):
            x, y, m = batches(step)
            value, why = _step(model, opt, x, y, m, _lr_at(step - 1, lr, warmup, steps))
            if why is None:
                log.step(step, value, x.numel())
                if evaluate is not None and ((eval_every and step % eval_every == 0) or step == steps):
                    why = log.evaluation(step, _eval(model, evaluate, step))
            if why is not None:
                log.diverged(step, why)
                break
            if callback is not None:
                callback(name, step, value)
        else:
            log.bar.close()
    except KeyboardInterrupt:
        log.interrupted()
    model.eval()
    return log.history()


class _Log:
    """What `train` returns, kept as it goes (logged losses, evaluations, steps done, why it
    stopped, tokens per second), with the progress bar and the divergence message beside it."""

    def __init__(self, name: str, log_every: int, steps: int, bar: Progress, *, say: bool):
        self.name, self.log_every, self.steps, self.bar, self.say = name, log_every, steps, bar, say
        self.hist = {"steps": [], "loss": [], "evals": [], "steps_done": 0, "interrupted": False,
                     "diverged_at": None, "diverged_loss": None}
        self.evals = self.hist["evals"]
        self.tokens = 0
        self.start = time.perf_counter()

    def step(self, step: int, loss: float, tokens: int) -> None:
        """A step applied: counted, its loss logged every `log_every` steps and at the last."""
        self.tokens += tokens
        self.hist["steps_done"] = step
        if step % self.log_every == 0 or step == self.steps:
            self.hist["steps"].append(step)
            self.hist["loss"].append(loss)
        self.bar.update(step, loss, tokens)

    def evaluation(self, step: int, result: dict) -> str | None:
        """Keep a finite evaluation; otherwise what diverged (and the evaluation is not kept)."""
        if not _all_finite(result):
            return "an evaluation that is not a finite number"
        self.evals.append({"step": step, **result})
        return None

    def diverged(self, step: int, what: str) -> None:
        self.hist["diverged_at"], self.hist["diverged_loss"] = step, what
        self.bar.close(f"diverged at step {step}")
        if self.say:
            print(f"{self.name}: training diverged at step {step} ({what})", file=sys.stderr, flush=True)

    def interrupted(self) -> None:
        self.hist["interrupted"] = True
        self.bar.close("interrupted")

    def history(self) -> dict:
        seconds = time.perf_counter() - self.start
        return {**self.hist, "seconds": seconds, "tokens_per_s": self.tokens / max(seconds, 1e-9)}


def _lr_at(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 10% of `lr` at `steps`."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
          m: torch.Tensor | None, lr: float) -> tuple[float, str | None]:
    """One clipped AdamW step at `lr`: (loss, None), or (loss, what diverged) with the step
    not applied when the loss or the gradient norm is not a finite number."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss = _masked_ce(model(x), y, m)
    value = float(loss.detach())
    if not math.isfinite(value):
        return value, f"loss {value}"
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    if not math.isfinite(norm):
        return value, f"gradient norm {norm}"
    opt.step()
    return value, None


def _eval(model: torch.nn.Module, evaluate: Callable[[int], dict], step: int) -> dict:
    was = model.training
    model.eval()
    with torch.no_grad():
        out = evaluate(step)
    model.train(was)
    return out


def _all_finite(obj) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(v) for v in obj)
    return True


def diverged_entry(run: str, hist: dict) -> dict | None:
    """The results' "diverged" entry of a training history, or None when it did not diverge."""
    if hist.get("diverged_at") is None:
        return None
    return {"run": run, "step": hist["diverged_at"], "reason": hist["diverged_loss"]}


def _masked_ce(logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
    if m is None:
        return loss.mean()
    m = m.flatten().to(loss.dtype)
    return (loss * m).sum() / m.sum().clamp_min(1)
