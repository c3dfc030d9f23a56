"""`multihead lab uptrain`: convert a trained MHA model to a cheaper KV cache, and measure
what the conversion costs and how much a little more training buys back.

Ainslie et al., 2023 ("GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints") turn a trained multi-head model into GQA or MQA by mean-pooling
each group's key and value heads, then "uptrain" it for ~5% of the original steps. This
experiment repeats that on a character-level LM of the King James Bible (the `lab mla`
model, same defaults): the baseline, its conversions, their uptraining, and each target
geometry trained from scratch.

Details: docs/lab.md, "How `lab uptrain` runs on the lab's model".
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from multihead.checkpoint import Vocab, load_lab_checkpoint, save_lab_checkpoint
from multihead.decoder import LabConfig, LabTransformer
from multihead.lab.devices import seed_everything
from multihead.lab.mla import cache_bytes_per_token, split_corpus, val_bits_per_char, windows
from multihead.lab.plots import draw_plots
from multihead.lab.progress import Overall
from multihead.lab.results import start_run, write_json_atomic
from multihead.lab.training import StepCallback, diverged_entry, train
from multihead.lab.uptrain_config import UptrainConfig
from multihead.lab.uptrain_report import plot_frontier, plot_uptrain, summarise_uptrain

__all__ = ["UptrainConfig", "run_uptrain", "targets"]

# the settings of a `lab mla` run that define the baseline and its data, with their kinds
_FROM_FIELDS = ("corpus", "max_chars", "d_model", "n_layers", "n_heads", "context", "steps", "batch_size", "lr",
                "warmup", "eval_batches", "val_fraction")
_FROM_KINDS = {"corpus": "a path (a string) or null (the bundled text)", "max_chars": "a positive integer or null",
               "lr": "a positive number", "val_fraction": "a number in (0, 1)"}


def _from_field_ok(name: str, value) -> bool:
    """Whether a results.json value may stand for `name` (JSON's kinds: ints, numbers, strings, null)."""
    if name == "corpus":
        return value is None or isinstance(value, str)
    if name in ("lr", "val_fraction"):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if name == "max_chars" and value is None:
        return True
    return isinstance(value, int) and not isinstance(value, bool) and value >= (0 if name == "warmup" else 1)


def targets(cfg: UptrainConfig) -> list[tuple[str, str, int, int | None, tuple[str, ...]]]:
    """(target name, "gqa" | "mla", n_kv_heads or kv_rank, MLA's rope_dim, inits) for every
    conversion; a RoPE baseline gives one MLA target per rank and rope_dim."""
    out = []
    for hkv in sorted(cfg.kv_heads):
        out.append(("MQA" if hkv == 1 else f"GQA-{hkv}", "gqa", hkv, None, cfg.inits))
    for r in sorted(cfg.ranks):
        if cfg.positions == "rope":
            out += [(f"MLA-{r} rope {p}", "mla", r, p, ("svd",)) for p in sorted(cfg.mla_rope_dims)]
        else:
            out.append((f"MLA-{r}", "mla", r, None, ("svd",)))
    return out


def run_uptrain(cfg: UptrainConfig | None = None, out_dir: str | Path = "lab-uptrain", *, seed: int = 0,
                device: str = "auto", callback: StepCallback | None = None, progress: bool = True) -> dict:
    """Run the experiment; write results.json, plots and the baseline's checkpoint to `out_dir`."""
    cfg = cfg or UptrainConfig()
    source = None
    if cfg.from_checkpoint is not None:
        source, cfg, seed = _load_source(cfg)
    vocab, corpus, train_ids, val_ids = split_corpus(cfg)
    dev, out, res, t0 = start_run("uptrain", cfg, out_dir, seed, device)
    res["results"] = {"corpus": corpus, "uptrain_peak_lr": cfg.uptrain_peak_lr, "mha": None, "variants": [],
                      "scratch": []}
    gen_val = torch.Generator().manual_seed(1_000_003 + seed)  # the validation windows of `lab mla`
    val = [windows(val_ids, cfg.batch_size, cfg.context, gen_val) for _ in range(cfg.eval_batches)]
    tg = targets(cfg)
    up_steps = sum(cfg.uptrain_steps(f) for f in cfg.fractions)
    n_conv = sum(len(t[-1]) for t in tg)
    overall = Overall((source is None) + len(tg) + n_conv * sum(f > 0 for f in cfg.fractions),
                      cfg.steps * ((source is None) + len(tg)) + n_conv * up_steps)
    ctx = _Run(cfg, train_ids, val, dev, seed, callback, progress, overall, out, res, t0)
    mha = None
    try:
        mha = _baseline(ctx, source, vocab)
        for name, kind, size, rope_dim, inits in tg:
            for init in inits:
                _conversion(ctx, mha, name, kind, size, rope_dim, init)
        for name, kind, size, rope_dim, _ in tg:
            _scratch(ctx, name, kind, size, rope_dim, len(vocab))
    except KeyboardInterrupt:
        res["interrupted"] = True
    summarise_uptrain(cfg, res)
    if mha is not None:
        save_lab_checkpoint(out / "model", mha, vocab, experiment="uptrain", extra={"variant": "MHA"})
        res["checkpoint"] = "model"
    ctx.save()  # the numbers first: a plot that fails cannot lose them
    if res["results"]["mha"] is not None and res["results"]["variants"]:
        draw_plots(res, [lambda: plot_uptrain(cfg, res, out / "uptrain.png"),
                         lambda: plot_frontier(cfg, res, out / "frontier.png")])
        ctx.save()
    return res


class _Run:
    """What every training of one run shares, and the results being written (saved after
    each model, so an interrupted run keeps what it finished)."""

    def __init__(self, cfg, train_ids, val, dev, seed, callback, progress, overall, out, res, t0):
        self.cfg, self.train_ids, self.val, self.dev, self.seed = cfg, train_ids, val, dev, seed
        self.callback, self.progress, self.overall = callback, progress, overall
        self.out, self.res, self.t0 = out, res, t0

    def batches(self, skip: int):
        """step -> batch: the baseline's data stream from batch `skip` + 1 on (the generator
        advanced past the first `skip` batches; drawing start offsets is cheap)."""
        gen = torch.Generator().manual_seed(self.seed)
        n = len(self.train_ids) - self.cfg.context - 1
        for _ in range(skip):
            torch.randint(0, n, (self.cfg.batch_size,), generator=gen)
        return lambda step: (*(t.to(self.dev) for t in windows(self.train_ids, self.cfg.batch_size,
                                                                  self.cfg.context, gen)), None)

    def train(self, model, steps: int, skip: int, label: str, lr: float) -> dict:
        warmup = round(self.cfg.warmup * steps / self.cfg.steps)  # the same share of the run as the baseline's
        return train(model, self.batches(skip), steps, lr=lr, warmup=warmup,
                     name=self.overall.next_label(label), callback=self.callback, progress=self.progress,
                     overall=self.overall)

    def val_bpc(self, model) -> float:
        return val_bits_per_char(model, self.val, self.dev)

    def finished(self, name: str, hist: dict) -> bool:
        """Record a divergence; raise KeyboardInterrupt after an interrupted training."""
        if hist["interrupted"]:
            raise KeyboardInterrupt
        entry = diverged_entry(name, hist)
        if entry is not None:
            self.res["diverged"].append(entry)
            self.save()
        return entry is None

    def save(self) -> None:
        self.res["elapsed_s"] = time.perf_counter() - self.t0
        write_json_atomic(self.out / "results.json", self.res)


def _attention_params(model: LabTransformer) -> int:
    return sum(p.numel() for b in model.blocks for p in b.attn.parameters())


def _baseline(ctx: _Run, source: LabTransformer | None, vocab: Vocab) -> LabTransformer:
    cfg = ctx.cfg
    if source is None:
        seed_everything(ctx.seed)  # the model's init, as `lab mla` draws it
        model = LabTransformer(_arch(cfg, len(vocab))).to(ctx.dev)
        hist = ctx.train(model, cfg.steps, 0, "uptrain MHA baseline", cfg.lr)
        if not ctx.finished("MHA baseline", hist):
            raise KeyboardInterrupt  # nothing to convert: stop here, "diverged" says why
        seconds = hist["seconds"]
    else:
        model, seconds = source.to(ctx.dev), None
    ctx.res["results"]["mha"] = {
        "val_bits_per_char": ctx.val_bpc(model), "kv_bytes_per_token": cache_bytes_per_token(model),
        "params": model.n_params(), "attention_params": _attention_params(model), "steps": cfg.steps,
        "source": "trained here" if source is None else str(cfg.from_checkpoint), "seconds": seconds,
    }
    ctx.save()
    return model


def _convert(mha: LabTransformer, kind: str, size: int, rope_dim: int | None, init: str, seed: int):
    from multihead import convert

    if kind == "mla" and rope_dim is not None:
        # layer by layer: a lab model's config cannot describe MLA keeping part of a rotary head
        # (its MLA takes RoPE from rope_dim at the default base), so the copy keeps its cfg
        model, rows = copy.deepcopy(mha), []
        for i, block in enumerate(model.blocks):
            block.attn, report = convert.to_mla(block.attn, size, rope_dim=rope_dim, return_report=True)
            rows.append(convert.LayerConversion(f"blocks.{i}.attn", report.error))
        return model, convert.ConversionReport(f"MLA-{size}", "svd", tuple(rows))
    if kind == "mla":
        return convert.to_mla(mha, size, return_report=True)
    gen = torch.Generator().manual_seed(seed * 1_000 + size)  # "random": the same draw for every fraction
    return convert.to_gqa(mha, size, init=init, generator=gen, return_report=True)


def _conversion(ctx: _Run, mha: LabTransformer, name: str, kind: str, size: int, rope_dim: int | None,
                init: str) -> None:
    """Convert, evaluate, then uptrain a copy for each fraction and evaluate it."""
    cfg = ctx.cfg
    converted, report = _convert(mha, kind, size, rope_dim, init, ctx.seed)
    base = {"target": name, "init": init, "kv_bytes_per_token": cache_bytes_per_token(converted),
            "params": converted.n_params(), "attention_params": _attention_params(converted),
            "kv_reconstruction_error": list(report.errors)}
    for fraction in cfg.fractions:
        steps = cfg.uptrain_steps(fraction)
        model = copy.deepcopy(converted)
        seconds = 0.0
        if steps:
            hist = ctx.train(model, steps, cfg.steps, f"uptrain {name} {init} {fraction:g}", cfg.uptrain_peak_lr)
            if not ctx.finished(f"{name} {init} uptrain {fraction:g}", hist):
                continue
            seconds = hist["seconds"]
        ctx.res["results"]["variants"].append({
            **base, "uptrain_fraction": fraction, "uptrain_steps": steps, "val_bits_per_char": ctx.val_bpc(model),
            "seconds": seconds})
        ctx.save()


def _scratch(ctx: _Run, name: str, kind: str, size: int, rope_dim: int | None, vocab_size: int) -> None:
    cfg = ctx.cfg
    arch = _arch(cfg, vocab_size)
    if kind == "mla":  # a lab MLA model has learned positions, and RoPE in its rope_dim dims
        arch = replace(arch, attention="mla", kv_rank=size, rope_dim=rope_dim or 0, positions="learned")
    else:
        arch = replace(arch, n_kv_heads=size)
    seed_everything(ctx.seed)
    model = LabTransformer(arch).to(ctx.dev)
    hist = ctx.train(model, cfg.steps, 0, f"uptrain {name} scratch", cfg.lr)
    if not ctx.finished(f"{name} scratch", hist):
        return
    ctx.res["results"]["scratch"].append({
        "target": name, "val_bits_per_char": ctx.val_bpc(model), "kv_bytes_per_token": cache_bytes_per_token(model),
        "params": model.n_params(), "attention_params": _attention_params(model), "steps": cfg.steps,
        "seconds": hist["seconds"]})
    ctx.save()


def _arch(cfg: UptrainConfig, vocab_size: int) -> LabConfig:
    """The baseline's architecture: `lab mla`'s MHA variant."""
    return LabConfig(vocab_size=vocab_size, max_len=cfg.context, d_model=cfg.d_model, n_layers=cfg.n_layers,
                     n_heads=cfg.n_heads, mlp=True, positions=cfg.positions)


def _short(value) -> str:
    """A results.json value as the file spells it, with its kind."""
    if value is None:
        return "null"
    text = json.dumps(value)
    return (text if len(text) <= 40 else text[:37] + "...") + f" ({type(value).__name__})"


def _load_source(cfg: UptrainConfig) -> tuple[LabTransformer, UptrainConfig, int]:
    """The MHA model of a `lab mla` run, the config with that run's settings, and its seed."""
    from multihead.errors import UsageError

    path = Path(cfg.from_checkpoint)
    folder = path.parent if (path / "config.json").is_file() and not (path / "results.json").is_file() else path
    results = folder / "results.json"
    if not results.is_file():
        raise UsageError(f"--from {path}: no results.json in {folder}; give the folder of a `multihead lab mla` "
                         "run (its MHA checkpoint in model/ and its settings in results.json)")
    try:
        run = json.loads(results.read_text(encoding="utf-8"))
        original, run_seed, experiment = run["config"], run["seed"], run["experiment"]
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--from {path}: {results} is not a lab results file ({err})") from None
    # UsageError (a ValueError), not TypeError: a wrong type here is a bad results file, not a bad argument
    if not isinstance(original, dict):
        raise UsageError(f"--from {path}: {results} has config {_short(original)}; valid: the settings of the run "
                         "(an object)")
    if isinstance(run_seed, bool) or not isinstance(run_seed, int):
        raise UsageError(f"--from {path}: {results} has seed {_short(run_seed)}; valid: an integer")
    for name in _FROM_FIELDS:
        if name in original and not _from_field_ok(name, original[name]):
            valid = _FROM_KINDS.get(name, "a non-negative integer" if name == "warmup" else "a positive integer")
            raise UsageError(f"--from {path}: {results} has config.{name} {_short(original[name])}; valid: {valid}")
    if cfg.positions != "learned":
        raise UsageError(f"--from {path}: a lab mla model has learned positions; --positions {cfg.positions} "
                         "trains its own baseline (leave out --from)")
    if experiment != "mla":
        raise UsageError(f"--from {path}: a `lab {experiment}` run; valid: the folder of a `lab mla` run")
    try:
        model, vocab, meta = load_lab_checkpoint(folder)
    except ValueError as err:
        raise UsageError(f"--from {path}: {err}") from None
    if model.cfg.kind != "MHA" or model.cfg.positions != "learned":
        raise UsageError(f"--from {path}: the checkpoint is {model.cfg.kind}; valid: the MHA model of a lab mla run")
    try:
        new = replace(cfg, **{k: original[k] for k in _FROM_FIELDS if k in original})
        new.check_geometry()  # the targets against the run's own width and heads
    except (ValueError, TypeError) as err:
        raise UsageError(f"--from {path}: {err} (the run's d_model {original.get('d_model', cfg.d_model)}, n_heads "
                         f"{original.get('n_heads', cfg.n_heads)})") from None
    if _arch(new, len(vocab)) != replace(model.cfg, n_kv_heads=None):
        raise UsageError(f"--from {path}: the checkpoint's architecture does not match its results.json")
    if split_corpus(new)[0] != vocab:
        raise UsageError(f"--from {path}: the corpus does not give the checkpoint's characters "
                         f"(corpus {new.corpus or 'kjv'}, max_chars {new.max_chars})")
    return model, new, run_seed
