"""`multihead lab mla`: how small can MLA's latent be?

A small character-level language model learns a real corpus: the King James Bible
(public domain, shipped with multihead, see `multihead/data/KJV_PROVENANCE.md`) or any
UTF-8 text (`corpus=`). The same model is trained with

MHA, MLA at a sweep of kv_rank values, GQA and MQA, each one's bits per character set
against its KV-cache bytes per token; then the MHA model converted with `to_mla`.

Details: docs/lab.md, "How `lab mla` runs".
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from multihead.checkpoint import Vocab, save_lab_checkpoint
from multihead.checks import check_kv_heads, variant_name
from multihead.corpus import KJV, load_corpus  # noqa: F401  (KJV: lab mla's --corpus default)
from multihead.decoder import LabConfig, LabTransformer
from multihead.lab.configs import MLAConfig
from multihead.lab.devices import seed_everything
from multihead.lab.mla_report import plot_curves, plot_tradeoff, summarise_mla
from multihead.lab.plots import draw_plots
from multihead.lab.progress import Overall
from multihead.lab.results import finished_runs, start_run, write_json_atomic
from multihead.lab.training import StepCallback, diverged_entry, train

__all__ = ["MLAConfig", "load_corpus", "run_mla", "split_corpus", "val_bits_per_char", "windows"]

def _variants(cfg: MLAConfig) -> list[tuple[str, LabConfig]]:
    base = dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, mlp=True)
    out = [("MHA", base)]
    for hkv in cfg.kv_heads:
        check_kv_heads(cfg.n_heads, hkv, n_kv_heads_name="kv_heads")
        if hkv == cfg.n_heads:
            continue
        kind = variant_name(cfg.n_heads, hkv)
        out.append((f"GQA-{hkv}" if kind == "GQA" else kind, {**base, "n_kv_heads": hkv}))
    for r in cfg.ranks:
        out.append((f"MLA-{r}", {**base, "attention": "mla", "kv_rank": r}))
    return out


def cache_bytes_per_token(model: LabTransformer, dtype=torch.bfloat16) -> int:
    """Measured on the model's own caches: sum over layers of new_cache(1, 1).nbytes."""
    return sum(block.attn.new_cache(1, 1, dtype=dtype, device="cpu").nbytes for block in model.blocks)


@dataclass
class _Session:
    """What every training of one run shares: the data, the device, the callbacks, and the
    results being written (saved after each model, so an interrupted run keeps what it has)."""

    cfg: MLAConfig
    train_ids: torch.Tensor
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    dev: torch.device
    seed: int
    callback: StepCallback | None
    progress: bool
    out: Path
    res: dict
    t0: float
    overall: Overall

    def train(self, model, gen: torch.Generator, steps: int, *, lr: float, warmup: int, label: str,
              evaluate: bool = False) -> dict:
        return train(
            model, lambda step: _batch(self.train_ids, self.cfg, gen, self.dev), steps, lr=lr, warmup=warmup,
            name=self.overall.next_label(label), callback=self.callback, progress=self.progress,
            evaluate=(lambda step: {"val_bpc": self.val_bpc(model)}) if evaluate else None,
            eval_every=self.cfg.eval_every if evaluate else 0, overall=self.overall,
        )

    def val_bpc(self, model) -> float:
        return val_bits_per_char(model, self.val_batches, self.dev)

    def save(self) -> None:
        self.res["elapsed_s"] = time.perf_counter() - self.t0
        write_json_atomic(self.out / "results.json", self.res)


