"""`multihead lab uptrain --model smollm2` (or `--model FOLDER`): convert a real Llama-family
transformers model to a cheaper KV cache, uptrain it, and measure what it costs.

Ainslie et al. (2023) mean-pool a trained model's key/value heads into MQA/GQA and uptrain
it with a few percent of the original compute; MHA2MLA (Ji et al., 2025) converts to MLA
with partial RoPE and an SVD of the key/value projections. Here, on a pretrained model
(SmolLM2-135M-Instruct by default: 30 layers, 9 query / 3 KV heads of 64), each target
is converted, uptrained and measured against the base and an unconverted control trained
with the same budget; Ctrl-C stops at once and `--resume` continues.

Details: docs/lab.md, "How `lab uptrain --model` runs".
"""

from __future__ import annotations

import contextlib
import copy
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from multihead.checks import check_int, check_positive_number
from multihead.corpus import split_kjv
from multihead.errors import UsageError
from multihead.lab.decode_cost import decode_ms_per_token, kv_bytes_per_token
from multihead.lab.devices import resolve_device
from multihead.lab.plots import draw_plots
from multihead.lab.progress import Overall, Progress
from multihead.lab.results import new_results, write_json_atomic
from multihead.lab.uptrain_hf_report import plot_uptrain_hf, summarise_uptrain_hf
from multihead.tokens import pieces, prefix, windows

__all__ = ["HFUptrainConfig", "run_uptrain_hf", "work_plan"]

_INITS = ("aligned", "mean", "first", "random")
_TRAINABLE = ("attention", "all")
STATE = "resume.pt"  # in --out: the training in progress at an interrupt


