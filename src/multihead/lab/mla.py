"""`multihead lab mla`: how small can MLA's latent be?

A small character-level language model learns a real corpus: the King James Bible
(public domain, shipped with multihead, see `multihead/data/KJV_PROVENANCE.md`) or any
UTF-8 text (`corpus=`). The same model is trained with

- MHA (the baseline), caching 2 * H * D values per token per layer;
- MLA (`multihead.LatentAttention`) at a sweep of kv_rank values, caching R;
- GQA and MQA with caches of the same sizes as some of the ranks;

and each one's validation bits per character is set against its KV-cache bytes per
token. The report names the smallest rank whose cache is below 1/8 of MHA's while its
log2-perplexity (= bits per character) stays within `tolerance` bits of MHA's (1 bit by
default, as the classic exercise has it). Finally the trained MHA model is converted
layer by layer with `multihead.convert.to_mla` (truncated SVD of the stacked K/V
projections) at each rank and evaluated as converted and after a short fine-tune.

Writes results.json, mla.png (bits/char vs cache), curves.png (validation during
training), model/ (the MHA baseline's checkpoint) and model-mla/ (the checkpoint of the
MLA model trained at the smallest rank within tolerance, when one is; results.json
"mla_checkpoint" names it): `multihead inspect --model OUT/model-mla` opens it.

A model whose training diverges is listed in results.json "diverged" and left out of
the comparison; the others go on.
"""

from __future__ import annotations

import copy
import lzma
import math
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import torch

from multihead._checks import variant_name
from multihead.lab.checkpoint import Vocab, save_lab_checkpoint
from multihead.lab.configs import MLAConfig
from multihead.lab.devices import resolve_device, seed_everything
from multihead.lab.models import LabConfig, LabTransformer
from multihead.lab.plots import draw_plots, pyplot, save_figure
from multihead.lab.progress import Overall
from multihead.lab.results import new_results, write_json_atomic
from multihead.lab.training import StepCallback, diverged_entry, train

__all__ = ["MLAConfig", "load_corpus", "run_mla"]

KJV = "kjv"


def load_corpus(path: str | None = None, max_chars: int | None = None) -> tuple[str, str]:
    """(text, name): the shipped King James Bible, or a UTF-8 file."""
    if path is None or path == KJV:
        data = resources.files("multihead").joinpath("data/kjv.txt.xz").read_bytes()
        text, name = lzma.decompress(data).decode("utf-8"), "King James Bible (multihead/data/kjv.txt.xz)"
    else:
        try:
            if Path(path).exists() and not Path(path).is_file():  # /dev/zero would be read forever
                raise ValueError(f"corpus {path} is not a regular file; give a UTF-8 text file")
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"corpus {path} is not UTF-8 text ({err})") from None
        except OSError as err:
            raise ValueError(f"cannot read corpus {path}: {err}") from None
        name = str(path)
    if max_chars is not None:
        text = text[:max_chars]
    return text, name


def _variants(cfg: MLAConfig) -> list[tuple[str, LabConfig]]:
    base = dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, mlp=True)
    out = [("MHA", base)]
    for hkv in cfg.kv_heads:
        if cfg.n_heads % hkv:
            raise ValueError(f"kv_heads {hkv} does not divide n_heads {cfg.n_heads}")
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
        model.eval()
        with torch.no_grad():
            nats = [float(torch.nn.functional.cross_entropy(model(x.to(self.dev)).flatten(0, 1),
                                                             y.to(self.dev).flatten()))
                    for x, y in self.val_batches]
        return sum(nats) / len(nats) / math.log(2)

    def save(self) -> None:
        self.res["elapsed_s"] = time.perf_counter() - self.t0
        write_json_atomic(self.out / "results.json", self.res)