def run_mla(cfg: MLAConfig | None = None, out_dir: str | Path = "lab-mla", *, seed: int = 0, device: str = "auto",
            callback: StepCallback | None = None, progress: bool = True) -> dict:
    """Run the experiment; write results.json, plots and checkpoints to `out_dir`."""
    cfg = cfg or MLAConfig()
    vocab, corpus, train_ids, val_ids = split_corpus(cfg)
    dev, out, res, t0 = start_run("mla", cfg, out_dir, seed, device)
    res["results"] = {"corpus": corpus, "runs": [], "conversions": []}
    gen_val = torch.Generator().manual_seed(1_000_003 + seed)
    val_batches = [windows(val_ids, cfg.batch_size, cfg.context, gen_val) for _ in range(cfg.eval_batches)]
    variants = _variants(cfg)
    n_conv = sum(r <= cfg.d_model for r in cfg.ranks)
    overall = Overall(len(variants) + n_conv, len(variants) * cfg.steps + n_conv * cfg.finetune_steps)
    session = _Session(cfg, train_ids, val_batches, dev, seed, callback, progress, out, res, t0, overall)
    models: dict[str, LabTransformer] = {}
    try:
        for name, arch in variants:
            _train_variant(session, name, LabConfig(vocab_size=len(vocab.tokens), max_len=cfg.context, **arch),
                           models)
        if "MHA" in models:
            _conversions(session, models["MHA"])
    except KeyboardInterrupt:
        res["interrupted"] = True
    summarise_mla(cfg, res)
    runs = res["results"]["runs"]
    if "MHA" in models and not runs[0]["interrupted"]:
        _save_checkpoints(out, models, vocab, res)
    session.save()  # the numbers first: a plot that fails cannot lose them
    if finished_runs(runs):
        draw_plots(res, [lambda: plot_tradeoff(cfg, res, out / "mla.png"),
                         lambda: plot_curves(cfg, res, out / "curves.png")])
        write_json_atomic(out / "results.json", res)
    return res


def split_corpus(cfg) -> tuple[Vocab, dict, torch.Tensor, torch.Tensor]:
    """(vocab, corpus description, train ids, validation ids): the last val_fraction is held out.
    `cfg` carries corpus, max_chars, val_fraction and context (`MLAConfig`, `UptrainConfig`)."""
    from multihead.errors import UsageError

    text, corpus_name = load_corpus(cfg.corpus, cfg.max_chars)
    chars = sorted(set(text))
    vocab = Vocab("char", tuple(chars))
    ids = torch.tensor(vocab.encode(text), dtype=torch.int32 if len(chars) > 255 else torch.uint8)
    n_val = int(len(ids) * cfg.val_fraction)
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    if len(val_ids) <= cfg.context + 1 or len(train_ids) <= cfg.context + 1:
        raise UsageError(f"corpus too short: {len(ids):,} characters for context {cfg.context}; "
                         f"give at least {20 * (cfg.context + 1):,}")
    corpus = {"name": corpus_name, "characters": len(ids), "vocab_size": len(chars),
              "train_characters": len(train_ids), "val_characters": len(val_ids)}
    return vocab, corpus, train_ids, val_ids


def _train_variant(s: _Session, name: str, lab_cfg: LabConfig, models: dict[str, LabTransformer]) -> None:
    """Train one variant from scratch, record it in results "runs" (or "diverged"), keep the model
    in `models` if it did not diverge; raise KeyboardInterrupt if training was interrupted."""
    cfg, res = s.cfg, s.res
    gen = seed_everything(s.seed)
    model = LabTransformer(lab_cfg).to(s.dev)
    hist = s.train(model, gen, cfg.steps, lr=cfg.lr, warmup=cfg.warmup, label=f"mla {name:<7}", evaluate=True)
    entry = diverged_entry(name, hist)
    if entry is not None:
        res["diverged"].append(entry)
    else:
        models[name] = model
    res["results"]["runs"].append({
        "name": name, "kind": lab_cfg.kind, "n_kv_heads": lab_cfg.n_kv_heads,
        "kv_rank": lab_cfg.kv_rank,
        "params": model.n_params(), "attention_params": sum(
            p.numel() for b in model.blocks for p in b.attn.parameters()),
        "cache_values_per_token_per_layer": lab_cfg.cache_values_per_token,
        "cache_bytes_per_token": cache_bytes_per_token(model),
        "val_bpc": hist["evals"][-1]["val_bpc"] if entry is None else None,
        "train_loss_final": hist["loss"][-1] if hist["loss"] else None,
        "evals": hist["evals"], "steps": hist["steps"], "loss": hist["loss"], "steps_done": hist["steps_done"],
        "interrupted": hist["interrupted"], "diverged_at": hist["diverged_at"], "seconds": hist["seconds"],
        "tokens_per_s": hist["tokens_per_s"],
    })
    s.save()
    if hist["interrupted"]:
        raise KeyboardInterrupt