@dataclass(frozen=True)
class HFUptrainConfig:
    model: str = "smollm2"  # 'smollm2' (bundled), a local Llama-family model folder, or a .gguf file
    steps: int = 48  # uptraining steps per target (9 trainings: 19 min of CPU time on one thread, docs/lab.md)
    batch_size: int = 4
    context: int = 64  # tokens per training window
    lr: float = 3e-4  # AdamW peak, after `warmup` linear steps, cosine to 10% at `steps`
    warmup: int = 5
    fractions: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)  # evaluated after these shares of `steps`
    eval_windows: int = 8
    eval_context: int = 128
    inits: tuple[str, ...] = _INITS  # MQA inits
    # MLA targets: a kv_rank R at `rope_dim`, or (R, P) with P RoPE dims; at SmolLM2's 25,920 B/token
    # the budget buys more as 144 + 72 than as 192 + 24 (docs/mla.md's conversion table)
    ranks: tuple[int | tuple[int, int], ...] = (64, 128, (144, 72))
    rope_dim: int = 24  # MLA's decoupled RoPE width (a multiple of 2 * Hkv: SmolLM2 keeps 4 pairs per KV head)
    distill: bool = True  # MQA (mean) also uptrained by distillation from the base model
    trainable: str = "attention"  # "attention" (embeddings, MLPs, norms frozen) or "all"
    freeze_check: bool = True  # MQA (mean) trained once more with every parameter trainable
    max_train_chars: int | None = None  # the training split's first characters only (None: all of it)
    generate_tokens: int = 8  # new tokens of the generate() whose cache is measured
    calibration_tokens: int = 4096  # of the training split, for the data-aware conversions (0: weights only)
    probe_steps: int = 3  # steps per candidate rate of the learning-rate probe (0: train at lr; uptrain_lr.py)

    @classmethod
    def long(cls, model: str = "smollm2") -> HFUptrainConfig:
        """The longer curve: the control, MQA (aligned) and MLA at two budgets, each uptrained on
        196 steps of 8 x 128 tokens (200,704) and evaluated after 12, 49, 98 and 196 steps
        (12,288, 50,176, 100,352 and 200,704 tokens): about 2 CPU-hours on SmolLM2."""
        return cls(model=model, steps=196, batch_size=8, context=128, warmup=10,
                   fractions=(0.0, 12 / 196, 49 / 196, 98 / 196, 1.0), inits=("aligned",), ranks=(64, (144, 72)),
                   distill=False, freeze_check=False)

    @classmethod
    def quick(cls, model: str = "smollm2") -> HFUptrainConfig:
        """About a minute on SmolLM2 (seconds on a tiny model): the whole pipeline, tiny budgets."""
        return cls(model=model, steps=4, batch_size=1, context=32, warmup=1, fractions=(0.0, 0.5, 1.0),
                   eval_windows=2, eval_context=32, inits=("aligned", "mean", "random"), ranks=(64,),
                   freeze_check=False, calibration_tokens=1024, probe_steps=1,
                   max_train_chars=200_000, generate_tokens=2)

    def __post_init__(self):
        from multihead.checks import check_nonnegative_int, check_positive_int

        for name in ("steps", "batch_size", "context", "eval_windows", "eval_context", "generate_tokens"):
            check_positive_int(name, getattr(self, name))
        check_nonnegative_int("calibration_tokens", self.calibration_tokens)
        check_nonnegative_int("probe_steps", self.probe_steps)
        if "aligned" in self.inits and not self.calibration_tokens:
            raise ValueError("inits 'aligned' fits the merge on calibration tokens; calibration_tokens is 0")
        check_nonnegative_int("rope_dim", self.rope_dim)
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"model must be a non-empty str; received {self.model!r}")
        check_positive_number("lr", self.lr)
        check_int("warmup", self.warmup, minimum=0, maximum=self.steps - 1)
        bad = [f for f in self.fractions if not (isinstance(f, (int, float)) and 0 <= f <= 1)]
        if bad or 0.0 not in self.fractions:
            raise ValueError(f"fractions must lie in [0, 1] and include 0 (as converted); received "
                             f"{', '.join(map(str, self.fractions))}")
        if any(i not in _INITS for i in self.inits):
            raise ValueError(f"inits must be some of {', '.join(_INITS)}; received {','.join(self.inits)!r}")
        for rank, rope in map(self._mla_shape, self.ranks):
            check_int("ranks[...]", rank, minimum=1)
            check_nonnegative_int("ranks[...] rope dims", rope)
        if self.trainable not in _TRAINABLE:
            raise ValueError(f"trainable must be one of {', '.join(_TRAINABLE)}; received {self.trainable!r}")
        if self.max_train_chars is not None:
            check_positive_int("max_train_chars", self.max_train_chars)

    def _mla_shape(self, entry) -> tuple:
        """(kv_rank, RoPE dims) of one `ranks` entry: R at `rope_dim`, or (R, P) (a list once
        read back from results.json)."""
        return tuple(entry) if isinstance(entry, (tuple, list)) and len(entry) == 2 else (entry, self.rope_dim)

    def mla_targets(self) -> list[tuple[str, int, int]]:
        """(target name, kv_rank, RoPE dims) of each MLA target, by cache size: "mla-R" at
        `rope_dim`, "mla-R+P" at another width."""
        shapes = set(map(self._mla_shape, self.ranks))
        return [(f"mla-{r}" if p == self.rope_dim else f"mla-{r}+{p}", r, p)
                for r, p in sorted(shapes, key=lambda s: (s[0] + s[1], s[0]))]

    def tokens_seen(self, step: int) -> int:
        """Training tokens a target has seen after `step` steps."""
        return step * self.batch_size * self.context

    def eval_steps(self) -> tuple[int, ...]:
        """The steps evaluated: 0 and each fraction of `steps` (at least 1 when above 0)."""
        return tuple(sorted({0 if f == 0 else max(1, round(f * self.steps)) for f in self.fractions}))


# ------------------------------------------------------------------ data


