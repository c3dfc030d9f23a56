"""`multihead heads importance`: Michel et al. (2019) head importance, and the pruning curve.

Head importance |dloss/dxi| summed over batches, normalized per layer, on a task: for
encoders such as the bundled MiniLM, verse-half retrieval on the bundled King James Bible;
for causal models, next-token loss. With --prune-curve, the task's score as heads are
removed 10% at a time (a grouped-query transformers decoder such as SmolLM2: held-out KJV
perplexity, in whole KV groups and by query heads, by importance and in random orders;
`multihead.heads.prune_curve`). See docs/heads.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from multihead.cli_args import add_json, add_model, add_out, add_threads
from multihead.errors import UsageError
from multihead.files import output_file
from multihead.heads.cli_common import check_count
from multihead.interop.loaders import model_source

HELD_OUT = 256  # verses the task's score is measured on (not the ones importance is computed on)
STRIDE = 37  # every 37th verse: 320 verses spread over the KJV's 30,687 of 8+ words


def add_importance_arguments(subparsers) -> argparse.ArgumentParser:
    """Add the `importance` subcommand to `multihead heads`' subparsers; returns its parser."""
    i = subparsers.add_parser("importance", help="Michel et al. (2019) head importance, and the pruning curve",
                       allow_abbrev=False,
                       description="Head importance |dloss/dxi| summed over batches (Michel et al. 2019), "
                                   "normalized per layer.")
    add_model(i, "minilm")
    i.add_argument("--text", action="append", help="a text to score on (repeatable; default: the bundled KJV)")
    i.add_argument("--corpus", metavar="FILE", help="a UTF-8 text file: its lines of 8+ words are the batches")
    i.add_argument("--batches", type=int, default=4, help="batches of --batch-size verses (default 4)")
    i.add_argument("--batch-size", type=int, default=16, help="verses per batch (default 16)")
    i.add_argument("--prune-curve", action="store_true",
                   help="also measure the task as heads are removed 10%% at a time, least important first (a "
                        "grouped-query decoder such as smollm2: held-out KJV perplexity, 0-50%% of the heads in whole "
                        "KV groups and by query heads, by importance and in 3 random orders; see "
                        "docs/heads/prune-curve-smollm2)")
    i.add_argument("--png", metavar="PATH", help="with --prune-curve: write the curve as a plot")
    add_out(i, "with --prune-curve on a grouped-query decoder: write results.json and curve.png in this folder")
    add_json(i)
    add_threads(i)
    return i


def _task(loaded, model, args):
    """(batches, loss(model, batch), score(model) -> float, what the score is)."""
    import torch

    from multihead.heads import tasks

    n = args.batches * args.batch_size
    if args.text:
        texts = [t for t in args.text if t.strip()]
        if not texts:
            raise UsageError("--text is empty; give a sentence")
    else:
        texts = tasks.kjv_verses(n + HELD_OUT, path=args.corpus, stride=STRIDE)
    if not getattr(loaded, "causal", False):
        if len(texts) < 2:
            raise UsageError("the retrieval task needs at least 2 texts")
        train, held = (texts[:n], texts[n:n + HELD_OUT]) if len(texts) > n + 8 else (texts, texts)
        batches = [train[i:i + args.batch_size] for i in range(0, len(train), args.batch_size)]
        batches = [b for b in batches if len(b) >= 2]
        tok = loaded.word_tokenizer("the retrieval task")
        return (batches, lambda m, b: tasks.contrastive_loss(m, tok, b),
                lambda m: tasks.retrieval_accuracy(m, tok, held), "verse-half retrieval top-1 accuracy")
    seqs = [loaded.input_ids(loaded.inputs(t)) for t in texts]
    limit = getattr(loaded, "max_positions", None) or 512
    seqs = [s[:, :limit] for s in seqs if s.shape[1] >= 2]
    train, held = (seqs[:n], seqs[n:n + HELD_OUT]) if len(seqs) > n + 8 else (seqs, seqs)

    def run(m, ids):
        return tasks.logits(m, m(ids))

    def score(m):
        with torch.no_grad():
            hits = [(run(m, s)[0, :-1].argmax(-1) == s[0, 1:]).float().mean().item() for s in held]
        return sum(hits) / len(hits)
    return train, lambda m, s: tasks.next_token_loss(run(m, s), s), score, "next-token top-1 accuracy"


def _importance(args) -> dict:
    from multihead import heads

    check_count("--batches", args.batches, 1)
    check_count("--batch-size", args.batch_size, 2)
    from multihead.interop.loaders import load_model  # it sets the hub offline for the load only

    loaded = load_model(args.model)
    model = loaded.model
    if args.prune_curve and _grouped_decoder(loaded, model):
        return _lm_curve(args, loaded, model)
    if args.out:
        raise UsageError("--out writes the perplexity pruning curve of a grouped-query decoder (--model smollm2 "
                         "--prune-curve); for this model use --png and --json")
    batches, loss, score, what = _task(loaded, model, args)
    imp = heads.importance(model, batches, loss)
    result = {"model": getattr(loaded, "name", args.model), "task": what,
              "importance": [[round(x, 6) for x in row.tolist()] for row in imp]}
    if args.prune_curve:
        result["curve"] = prune_curve(model, batches, loss, score)
    return result