def run_mla(cfg: MLAConfig | None = None, out_dir: str | Path = "lab-mla", *, seed: int = 0, device: str = "auto",
            callback: StepCallback | None = None, progress: bool = True) -> dict:
    """Run the experiment; write results.json, plots and checkpoints to `out_dir`."""
    cfg = cfg or MLAConfig()
    dev = resolve_device(device)
    vocab, corpus, train_ids, val_ids = _split_corpus(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = new_results("mla", cfg, seed, dev)
    t0 = time.perf_counter()
    res["results"] = {"corpus": corpus, "runs": [], "conversions": []}
    gen_val = torch.Generator().manual_seed(1_000_003 + seed)
    val_batches = [_windows(val_ids, cfg.batch_size, cfg.context, gen_val) for _ in range(cfg.eval_batches)]
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
    _summarise(cfg, res)
    runs = res["results"]["runs"]
    if "MHA" in models and not runs[0]["interrupted"]:
        _save_checkpoints(out, models, vocab, res)
    session.save()  # the numbers first: a plot that fails cannot lose them
    if _finished(runs):
        draw_plots(res, [lambda: _plot_tradeoff(cfg, res, out / "mla.png"),
                         lambda: _plot_curves(cfg, res, out / "curves.png")])
        write_json_atomic(out / "results.json", res)
    return res


def _split_corpus(cfg: MLAConfig) -> tuple[Vocab, dict, torch.Tensor, torch.Tensor]:
    """(vocab, corpus description, train ids, validation ids): the last val_fraction is held out."""
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


def _finished(runs: list[dict]) -> list[dict]:
    """The models that trained to the end: neither interrupted nor diverged."""
    return [x for x in runs if not x["interrupted"] and x.get("diverged_at") is None]


def _windows(ids: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=gen)
    rows = torch.stack([ids[s: s + context + 1] for s in starts.tolist()]).long()  # (B, context + 1)
    return rows[:, :-1], rows[:, 1:]


def _batch(ids, cfg: MLAConfig, gen, dev):
    x, y = _windows(ids, cfg.batch_size, cfg.context, gen)
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


def _summarise(cfg: MLAConfig, res: dict) -> None:
    r = res["results"]
    runs = _finished(r["runs"])
    mha = next((x for x in runs if x["kind"] == "MHA"), None)
    r["smallest_rank_within_tolerance"] = None
    if mha is None:
        r["summary"] = "The MHA baseline did not finish, so nothing is compared."
        r["table"] = ""
        return
    limit_bytes = mha["cache_bytes_per_token"] * cfg.budget
    limit_bpc = mha["val_bpc"] + cfg.tolerance
    for x in runs:
        x["cache_vs_mha"] = x["cache_bytes_per_token"] / mha["cache_bytes_per_token"]
        x["bpc_vs_mha"] = x["val_bpc"] - mha["val_bpc"]
        x["under_budget"] = x["cache_bytes_per_token"] < limit_bytes
        x["within_tolerance"] = x["val_bpc"] <= limit_bpc
    for c in r["conversions"]:
        c["cache_vs_mha"] = c["cache_bytes_per_token"] / mha["cache_bytes_per_token"]
        c["within_tolerance_converted"] = c["val_bpc_converted"] <= limit_bpc
        c["within_tolerance_finetuned"] = c["val_bpc_finetuned"] <= limit_bpc
    mla = sorted((x for x in runs if x["kind"] == "MLA"), key=lambda x: x["kv_rank"])
    ok = [x for x in mla if x["under_budget"] and x["within_tolerance"]]
    r["smallest_rank_within_tolerance"] = ok[0]["kv_rank"] if ok else None
    conv_ok = [c for c in sorted(r["conversions"], key=lambda c: c["kv_rank"])
               if c["cache_bytes_per_token"] < limit_bytes and c["within_tolerance_finetuned"]]
    r["smallest_converted_rank_within_tolerance"] = conv_ok[0]["kv_rank"] if conv_ok else None
    r["mha_val_bpc"] = mha["val_bpc"]
    r["mha_cache_bytes_per_token"] = mha["cache_bytes_per_token"]
    r["budget_bytes_per_token"] = limit_bytes
    r["table"] = _table(cfg, runs, r["conversions"])
    r["summary"] = _summary_text(cfg, r, mha, mla, runs)


def _table(cfg, runs, conversions) -> str:
    head = f"{'model':<8}  {'cache B/token':>13}  {'vs MHA':>6}  {'val bits/char':>13}  {'vs MHA':>7}  {'params':>8}"
    lines = ["trained from scratch (cache: bf16, all layers)", head, "-" * len(head)]
    for x in runs:
        lines.append(f"{x['name']:<8}  {x['cache_bytes_per_token']:>13,}  {x['cache_vs_mha']:>6.3f}  "
                     f"{x['val_bpc']:>13.3f}  {x['bpc_vs_mha']:>+7.3f}  {x['params']:>8,}")
    if conversions:
        lines += ["", "MHA converted with multihead.convert.to_mla",
                  f"{'kv_rank':>7}  {'K/V error':>9}  {'bits/char converted':>19}  "
                  f"{f'after {cfg.finetune_steps} steps':>16}"]
        for c in conversions:
            err = sum(c["kv_reconstruction_error"]) / len(c["kv_reconstruction_error"])
            lines.append(f"{c['kv_rank']:>7}  {err:>9.3f}  {c['val_bpc_converted']:>19.3f}  "
                         f"{c['val_bpc_finetuned']:>16.3f}")
    return "\n".join(lines)


def _summary_text(cfg, r, mha, mla, runs) -> str:
    frac = f"1/{round(1 / cfg.budget)}" if abs(1 / cfg.budget - round(1 / cfg.budget)) < 1e-9 else f"{cfg.budget:g}"
    parts = [f"MHA reaches {mha['val_bpc']:.3f} bits/char on held-out text with "
             f"{mha['cache_bytes_per_token']:,} cache bytes per token (bf16, {_layers(cfg)})."]
    pick = r["smallest_rank_within_tolerance"]
    if pick is not None:
        x = next(m for m in mla if m["kv_rank"] == pick)
        parts.append(f"The smallest MLA rank with a cache below {frac} of MHA's and bits/char within "
                     f"{cfg.tolerance:g} of MHA is kv_rank = {pick}: {x['cache_bytes_per_token']:,} bytes per token "
                     f"({x['cache_vs_mha']:.3f} of MHA) at {x['val_bpc']:.3f} bits/char ({x['bpc_vs_mha']:+.3f}).")
    else:
        under = [m for m in mla if m["under_budget"]]
        parts.append(f"No MLA rank tried has both a cache below {frac} of MHA's and bits/char within "
                     f"{cfg.tolerance:g} of MHA" + (f" (ranks under the budget: "
                                                    f"{', '.join(str(m['kv_rank']) for m in under)})." if under
                                                    else "; no rank tried is under the budget."))
    if mla:
        best = min(mla, key=lambda m: m["val_bpc"])
        parts.append(f"The best MLA rank is {best['kv_rank']} at {best['val_bpc']:.3f} bits/char "
                     f"({best['bpc_vs_mha']:+.3f} against MHA).")
    for x in runs:
        if x["kind"] in ("GQA", "MQA"):
            same = [m for m in mla if m["cache_bytes_per_token"] == x["cache_bytes_per_token"]]
            if same:
                m = same[0]
                better = "MLA" if m["val_bpc"] < x["val_bpc"] else x["name"]
                parts.append(f"At the same cache ({x['cache_bytes_per_token']:,} B/token) {x['name']} gives "
                             f"{x['val_bpc']:.3f} and MLA-{m['kv_rank']} {m['val_bpc']:.3f} bits/char: {better} "
                             "is better.")
    conv = r["conversions"]
    if conv:
        worst = max(conv, key=lambda c: c["val_bpc_converted"] - mha["val_bpc"])
        parts.append(f"Converting the trained MHA with to_mla costs up to "
                     f"{worst['val_bpc_converted'] - mha['val_bpc']:+.3f} bits/char (kv_rank {worst['kv_rank']}) "
                     f"before fine-tuning and {worst['val_bpc_finetuned'] - mha['val_bpc']:+.3f} after "
                     f"{cfg.finetune_steps} steps.")
        best_c = min(conv, key=lambda c: c["val_bpc_finetuned"])
        if best_c["val_bpc_finetuned"] < mha["val_bpc"]:
            parts.append(f"Converted kv_rank {best_c['kv_rank']} ends below MHA ({best_c['val_bpc_finetuned']:.3f}), "
                         f"but it has trained {cfg.steps + cfg.finetune_steps} steps in all against MHA's "
                         f"{cfg.steps}: MHA was still improving when it stopped.")
        if r["smallest_converted_rank_within_tolerance"] is not None:
            parts.append(f"Converted and fine-tuned, kv_rank {r['smallest_converted_rank_within_tolerance']} is the "
                         f"smallest under the cache budget within tolerance.")
    return " ".join(parts)


def _layers(cfg: MLAConfig) -> str:
    return f"{cfg.n_layers} layer{'s' if cfg.n_layers > 1 else ''}"


def _plot_tradeoff(cfg: MLAConfig, res: dict, path: Path) -> str:
    plt = pyplot()
    r = res["results"]
    runs = _finished(r["runs"])
    mha = next((x for x in runs if x["kind"] == "MHA"), None)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    mla = sorted((x for x in runs if x["kind"] == "MLA"), key=lambda x: x["kv_rank"])
    if mla:
        ax.plot([x["cache_bytes_per_token"] for x in mla], [x["val_bpc"] for x in mla], "o-", color="#8172b2",
                lw=2, label="MLA, trained")
        for x in mla:
            ax.annotate(f"R={x['kv_rank']}", (x["cache_bytes_per_token"], x["val_bpc"]), textcoords="offset points",
                        xytext=(4, 6), fontsize=8, color="#8172b2")
    conv = sorted(r["conversions"], key=lambda c: c["kv_rank"])
    if conv:
        xs = [c["cache_bytes_per_token"] for c in conv]
        ax.plot(xs, [c["val_bpc_converted"] for c in conv], "x:", color="grey", label="MHA -> to_mla, converted")
        ax.plot(xs, [c["val_bpc_finetuned"] for c in conv], "s--", color="#dd8452", mfc="none",
                label=f"MHA -> to_mla, +{cfg.finetune_steps} fine-tune steps")
    markers = {"MHA": ("*", "#4c72b0", 14), "GQA": ("D", "#55a868", 8), "MQA": ("^", "#c44e52", 9)}
    for x in runs:
        if x["kind"] in markers:
            m, c, s = markers[x["kind"]]
            ax.plot(x["cache_bytes_per_token"], x["val_bpc"], m, color=c, ms=s, ls="none", label=x["name"])
    ys = [x["val_bpc"] for x in runs] + [v for c in conv for v in (c["val_bpc_converted"], c["val_bpc_finetuned"])]
    pad = 0.08 * (max(ys) - min(ys)) + 0.02
    ax.set_ylim(min(ys) - pad, max(ys) + 3 * pad)  # from the data: the tolerance band may reach far above
    if mha is not None:
        budget = mha["cache_bytes_per_token"] * cfg.budget
        ax.axvline(budget, color="black", lw=1, ls="--")
        ax.text(budget, ax.get_ylim()[1], f" {cfg.budget:.3g} of MHA's cache", va="top", fontsize=8)
        top = mha["val_bpc"] + cfg.tolerance
        ax.axhspan(mha["val_bpc"], top, color="#4c72b0", alpha=0.08,
                   label=f"within {cfg.tolerance:g} bit of MHA" + ("" if top < ax.get_ylim()[1] else
                                                                  f" (up to {top:.2f})"))
        ax.set_ylim(min(ys) - pad, max(ys) + 3 * pad)
        pick = r.get("smallest_rank_within_tolerance")
        if pick is not None:
            x = next(m for m in mla if m["kv_rank"] == pick)
            ax.plot(x["cache_bytes_per_token"], x["val_bpc"], "o", ms=16, mfc="none", mec="black", mew=1.5,
                    label=f"smallest rank within tolerance (R={pick})")
    ax.set_xscale("log", base=2)
    ticks = sorted({x["cache_bytes_per_token"] for x in runs})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("KV cache bytes per token (bf16, all layers, log scale)")
    ax.set_ylabel("validation bits per character")
    ax.set_title(f"{r['corpus']['name'].split(' (')[0]}: character LM, {_layers(cfg)}, d_model {cfg.d_model}, "
                 f"{cfg.n_heads} heads, {cfg.steps} steps", fontsize=10)
    ax.legend(frameon=False, fontsize=8, loc="upper right")
    return save_figure(fig, path)


def _plot_curves(cfg: MLAConfig, res: dict, path: Path) -> str:
    plt = pyplot()
    runs = _finished(res["results"]["runs"])
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    cmap = plt.get_cmap("plasma")
    mla = [x for x in runs if x["kind"] == "MLA"]
    for x in runs:
        steps = [e["step"] for e in x["evals"]]
        vals = [e["val_bpc"] for e in x["evals"]]
        if x["kind"] == "MLA":
            k = mla.index(x)
            ax.plot(steps, vals, color=cmap(0.15 + 0.7 * k / max(1, len(mla) - 1)), lw=1.5, label=x["name"])
        else:
            style = {"MHA": ("#4c72b0", "-"), "GQA": ("#55a868", "--"), "MQA": ("#c44e52", ":")}[x["kind"]]
            ax.plot(steps, vals, color=style[0], ls=style[1], lw=2.2, label=x["name"])
    ax.set_xlabel("training step")
    ax.set_ylabel("validation bits per character")
    # every point shows, the untrained step-0 value included (the first segment is not clipped)
    vals = [e["val_bpc"] for x in runs for e in x["evals"]]
    pad = 0.04 * (max(vals) - min(vals)) + 0.02
    ax.set_ylim(min(vals) - pad, max(vals) + pad)
    ax.set_title("Validation bits/char during training", fontsize=10)
    ax.legend(frameon=False, fontsize=8, ncol=2)
    return save_figure(fig, path)