class _Data:
    """Token ids of both splits, the batch of every step and the held-out windows."""

    def __init__(self, tokenizer, cfg: HFUptrainConfig, seed: int):
        train, held_out = split_kjv(cfg.max_train_chars)
        self.train = torch.tensor(pieces(tokenizer, train), dtype=torch.long)
        self.held_out = torch.tensor(pieces(tokenizer, held_out), dtype=torch.long)
        self.start = prefix(tokenizer)  # every window begins as a text does for the model (Gemma: <bos>)
        self.cfg, self.seed = cfg, seed
        n = cfg.eval_context + 1
        if len(self.held_out) < n * cfg.eval_windows or len(self.train) < cfg.context + 2:
            raise UsageError(f"the KJV splits give {len(self.train)} training and {len(self.held_out)} held-out "
                             f"tokens; need {cfg.context + 2} and {n * cfg.eval_windows}")
        starts = torch.linspace(0, len(self.held_out) - n + len(self.start), cfg.eval_windows).long()
        self.windows = windows(self.start, self.held_out, starts, n)  # (W, eval_context + 1)

    def batch(self, step: int) -> torch.Tensor:
        """(B, context + 1) token ids of training step `step` (1-based): a function of the seed
        and the step alone, so every target and a resumed run read the same batches."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n = self.cfg.context + 1
        starts = torch.randint(0, len(self.train) - n + len(self.start) + 1, (self.cfg.batch_size,), generator=gen)
        return windows(self.start, self.train, starts, n)

    def probe(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The learning-rate probe's batches and its check batch: from the training split, at
        steps no training reads (0, -1, -2, ...)."""
        return [self.batch(-k) for k in range(self.cfg.probe_steps)], self.batch(-self.cfg.probe_steps)

    def calibration(self) -> torch.Tensor | None:
        """`(B, 256)` token ids spread evenly over the training split for the data-aware
        conversions (about calibration_tokens of them), or None."""
        if not self.cfg.calibration_tokens:
            return None
        width = min(256, len(self.train) + len(self.start))
        starts = torch.linspace(0, len(self.train) - width + len(self.start),
                                max(1, self.cfg.calibration_tokens // width)).long()
        return windows(self.start, self.train, starts, width)  # each begins as a text does (Gemma: <bos>)


def _nll_sum(model, windows: torch.Tensor, device) -> tuple[float, int]:
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows.split(4):
            w = w.to(device)
            logits = model(input_ids=w[:, :-1], use_cache=False).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(),
                                                             reduction="sum"))
            count += w[:, 1:].numel()
    return total, count


def held_out_ppl(model, windows: torch.Tensor, device) -> float:
    """exp(mean next-token NLL) over every predicted token of the held-out windows."""
    was = model.training
    model.eval()
    total, count = _nll_sum(model, windows, device)
    model.train(was)
    return math.exp(total / count)


# ------------------------------------------------------------------ the runs


@dataclass(frozen=True)
class _Unit:
    """One training of the run: a target (or the control) and how it learns."""

    key: str  # unique, in results.json "done"
    target: str  # "control", "mqa", "mla-R" or "mla-R+P" (kv_rank R, P RoPE dims where not rope_dim)
    init: str  # "aligned" | "mean" | "first" | "random" | "calibrated" | "svd" | "none" (the control)
    objective: str = "next-token"  # or "distill"
    trainable: str = "attention"
    role: str = "variant"  # "variant", "control", "freeze_check"


def work_plan(cfg: HFUptrainConfig) -> list[_Unit]:
    """Every training of a run, in order: the control first (every target is judged by it)."""
    units = [_Unit("control", "control", "none", trainable=cfg.trainable, role="control")]
    units += [_Unit(f"mqa/{i}", "mqa", i, trainable=cfg.trainable) for i in cfg.inits]
    mla = "calibrated" if cfg.calibration_tokens else "svd"
    units += [_Unit(f"{name}/{mla}", name, mla, trainable=cfg.trainable) for name, _, _ in cfg.mla_targets()]
    if cfg.distill:
        units.append(_Unit("mqa/mean/distill", "mqa", "mean", objective="distill", trainable=cfg.trainable))
    if cfg.freeze_check:
        other = "all" if cfg.trainable == "attention" else "attention"
        units.append(_Unit(f"mqa/mean/{other}", "mqa", "mean", trainable=other, role="freeze_check"))
    return units