def _grouped_decoder(loaded, model) -> bool:
    """A transformers causal LM (its config) with q/k/v/o projections and a head_dim: the
    perplexity curve's models."""
    from multihead.heads._prune import hf_attention_modules

    cfg = getattr(model, "config", None)
    return (cfg is not None and loaded.why_not_lm() is None and isinstance(getattr(cfg, "head_dim", None), int)
            and bool(hf_attention_modules(model)))


def _lm_curve(args, loaded, model) -> dict:
    import sys

    from multihead.files import write_json
    from multihead.heads.prune_curve import prune_curve_lm

    if args.text or args.corpus:
        raise UsageError("--prune-curve on a grouped-query decoder measures held-out KJV perplexity (importance on "
                         "Genesis to Acts, perplexity on Romans to Revelation); --text and --corpus are not used "
                         "there: leave them out")
    out = None
    if args.out:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {args.out!r} is a file; give a folder")
        out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    r = prune_curve_lm(model, loaded.tokenizer, say=lambda m: print(m, file=sys.stderr, flush=True))
    r = {"model": getattr(loaded, "name", args.model), "task": r["metric"], "date": time.strftime("%Y-%m-%d %H:%M"),
         "load_average": [load, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
         "threads": __import__("torch").get_num_threads(), **r}
    if out is not None:
        from multihead.heads.prune_curve import plot_curves

        write_json(out / "results.json", r)
        plot_curves(r, out / "curve.png", f"{r['model']}: heads removed, held-out perplexity")
        r["out"] = str(out)
    return r


def prune_curve(model, batches, loss, score, step: float = 0.1) -> list[dict]:
    """Michel et al.'s figure: remove the least important heads 10% at a time (importance
    re-estimated with the removed heads ablated), measuring `score(model)` each time."""
    import math

    from multihead import heads

    imp = heads.importance(model, batches, loss)
    alive = [(i, h) for i in range(imp.shape[0]) for h in range(imp.shape[1]) if not math.isnan(imp[i, h])]
    total = len(alive)
    removed: list[tuple[int, int]] = []
    curve = [{"removed_fraction": 0.0, "removed": 0, "score": score(model)}]
    for k in range(1, int(round(1 / step))):
        target = int(round(k * step * total))
        with heads.ablate(model, removed):
            imp = heads.importance(model, batches, loss)
        ranked = sorted(((imp[i, h].item(), (i, h)) for i, h in alive if (i, h) not in removed))
        per_layer = {}
        for i, h in alive:
            per_layer[i] = per_layer.get(i, 0) + ((i, h) not in removed)
        for _, (i, h) in ranked:
            if len(removed) >= target:
                break
            if per_layer[i] > 1:  # keep one head per layer
                removed.append((i, h))
                per_layer[i] -= 1
        with heads.ablate(model, removed):
            curve.append({"removed_fraction": len(removed) / total, "removed": len(removed), "score": score(model)})
    return curve


def _curve_png(path: Path, curve: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from multihead.files import atomic_path

    fig = Figure(figsize=(5, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([100 * c["removed_fraction"] for c in curve], [c["score"] for c in curve], marker="o")
    ax.set_xlabel("heads removed (%)")
    ax.set_ylabel("score")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")


def _print_lm_curve(r: dict) -> None:
    print(f"{r['model']}: {r['task']}; {r['base_ppl']:.2f} with every head")
    print("removed  " + "  ".join(f"{u + ' by importance':>20}  {u + ' random (median)':>22}" for u in r["curves"]))
    for k, f in enumerate(r["fractions"]):
        cells = [f"{c['importance'][k]['val_ppl']:>20.2f}  {c['random'][k]['val_ppl_median']:>22.2f}"
                 for c in r["curves"].values()]
        print(f"{100 * f:>6.0f}%  " + "  ".join(cells))
    if "out" in r:
        print(f"wrote {r['out']}/results.json and curve.png")


def _print_importance(r: dict) -> None:
    if "curves" in r:
        _print_lm_curve(r)
        return
    print(f"{r['model']}: head importance (Michel et al. 2019, per-layer L2-normalized) on {r['task']}")
    n = max(len(row) for row in r["importance"])
    print("layer " + "".join(f"{h:>7}" for h in range(n)))
    for i, row in enumerate(r["importance"]):
        print(f"{i:>5} " + "".join(f"{x:>7.3f}" for x in row))
    if "curve" in r:
        print(f"pruning curve ({r['task']}):")
        print("removed  score")
        for c in r["curve"]:
            print(f"{100 * c['removed_fraction']:>6.0f}%  {c['score']:.4f}")


def run_importance(args) -> int:
    """Run `multihead heads importance` from parsed arguments; 0 on success (mistakes raise UsageError)."""
    png = output_file("--png", args.png, "curve.png", source=model_source(args.model))
    if png and not args.prune_curve:
        raise UsageError("--png draws the pruning curve; add --prune-curve")
    r = _importance(args)
    if png and "curves" in r:
        from multihead.heads.prune_curve import plot_curves

        plot_curves(r, png, f"{r['model']}: heads removed, held-out perplexity")
        r["png"] = str(png)
    elif png:
        _curve_png(png, r["curve"], f"{r['model']}: {r['task']}")
        r["png"] = str(png)
    print(json.dumps(r, indent=1)) if args.json else _print_importance(r)
    return 0
