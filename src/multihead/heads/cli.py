"""Which heads a model needs: activation patching, importance and pruning of its heads.

scan: patch each head from a clean text into a corrupted one (activation patching) and
print the logit difference of --answer over --wrong at the last token, per layer x head.
importance: Michel et al. (2019) head importance on a task (the bundled MiniLM and other
encoders: verse-half retrieval on the bundled King James Bible, a contrastive loss;
causal models: next-token loss), and with --prune-curve the task's score as heads are
removed 10% at a time, least important first. prune: remove heads and save the model
(where its format can hold fewer heads). See docs/heads.md.

examples:
  multihead heads scan --clean "When Mary and John went to the store, John gave a drink to" \\
      --corrupted "When Mary and John went to the store, Mary gave a drink to" --answer Mary --wrong John
  multihead heads importance --prune-curve --png curve.png
  multihead heads prune --model path/to/llama --remove 0.1,0.5,1.1,1.5 --out pruned/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from multihead._files import output_file
from multihead.errors import UsageError

TOP = 10
HELD_OUT = 256  # verses the task's score is measured on (not the ones importance is computed on)
STRIDE = 37  # every 37th verse: 320 verses spread over the KJV's 30,687 of 8+ words


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="heads_command", metavar="{scan,importance,prune}")
    sub.required = True
    model_help = ("minilm (the bundled sentence-transformers/all-MiniLM-L6-v2; default), a local Hugging Face "
                  "model folder, or a `multihead lab` checkpoint folder")

    s = sub.add_parser("scan", help="activation patching of every head (logit difference table)",
                       description="Patch each head from the clean run into the corrupted one, one at a time, and "
                                   "print the logit difference answer - wrong at the last token.")
    s.add_argument("--clean", required=True, help="the clean text")
    s.add_argument("--corrupted", required=True, help="the corrupted text (the same number of tokens)")
    s.add_argument("--answer", required=True, help="the token the clean text should predict (one token)")
    s.add_argument("--wrong", required=True, help="the token the corrupted text points to (one token)")
    s.add_argument("--model", default="minilm", help=model_help)
    s.add_argument("--what", choices=["z", "k", "v", "pattern"], default="z",
                   help="what to patch: head outputs z (default), keys, values (per key/value head) or patterns")
    s.add_argument("--png", metavar="PATH", help="write a heat map of the table")
    s.add_argument("--html", metavar="PATH", help="write the table as a self-contained HTML heat map")
    s.add_argument("--json", action="store_true", help="print JSON instead of tables")

    i = sub.add_parser("importance", help="Michel et al. (2019) head importance, and the pruning curve",
                       description="Head importance |dloss/dxi| summed over batches (Michel et al. 2019), "
                                   "normalized per layer.")
    i.add_argument("--model", default="minilm", help=model_help)
    i.add_argument("--text", action="append", help="a text to score on (repeatable; default: the bundled KJV)")
    i.add_argument("--corpus", metavar="FILE", help="a UTF-8 text file: its lines of 8+ words are the batches")
    i.add_argument("--batches", type=int, default=4, help="batches of --batch-size verses (default 4)")
    i.add_argument("--batch-size", type=int, default=16, help="verses per batch (default 16)")
    i.add_argument("--prune-curve", action="store_true",
                   help="also measure the task as heads are removed 10%% at a time, least important first")
    i.add_argument("--png", metavar="PATH", help="with --prune-curve: write the curve as a plot")
    i.add_argument("--json", action="store_true", help="print JSON instead of tables")

    p = sub.add_parser("prune", help="remove heads and save the model",
                       description="Remove heads physically and save_pretrained the result (transformers models "
                                   "whose config carries head_dim, with the same head count left in every layer).")
    p.add_argument("--model", default="minilm", help=model_help)
    p.add_argument("--remove", required=True, metavar="LIST",
                   help="heads to remove as layer.head, comma-separated, e.g. 0.1,0.5,1.1,1.5")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to save the pruned model in")


def _pairs(value: str) -> list[tuple[int, int]]:
    out = []
    for item in value.split(","):
        layer, dot, head = item.strip().partition(".")
        try:
            if not dot:
                raise ValueError
            out.append((int(layer), int(head)))
        except ValueError:
            raise UsageError(f"--remove takes layer.head pairs, comma-separated, e.g. --remove 0.1,2.3; received "
                             f"{value!r} ({item.strip()!r} is not layer.head)") from None
    return out


def _load(spec: str):
    from multihead.interop.loaders import load_model  # it sets the hub offline for the load only

    loaded = load_model(spec)
    model = loaded.model
    if hasattr(loaded, "tokenizer"):
        return loaded, model, "hf"
    return loaded, model, "lab"


def _encode(loaded, kind: str, text: str):
    import torch

    if kind == "hf":
        return loaded.tokenizer(text, return_tensors="pt")
    return torch.tensor([loaded.encode(text)])


def _one_token(loaded, kind: str, flag: str, token: str) -> int:
    if kind == "hf":
        tok = loaded.tokenizer
        for form in (token, " " + token, token.lower()):
            ids = tok(form, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                return ids[0]
        raise UsageError(f"{flag} {token!r} is {len(tok(token, add_special_tokens=False)['input_ids'])} tokens for "
                         "this model's tokenizer; give one token")
    ids = loaded.encode(token)
    if len(ids) != 1:
        raise UsageError(f"{flag} {token!r} is {len(ids)} tokens for this model; give one token")
    return ids[0]


def _last_real(loaded, kind: str, inputs) -> int:
    """The last position that is not a special token ([SEP], </s>): where the answer is read."""
    if kind != "hf":
        return inputs.shape[1] - 1
    ids = inputs["input_ids"][0].tolist()
    special = set(getattr(loaded.tokenizer, "all_special_ids", ()))
    real = [i for i, t in enumerate(ids) if t not in special]
    return real[-1] if real else len(ids) - 1


def _scan(args) -> dict:
    import torch

    from multihead import heads

    loaded, model, kind = _load(args.model)
    clean, corrupted = _encode(loaded, kind, args.clean), _encode(loaded, kind, args.corrupted)
    n_clean = (clean["input_ids"] if kind == "hf" else clean).shape[1]
    n_corr = (corrupted["input_ids"] if kind == "hf" else corrupted).shape[1]
    if n_clean != n_corr:
        raise UsageError(f"--clean is {n_clean} tokens and --corrupted {n_corr}; patching needs the same number "
                         "of tokens (change words for words of one token each)")
    ans, wrong = _one_token(loaded, kind, "--answer", args.answer), _one_token(loaded, kind, "--wrong", args.wrong)
    pos = _last_real(loaded, kind, clean)
    with torch.no_grad():
        out = model(**clean) if kind == "hf" else model(clean)
    if isinstance(out, torch.Tensor) or getattr(out, "logits", None) is not None:
        def metric(x):
            return (x[:, pos, ans] - x[:, pos, wrong]).mean()
    else:  # a base model: last hidden states read out through the tied input embeddings
        direction = (model.get_input_embeddings().weight[ans] - model.get_input_embeddings().weight[wrong]).detach()

        def metric(x):
            return (x[:, pos] @ direction).mean()
    from multihead.heads._engine import logits_of

    with torch.no_grad():
        m_clean = metric(logits_of(out)).item()
        m_corr = metric(logits_of(model(**corrupted) if kind == "hf" else model(corrupted))).item()
    table = heads.patch_scan(model, clean, corrupted, metric, what=args.what)
    span = m_clean - m_corr
    cells = [(layer, h, table[layer, h].item()) for layer in range(table.shape[0]) for h in range(table.shape[1])
             if not torch.isnan(table[layer, h])]
    cells.sort(key=lambda c: -abs(c[2] - m_corr))
    top = [{"layer": layer, "head": h, "value": v, "recovered": (v - m_corr) / span if span else None}
           for layer, h, v in cells[:TOP]]
    return {"model": getattr(loaded, "name", args.model), "what": args.what, "answer": args.answer,
            "wrong": args.wrong, "position": pos, "metric_clean": m_clean, "metric_corrupted": m_corr,
            "table": [[None if torch.isnan(x) else round(x.item(), 6) for x in row] for row in table], "top": top}


def _heat_png(path: Path, table: list[list], title: str, center: float) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from multihead._files import atomic_path

    a = np.array([[np.nan if x is None else x for x in row] for row in table], dtype=float) - center
    lim = float(np.nanmax(np.abs(a))) or 1.0
    fig = Figure(figsize=(1 + 0.45 * a.shape[1], 1 + 0.4 * a.shape[0]))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(a, cmap="RdBu", vmin=-lim, vmax=lim)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="metric - corrupted")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")


def _heat_html(path: Path, result: dict) -> None:
    from html import escape

    from multihead._files import write_text

    base = result["metric_corrupted"]
    vals = [abs(x - base) for row in result["table"] for x in row if x is not None]
    lim = max(vals) if vals and max(vals) > 0 else 1.0
    rows = []
    for i, row in enumerate(result["table"]):
        tds = []
        for x in row:
            if x is None:
                tds.append("<td></td>")
                continue
            t = (x - base) / lim
            color = f"rgba(178,24,43,{t:.3f})" if t > 0 else f"rgba(33,102,172,{-t:.3f})"
            tds.append(f'<td style="background:{color}">{x:.3f}</td>')
        rows.append(f"<tr><th>{i}</th>{''.join(tds)}</tr>")
    n = max(len(r) for r in result["table"])
    head = "".join(f"<th>{h}</th>" for h in range(n))
    doc = (f"<!doctype html><meta charset=utf-8><title>multihead heads scan</title>"
           f"<style>td,th{{padding:3px 6px;font:12px monospace;text-align:right}}</style>"
           f"<p>{escape(result['model'])}: patching {escape(result['what'])}, logit difference "
           f"{escape(result['answer'])} - {escape(result['wrong'])}; clean {result['metric_clean']:.3f}, "
           f"corrupted {base:.3f}</p><table><tr><th>layer \\ head</th>{head}</tr>{''.join(rows)}</table>")
    write_text(path, doc)


def _print_scan(r: dict) -> None:
    print(f"{r['model']}: patching {r['what']} from clean into corrupted; metric = logit({r['answer']}) - "
          f"logit({r['wrong']}) at token {r['position']}")
    print(f"clean {r['metric_clean']:.4f}, corrupted {r['metric_corrupted']:.4f}")
    n = max(len(row) for row in r["table"])
    print("layer " + "".join(f"{h:>9}" for h in range(n)))
    for i, row in enumerate(r["table"]):
        print(f"{i:>5} " + "".join(f"{'':>9}" if x is None else f"{x:>9.3f}" for x in row))
    print("top heads (by |patched - corrupted|):")
    for t in r["top"]:
        rec = "" if t["recovered"] is None else f" ({100 * t['recovered']:.0f}% of clean - corrupted)"
        print(f"  L{t['layer']}H{t['head']}: {t['value']:.4f}{rec}")


def _task(loaded, model, kind: str, args):
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
    if kind == "hf" and not getattr(loaded, "causal", False):
        if len(texts) < 2:
            raise UsageError("the retrieval task needs at least 2 texts")
        train, held = (texts[:n], texts[n:n + HELD_OUT]) if len(texts) > n + 8 else (texts, texts)
        batches = [train[i:i + args.batch_size] for i in range(0, len(train), args.batch_size)]
        batches = [b for b in batches if len(b) >= 2]
        tok = loaded.tokenizer
        return (batches, lambda m, b: tasks.contrastive_loss(m, tok, b),
                lambda m: tasks.retrieval_accuracy(m, tok, held), "verse-half retrieval top-1 accuracy")
    encode = (lambda t: loaded.tokenizer(t, return_tensors="pt")["input_ids"]) if kind == "hf" else \
        (lambda t: torch.tensor([loaded.encode(t)]))
    seqs = [encode(t) for t in texts]
    limit = getattr(loaded, "max_positions", None) or 512
    seqs = [s[:, :limit] for s in seqs if s.shape[1] >= 2]
    train, held = (seqs[:n], seqs[n:n + HELD_OUT]) if len(seqs) > n + 8 else (seqs, seqs)

    def run(m, ids):
        return tasks.logits(m, m(input_ids=ids) if kind == "hf" else m(ids))

    def score(m):
        with torch.no_grad():
            hits = [(run(m, s)[0, :-1].argmax(-1) == s[0, 1:]).float().mean().item() for s in held]
        return sum(hits) / len(hits)
    return train, lambda m, s: tasks.next_token_loss(run(m, s), s), score, "next-token top-1 accuracy"


def _importance(args) -> dict:
    from multihead import heads

    if args.batches < 1 or args.batch_size < 2:
        raise UsageError(f"--batches must be >= 1 and --batch-size >= 2; received {args.batches} and "
                         f"{args.batch_size}")
    loaded, model, kind = _load(args.model)
    batches, loss, score, what = _task(loaded, model, kind, args)
    imp = heads.importance(model, batches, loss)
    result = {"model": getattr(loaded, "name", args.model), "task": what,
              "importance": [[round(x, 6) for x in row.tolist()] for row in imp]}
    if args.prune_curve:
        result["curve"] = prune_curve(model, batches, loss, score)
    return result


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

    from multihead._files import atomic_path

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


def _print_importance(r: dict) -> None:
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


def _prune(args) -> dict:
    from multihead import heads

    pairs = _pairs(args.remove)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out!r} is a file; give a folder")
    loaded, model, kind = _load(args.model)
    if kind != "hf":
        raise UsageError("prune --out saves transformers models; a lab checkpoint's heads can be pruned in Python "
                         "with multihead.heads.prune(model, heads)")
    heads.prune(model, pairs)
    model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    cfg = model.config
    return {"model": getattr(loaded, "name", args.model), "removed": [list(p) for p in pairs], "out": str(out),
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)}


def main(args) -> int:
    cmd = args.heads_command
    if cmd == "scan":
        png, html = output_file("--png", args.png, "scan.png"), output_file("--html", args.html, "scan.html")
        r = _scan(args)
        if png:
            _heat_png(png, r["table"], f"{r['model']}: patching {r['what']}", r["metric_corrupted"])
            r["png"] = str(png)
        if html:
            _heat_html(html, r)
            r["html"] = str(html)
        print(json.dumps(r, indent=1)) if args.json else _print_scan(r)
    elif cmd == "importance":
        png = output_file("--png", args.png, "curve.png")
        if png and not args.prune_curve:
            raise UsageError("--png draws the pruning curve; add --prune-curve")
        r = _importance(args)
        if png:
            _curve_png(png, r["curve"], f"{r['model']}: {r['task']}")
            r["png"] = str(png)
        print(json.dumps(r, indent=1)) if args.json else _print_importance(r)
    else:
        r = _prune(args)
        print(f"removed {len(r['removed'])} heads; saved to {r['out']} ({r['num_attention_heads']} query / "
              f"{r['num_key_value_heads']} key-value heads per layer)")
    return 0