def _convert(base, unit: _Unit, cfg: HFUptrainConfig, seed: int, calibration: torch.Tensor | None):
    """The unit's model (a new one; `base` is untouched) and its per-layer K/V errors."""
    from multihead import convert

    if unit.target == "control":
        return copy.deepcopy(base), []
    if unit.target == "mqa":
        gen = torch.Generator().manual_seed(seed * 1_000 + 1)  # "random": the same draw on every run
        model, report = convert.to_gqa(base, 1, init=unit.init, generator=gen, return_report=True,
                                       calibration=calibration if unit.init == "aligned" else None)
    else:  # "calibrated": to_mla's data-aware default on the calibration tokens; "svd": the weights only
        rank, rope_dim = next((r, p) for name, r, p in cfg.mla_targets() if name == unit.target)
        model, report = convert.to_mla(base, rank, rope_dim=rope_dim, return_report=True,
                                       calibration=calibration if unit.init == "calibrated" else None)
    return model, [round(e, 6) for e in report.errors]


def _trainable(model, which: str) -> list[tuple[str, torch.nn.Parameter]]:
    """Set requires_grad on the parameters that train (attention layers, or all) and return them."""
    named = list(model.named_parameters())
    for name, p in named:
        p.requires_grad_(which == "all" or ".self_attn." in name)
    chosen = [(n, p) for n, p in named if p.requires_grad]
    if not chosen:
        raise UsageError(f"no parameter of {type(model).__name__} is in an attention layer (.self_attn.); "
                         "valid: a Llama-family model")
    return chosen