def _save_checkpoints(out: Path, models: dict[str, LabTransformer], vocab: Vocab, res: dict) -> None:
    """The MHA baseline in model/, and the smallest MLA within tolerance in model-mla/ when there is one."""
    save_lab_checkpoint(out / "model", models["MHA"], vocab, experiment="mla", extra={"variant": "MHA"})
    res["checkpoint"] = "model"
    pick = res["results"].get("smallest_rank_within_tolerance")
    if pick is not None and f"MLA-{pick}" in models:
        save_lab_checkpoint(out / "model-mla", models[f"MLA-{pick}"], vocab, experiment="mla",
                            extra={"variant": f"MLA-{pick}"})
        res["results"]["mla_checkpoint"] = "model-mla"


def windows(ids: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of context + 1 characters: (inputs, next characters)."""
    starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=gen)
    rows = torch.stack([ids[s: s + context + 1] for s in starts.tolist()]).long()  # (B, context + 1)
    return rows[:, :-1], rows[:, 1:]


def val_bits_per_char(model: torch.nn.Module, batches, device) -> float:
    """Mean next-character cross-entropy over (inputs, targets) batches, in bits per character."""
    model.eval()
    with torch.no_grad():
        nats = [float(torch.nn.functional.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten()))
                for x, y in batches]
    return sum(nats) / len(nats) / math.log(2)


def _batch(ids, cfg: MLAConfig, gen, dev):
    x, y = windows(ids, cfg.batch_size, cfg.context, gen)
    return x.to(dev), y.to(dev), None


def convert_model(model: LabTransformer, kv_rank: int) -> tuple[LabTransformer, list[float]]:
    """A copy of an MHA lab model with every attention layer replaced by `to_mla(attn, kv_rank)`;
    also each layer's relative K/V reconstruction error."""
    from multihead.convert import to_mla

    bias = model.blocks[0].attn.q_proj.bias is not None
    new_cfg = replace(model.cfg, attention="mla", kv_rank=kv_rank, n_kv_heads=None, latent_norm=False, bias=bias)
    converted = LabTransformer(new_cfg).to(next(model.parameters()).device)
    converted.load_state_dict({k: v for k, v in model.state_dict().items() if ".attn." not in k}, strict=False)
    errors = []
    for src, dst in zip(model.blocks, converted.blocks):
        mla, report = to_mla(copy.deepcopy(src.attn), kv_rank, return_report=True)
        dst.attn = mla
        errors.append(report.error)
    return converted, errors


def _conversions(s: _Session, mha: LabTransformer) -> None:
    """Convert the trained MHA with to_mla at each rank, evaluate, fine-tune, evaluate again."""
    cfg, res = s.cfg, s.res
    max_rank = min(2 * cfg.d_model, cfg.d_model)  # rank of the stacked [W_k; W_v] (2HD x C)
    for r in cfg.ranks:
        if r > max_rank:
            continue
        model, errors = convert_model(mha, r)
        before = s.val_bpc(model)
        gen = seed_everything(s.seed + 7919 * r)
        hist = s.train(model, gen, cfg.finetune_steps, lr=cfg.finetune_lr, warmup=0,
                       label=f"mla to_mla R={r:<3d} fine-tune")
        entry = diverged_entry(f"MLA-{r} converted", hist)
        if entry is not None:
            res["diverged"].append(entry)
            continue
        after = s.val_bpc(model)
        res["results"]["conversions"].append({
            "kv_rank": r, "kv_reconstruction_error": errors, "val_bpc_converted": before,
            "val_bpc_finetuned": after, "finetune_steps": hist["steps_done"], "interrupted": hist["interrupted"],
            "cache_bytes_per_token": cache_bytes_per_token(model),
        })
        s.save()
        if hist["interrupted"]:
            raise KeyboardInterrupt