def _lr_at(step: int, cfg: HFUptrainConfig, peak: float | None = None) -> float:
    """Step `step` (1-based): linear warmup, then cosine decay to 10% of the peak (lr, or the
    probe's choice) at `steps`."""
    peak = cfg.lr if peak is None else peak
    if cfg.warmup and step <= cfg.warmup:
        return peak * step / cfg.warmup
    t = (step - 1 - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


@contextlib.contextmanager
def _held_interrupt():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until it ends, then raise it:
    an optimiser step is never left half applied. Only the main thread can set a handler;
    elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


StepCallback = Callable[[str, int, float], None]


class _Run:
    def __init__(self, cfg, out: Path, res: dict, base, data: _Data, dev, seed, callback, progress, overall):
        self.cfg, self.out, self.res, self.base, self.data = cfg, out, res, base, data
        self.dev, self.seed, self.callback, self.progress, self.overall = dev, seed, callback, progress, overall
        self.prompt = data.windows[:1, :8].to(dev)  # the first held-out window's start, BOS included
        self.calibration = data.calibration()
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.elapsed0 = float(res.get("elapsed_s", 0.0))
        self.cpu0 = float(res.get("cpu_s", 0.0))  # CPU time: on a shared machine, what the run would take alone

    def save(self) -> None:
        self.res["elapsed_s"] = self.elapsed0 + time.perf_counter() - self.t0
        self.res["cpu_s"] = self.cpu0 + time.process_time() - self.c0
        write_json_atomic(self.out / "results.json", self.res)

    def ppl(self, model) -> float:
        return held_out_ppl(model, self.data.windows, self.dev)

    def _entries(self, unit: _Unit) -> list[dict]:
        r = self.res["results"]
        if unit.role == "control":
            return r["control"]
        if unit.role == "freeze_check":
            return r["freeze"]["check"]
        return [v for v in r["variants"] if (v["target"], v["init"], v["objective"])
                == (unit.target, unit.init, unit.objective)]

    def recorded(self, unit: _Unit, step: int) -> bool:
        """Whether the unit's evaluation at `step` is in the results (an interrupted run's may be)."""
        return any(e["steps"] == step for e in self._entries(unit))

    def record(self, unit: _Unit, entry: dict) -> None:
        r = self.res["results"]
        if unit.role == "control":
            r["control"].append({"steps": entry["steps"], "tokens": entry["tokens"], "val_ppl": entry["val_ppl"]})
        elif unit.role == "freeze_check":
            r["freeze"]["check"].append(entry)
        else:
            r["variants"].append(entry)
        self.save()

    def unit(self, unit: _Unit, state: dict | None) -> None:
        cfg, r = self.cfg, self.res["results"]
        model, errors = _convert(self.base, unit, cfg, self.seed, self.calibration)
        model.to(self.dev)
        params = _trainable(model, unit.trainable)
        opt = torch.optim.AdamW([p for _, p in params], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        kv = r["base"]["kv_bytes_per_token"] if unit.target == "control" else None
        decode = None
        info = {"target": unit.target, "init": unit.init, "objective": unit.objective, "trainable": unit.trainable}
        start, seconds, cpu, losses = 0, 0.0, 0.0, []
        if state is not None:  # the interrupted training: its weights, moments and step
            with torch.no_grad():
                named = dict(params)
                for name, t in state["trainable"].items():
                    named[name].copy_(t)
            opt.load_state_dict(state["optimizer"])
            start, seconds, losses, kv = state["step"], state["seconds"], state["losses"], state["kv"]
            cpu, decode = state.get("cpu", 0.0), state.get("decode")
        if kv is None:
            kv = kv_bytes_per_token(model, self.prompt, cfg.generate_tokens)
        if state is None:  # timed before training: the architecture sets it, not the weights
            decode = decode_ms_per_token(model, self.base, self.prompt, cfg.generate_tokens)
        info["kv_bytes_per_token"] = kv
        if decode is not None and unit.role == "control":  # the base against its own copy: the timing's noise
            r["control_decode"] = decode
        elif decode is not None:
            info["decode"] = decode
        if unit.target != "control":
            info["kv_reconstruction_error"] = errors
        evals = cfg.eval_steps()
        self._record_start(unit, model, info, start, seconds)
        label = self.overall.next_label(f"uptrain {unit.key}")
        bar = Progress(cfg.steps, label, enabled=self.progress, overall=self.overall)
        if start:
            bar.update(start, losses[-1])
        teacher = self.base if unit.objective == "distill" else None
        peak = self._peak_lr(unit, model, params, teacher)
        step = start
        t, c = time.perf_counter(), time.process_time()
        try:
            model.train()
            for step in range(start + 1, cfg.steps + 1):
                batch = self.data.batch(step).to(self.dev)
                loss = _loss(model, teacher, batch)
                value = float(loss.detach())
                if not math.isfinite(value):  # recorded, and this training stops: its numbers so far stay
                    self.res["diverged"].append({"run": unit.key, "step": step, "reason": f"loss {value}"})
                    break
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
                for g in opt.param_groups:
                    g["lr"] = _lr_at(step, cfg, peak)
                with _held_interrupt():
                    opt.step()
                    losses.append(round(value, 6))
                bar.update(step, losses[-1], batch[:, :-1].numel())
                if step in evals:
                    model.eval()
                    ppl = self.ppl(model)
                    model.train()
                    self.record(unit, {**info, "steps": step, "tokens": cfg.tokens_seen(step),
                                       "val_ppl": ppl, "seconds": seconds + time.perf_counter() - t})
                if self.callback is not None:
                    self.callback(unit.key, step, losses[-1])
            bar.close()
        except KeyboardInterrupt:
            bar.close("interrupted")
            done = len(losses)  # steps whose update was applied (the held interrupt waits for it)
            self._save_state(unit, params, opt, done, seconds + time.perf_counter() - t, losses, kv,
                             cpu + time.process_time() - c, decode)
            raise
        model.eval()
        self._finish(unit, params, losses, seconds + time.perf_counter() - t, cpu + time.process_time() - c)

    def _record_start(self, unit: _Unit, model, info: dict, start: int, seconds: float) -> None:
        """The evaluation the training starts from, where the results lack it: step 0's, or
        the evaluation at `start` that an interrupt cut short."""
        r = self.res["results"]
        if start == 0 and not self.recorded(unit, 0):
            same = [v for v in r["variants"] if (v["target"], v["init"], v["steps"]) == (unit.target, unit.init, 0)]
            ppl0 = same[0]["val_ppl"] if same else self.ppl(model)  # the distilled target is one converted already
            self.record(unit, {**info, "steps": 0, "tokens": 0, "val_ppl": ppl0, "seconds": 0.0})
        elif start in self.cfg.eval_steps() and not self.recorded(unit, start):
            self.record(unit, {**info, "steps": start, "tokens": self.cfg.tokens_seen(start),
                               "val_ppl": self.ppl(model), "seconds": seconds})

    def _finish(self, unit: _Unit, params, losses: list[float], seconds: float, cpu: float) -> None:
        """A completed training into the results: its losses and times, the unit done, and for
        the freeze comparison its seconds per step and trainable size; its resume state gone."""
        r = self.res["results"]
        r["losses"][unit.key] = losses
        r["seconds"][unit.key] = seconds
        r.setdefault("cpu_seconds", {})[unit.key] = cpu
        r["done"].append(unit.key)
        if unit.role == "freeze_check" or (unit.target, unit.init, unit.objective) == ("mqa", "mean", "next-token"):
            r["freeze"]["seconds_per_step"][unit.trainable] = seconds / self.cfg.steps
            r["freeze"]["trainable_params"][unit.trainable] = sum(p.numel() for _, p in params)
        (self.out / STATE).unlink(missing_ok=True)
        self.save()

    def _peak_lr(self, unit: _Unit, model, params, teacher) -> float:
        """The unit's peak learning rate: chosen by the probe (uptrain_lr.py) before its first
        step and kept in results.json "lr", so a resumed training reads the same one."""
        from multihead.lab.uptrain_lr import choose_lr

        kept = self.res["results"].setdefault("lr", {})
        if unit.key in kept:
            return kept[unit.key]["chosen"]
        if not self.cfg.probe_steps:
            kept[unit.key] = {"chosen": self.cfg.lr}
            return self.cfg.lr
        batches, check = self.data.probe()
        model.train()
        chosen, probe = choose_lr([p for _, p in params], lambda b: _loss(model, teacher, b.to(self.dev)), batches,
                                  check, self.cfg.lr)
        kept[unit.key] = probe
        self.save()
        return chosen

    def _save_state(self, unit, params, opt, step, seconds, losses, kv, cpu, decode) -> None:
        from multihead.files import atomic_path

        state = {"unit": unit.key, "step": step, "seconds": seconds, "cpu": cpu, "losses": losses, "kv": kv,
                 "decode": decode,
                 "trainable": {n: p.detach().cpu().clone() for n, p in params}, "optimizer": opt.state_dict()}
        with atomic_path(self.out / STATE) as tmp:
            torch.save(state, tmp)


def _loss(model, teacher, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, or KL(teacher || model) of the next-token distributions."""
    x, y = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=x, use_cache=False).logits.float()  # (B, T, V)
    if teacher is None:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    with torch.no_grad():
        target = torch.log_softmax(teacher(input_ids=x, use_cache=False).logits.float(), dim=-1)
    return torch.nn.functional.kl_div(torch.log_softmax(logits, dim=-1).flatten(0, 1), target.flatten(0, 1),
                                      log_target=True, reduction="batchmean")


# ------------------------------------------------------------------ entry point


def _load(spec: str):
    """The base model (read only: conversions copy it) and its tokenizer, with a clear error."""
    from multihead.interop.hf.mla import mla_layers
    from multihead.interop.loaders import InspectError, load_model

    try:
        loaded = load_model(spec)
    except (InspectError, ValueError, OSError) as err:
        raise UsageError(f"--model {spec}: {err}") from None
    model = getattr(loaded, "model", None)
    if model is None or not getattr(loaded, "is_causal_lm", False):
        raise UsageError(f"--model {spec}: not a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3); valid: "
                         "'smollm2' or a local folder of one")
    if not mla_layers(model):
        raise UsageError(f"--model {spec}: lab uptrain converts the model to MQA and to MLA; "
                         f"{_refusals(model) or 'not a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3)'}; "
                         "valid: 'smollm2' or a local folder of a Llama, Mistral, Qwen2 or Qwen3 model")
    return model.eval(), loaded.tokenizer


def _refusals(model) -> str:
    """The converters' own reasons for refusing `model`, a model without MLA-convertible layers,
    or '' where they give none but the family's. Each is asked only where it refuses in its
    checks, before copying anything: to_mla always here, to_gqa where the model has one
    key/value head already (elsewhere it could convert the whole model)."""
    from multihead import convert

    asks = [lambda: convert.to_mla(model, 1, rope_dim=0)]
    if getattr(getattr(model, "config", None), "num_key_value_heads", None) == 1:
        asks.append(lambda: convert.to_gqa(model, 1))
    reasons = []
    for convert_it in asks:
        try:
            convert_it()
        except ValueError as err:
            reasons.append(str(err))
        except TypeError:
            pass
    return "; ".join(reasons)


def _check_model(cfg: HFUptrainConfig, model) -> None:
    from multihead.interop.hf.mla import mla_layers

    attn = mla_layers(model)[0][1]
    D = attn.head_dim
    Hkv = attn.k_proj.out_features // D
    valid = list(range(2 * Hkv, Hkv * D + 1, 2 * Hkv))
    for name, rank, rope_dim in cfg.mla_targets():
        flag = f"--kv-ranks {rank}+{rope_dim}" if name.count("+") else f"--rope-dim {rope_dim}"
        if rope_dim not in valid:
            raise UsageError(f"{flag}: the model has {Hkv} KV heads of {D}, so MLA's RoPE width must "
                             f"be a multiple of {2 * Hkv} in {valid[0]}..{valid[-1]}; valid: "
                             f"{', '.join(map(str, valid[:8]))}{', ...' if len(valid) > 8 else ''}")
        top = min(Hkv * (D - rope_dim // Hkv) + attn.v_proj.out_features, attn.q_proj.in_features)
        if rank > top:
            raise UsageError(f"--kv-ranks {rank}: at most {top} (the rank of the stacked nope keys and values "
                             f"at rope_dim {rope_dim})")


def _config_key(cfg: HFUptrainConfig, seed: int) -> dict:
    return {"config": asdict(cfg), "seed": seed}


def run_uptrain_hf(cfg: HFUptrainConfig | None = None, out_dir: str | Path = "lab-uptrain", *, seed: int = 0,
                   device: str = "auto", callback: StepCallback | None = None, progress: bool = True,
                   resume: bool = False, plots: bool = True) -> dict:
    """Run (or, with `resume`, continue) the experiment into `out_dir`; return results.json's object
    (`plots=False` skips uptrain.png).

    Ctrl-C (KeyboardInterrupt, from the user or `callback(unit, step, loss)`) is not raised:
    the run stops, saves what it did and returns with "interrupted": true."""
    import json

    cfg = cfg or HFUptrainConfig()
    dev = resolve_device(device)
    out = Path(out_dir)
    state = None
    res = None
    if resume and (out / "results.json").is_file():
        res = json.loads((out / "results.json").read_text(encoding="utf-8"))
        fresh = new_results("uptrain", cfg, seed, dev)
        if (res.get("config"), res.get("seed")) != (fresh["config"], fresh["seed"]) or "done" not in res["results"]:
            raise UsageError(f"--resume {out}: its results.json was written by another run (other settings or "
                             "seed, or not an uptrain --model run); give the same flags, or a new --out")
        if (out / STATE).is_file():
            state = torch.load(out / STATE, weights_only=True)
        res["interrupted"] = False
    elif resume is False and (out / "results.json").is_file():
        raise UsageError(f"{out} holds a run already; give --resume to continue it, or a new --out")
    base, tokenizer = _load(cfg.model)
    _check_model(cfg, base)
    data = _Data(tokenizer, cfg, seed)
    out.mkdir(parents=True, exist_ok=True)  # only now: a model or data that fails to load leaves no folder
    if res is None:
        res = new_results("uptrain", cfg, seed, dev)
        res["results"] = {
            "model": cfg.model, "model_class": type(base).__name__,
            "train_split": "KJV Genesis to Acts", "held_out": "KJV Romans to Revelation",
            "train_tokens": len(data.train), "held_out_tokens": len(data.held_out),
            "eval_tokens": int(data.windows[:, 1:].numel()), "dtype": str(next(base.parameters()).dtype),
            "base": None, "control": [], "variants": [], "done": [], "losses": {}, "seconds": {}, "cpu_seconds": {},
            "freeze": {"frozen": _frozen_text(cfg.trainable), "trainable_params": {}, "seconds_per_step": {},
                       "total_params": sum(p.numel() for p in base.parameters()), "check": []},
        }
    units = [u for u in work_plan(cfg) if u.key not in res["results"]["done"]]
    steps_left = sum(cfg.steps for u in units) - (state["step"] if state else 0)
    overall = Overall(len(units), max(1, steps_left))
    run = _Run(cfg, out, res, base, data, dev, seed, callback, progress, overall)
    try:
        if res["results"]["base"] is None:
            base.to(dev)
            res["results"]["base"] = {"val_ppl": run.ppl(base),
                                      "kv_bytes_per_token": kv_bytes_per_token(base, run.prompt, cfg.generate_tokens),
                                      "params": sum(p.numel() for p in base.parameters())}
            run.save()
        for unit in units:
            mine = state if state is not None and state["unit"] == unit.key else None
            run.unit(unit, mine)
    except KeyboardInterrupt:
        res["interrupted"] = True
    summarise_uptrain_hf(cfg, res)
    run.save()
    if plots and not res["interrupted"] and res["results"]["variants"]:
        draw_plots(res, [lambda: plot_uptrain_hf(res, out / "uptrain.png")])
        run.save()
    return res


def _frozen_text(trainable: str) -> str:
    if trainable == "all":
        return "nothing: every parameter trains"
    return ("the token embedding (tied to the LM head), every MLP and every RMSNorm; each layer's attention "
            "module trains")


def configure(args, quick: bool) -> tuple[Callable, HFUptrainConfig]:
    """The CLI's runner and config for `lab uptrain --model ...` (flags the CLI parsed)."""
    if args.model is None:
        raise UsageError("--resume, --long and --rope-dim go with --model (lab uptrain --model smollm2 ...); the lab "
                         "model's uptrain neither resumes nor has such a preset or a RoPE width of its own")
    if quick and args.long:
        raise UsageError("--quick and --long are two presets; give one")
    base = (HFUptrainConfig.quick(args.model) if quick else HFUptrainConfig.long(args.model) if args.long
            else HFUptrainConfig(model=args.model))
    given = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "inits": args.inits,
             "ranks": args.ranks, "fractions": args.fractions, "rope_dim": getattr(args, "rope_dim", None)}
    given = {k: v for k, v in given.items() if v is not None}
    if "steps" in given and base.warmup >= given["steps"]:
        given["warmup"] = 0
    unused = [flag for flag, value in (("--from", args.from_checkpoint), ("--positions", args.positions),
                                       ("--d-model", args.d_model), ("--n-layers", args.n_layers),
                                       ("--n-heads", args.n_heads), ("--uptrain-lr", args.uptrain_lr),
                                       ("--mla-rope-dims", args.mla_rope_dims)) if value is not None]
    if args.kv_heads not in (None, (1,)):
        unused.append("--kv-head-counts")
    if unused:
        raise UsageError(f"{', '.join(unused)}: flags of the lab model's uptrain; with --model the targets are MQA "
                         "and MLA (--inits, --kv-ranks, --rope-dim, --steps, --fractions, --batch-size, --lr)")
    try:
        cfg = replace(base, **given)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    resume = bool(getattr(args, "resume", False))

    def runner(cfg, out, *, seed, device, progress):
        return run_uptrain_hf(cfg, out, seed=seed, device=device, progress=progress, resume=resume)

    return runner, cfg

