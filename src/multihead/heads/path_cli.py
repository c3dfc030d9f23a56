"""`multihead heads path`: path patching (Wang et al., 2022) of every head to chosen
receivers, through `multihead.heads.path_patch_scan`. `DESCRIPTION` is the --help text
(read by `documented_parser`); docs/heads.md the guide.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from multihead.cli_args import add_json, add_model, add_seed, add_threads
from multihead.errors import UsageError
from multihead.files import output_file
from multihead.heads.cli_common import (
    check_count,
    check_fit,
    check_pair_or_task,
    documented_parser,
    heat_maps,
    print_table_and_top,
    token_after,
)
from multihead.interop.loaders import model_source

DESCRIPTION = """`multihead heads path`: path patching (Wang et al., 2022) of every head to chosen receivers.

Every query head in turn is the only sender; its effect reaches the corrupted run only
through the receivers' queries, keys or values (`--via`), or directly through the
residual stream to the logits (`--receivers logits`), and the table holds the metric
after each such patch (`multihead.heads.path_patch_scan`). The task is Wang et al.'s IOI
(`--task ioi`: the metric logit(IO) - logit(S) at the last token, clean prompts against
the same prompts with the subject's second name replaced by the indirect object), or one
pair of texts (`--clean/--corrupted/--answer/--wrong`).

examples:
  multihead heads path --task ioi --receivers logits
  multihead heads path --task ioi --receivers 9.6,9.9 --via q --png path.png
  multihead heads path --clean "When Mary and John went to the store, John gave a drink to" \\
      --corrupted "When Mary and John went to the store, Mary gave a drink to" --answer Mary --wrong John \\
      --receivers logits --json
"""

TOP = 10
N_PAIRS = 8


def add_path_arguments(subparsers) -> argparse.ArgumentParser:
    """Add the `path` subcommand to `multihead heads`' subparsers; returns its parser."""
    p = documented_parser(subparsers, "path", "path patching: each head's effect through chosen receivers only",
                          DESCRIPTION)
    add_model(p, "smollm2", decoder=True)
    p.add_argument("--task", choices=["ioi"],
                   help="ioi: indirect-object pairs of Wang et al. (2022), metric logit(IO) - logit(S). Without "
                        "it, --clean, --corrupted, --answer and --wrong give one pair")
    p.add_argument("--n", type=int, default=N_PAIRS, help=f"--task ioi: pairs (default {N_PAIRS})")
    add_seed(p, "--task ioi: the draw of prompts (default 0)")
    p.add_argument("--clean", help="the clean text (one pair)")
    p.add_argument("--corrupted", help="the corrupted text (one pair; the same number of tokens)")
    p.add_argument("--answer", help="the token the clean text should predict next, e.g. Mary (one token)")
    p.add_argument("--wrong", help="the token the corrupted text points to (one token)")
    p.add_argument("--receivers", required=True, metavar="LIST",
                   help="'logits' (the direct path), or receiver heads as layer.head, comma-separated, e.g. "
                        "9.6,9.9: query heads for --via q, key/value heads for --via k or v")
    p.add_argument("--via", choices=["q", "k", "v"], default="q",
                   help="the receivers' input the senders reach: queries (default), keys or values")
    p.add_argument("--top", type=int, default=TOP, help=f"how many top heads to list (default {TOP})")
    p.add_argument("--png", metavar="PATH", help="write a heat map of the table")
    p.add_argument("--html", metavar="PATH", help="write the table as a self-contained HTML heat map")
    add_json(p)
    add_threads(p)
    return p


def parse_receivers(value: str) -> str | list[tuple[int, int]]:
    """'logits', or 'L.H,L.H,...' -> [(L, H), ...]; UsageError naming the bad item."""
    if value.strip() == "logits":
        return "logits"
    out = []
    for item in value.split(","):
        layer, dot, head = item.strip().partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            raise UsageError(f"--receivers takes 'logits' or layer.head pairs, comma-separated, e.g. --receivers "
                             f"9.6,9.9; received {value!r} ({item.strip()!r} is not layer.head)")
        out.append((int(layer), int(head)))
    return out


def _load(spec: str):
    from multihead.interop.loaders import load_model  # it sets the hub offline for the load only

    loaded = load_model(spec)
    if loaded.why_not_lm() is not None:
        raise UsageError(f"heads path reads next-token logits, and --model {getattr(loaded, 'name', spec)} "
                         f"({type(loaded.model).__name__}) is not a causal language model; use a decoder LM "
                         "(--model smollm2, the default)")
    return loaded


def _one_pair(loaded, args):
    import torch

    from multihead.heads.metrics import AtPositions

    enc = {}
    for flag, text in (("--clean", args.clean), ("--corrupted", args.corrupted)):
        if not text.strip():
            raise UsageError(f"{flag} is empty; give a text")
        enc[flag] = loaded.inputs(text)
    ids = [loaded.input_ids(e)[0].tolist() for e in enc.values()]
    if len(ids[0]) != len(ids[1]):
        raise UsageError(f"--clean is {len(ids[0])} tokens and --corrupted {len(ids[1])} tokens; path patching "
                         "needs the same number (change words for words of as many tokens)")
    ans, ans_piece = token_after(loaded, "--answer", args.clean, args.answer)
    wrong, wrong_piece = token_after(loaded, "--wrong", args.clean, args.wrong)
    check_fit(loaded.model, torch.tensor([ans, wrong]))
    if ans == wrong:
        raise UsageError(f"--answer {args.answer!r} and --wrong {args.wrong!r} are the same token ({ans_piece!r}); "
                         "the metric would be 0")
    pos = len(ids[0]) - 1

    def diff(last):  # (1, vocab) at the last token
        return (last[:, ans] - last[:, wrong]).mean()
    metric = AtPositions(diff, [pos], "the metric")  # the scan computes the LM head at that token only
    info = {"task": None, "metric": f"logit({ans_piece!r}) - logit({wrong_piece!r}) at token {pos}"}
    return enc["--clean"], enc["--corrupted"], metric, info


def _ioi(loaded, args):
    from multihead.heads import tasks

    tokenizer = loaded.word_tokenizer("--task ioi")
    check_count("--n", args.n, 1)
    try:
        task = tasks.ioi(args.n, seed=args.seed, tokenizer=tokenizer)
    except ValueError as err:
        raise UsageError(f"--task ioi on this model: {err}") from None
    info = {"task": "ioi", "n": len(task), "metric": "logit(IO) - logit(S) at the last token, mean over pairs",
            "prompts": [{"clean": a, "corrupted": b} for a, b in zip(task.texts, task.corrupted_texts)]}
    return task.clean, task.corrupted, task.metric, info


def path_table(args) -> dict:
    """The result of `multihead heads path` as a dict (what --json prints)."""
    import torch

    from multihead import heads

    if args.task is None and (args.n != N_PAIRS or args.seed != 0):
        raise UsageError("--n and --seed choose --task ioi's prompts; add --task ioi")
    check_pair_or_task(args, "path", "ioi", "patch")
    check_count("--top", args.top, 1)
    receivers = parse_receivers(args.receivers)
    loaded = _load(args.model)
    model = loaded.model
    clean, corrupted, metric, info = _ioi(loaded, args) if args.task else _one_pair(loaded, args)
    check_fit(model, clean, corrupted)
    with torch.no_grad():
        m_clean, m_corr = float(metric(loaded.forward(clean))), float(metric(loaded.forward(corrupted)))
    t0 = time.perf_counter()
    # heads done, rate and ETA on stderr when it is a terminal (never in pipes, logs, --json's stdout)
    table = heads.path_patch_scan(model, clean, corrupted, metric, receivers, via=args.via, progress=True)
    seconds = time.perf_counter() - t0
    span = m_clean - m_corr
    cells = [(layer, h, table[layer, h].item()) for layer in range(table.shape[0]) for h in range(table.shape[1])
             if not math.isnan(table[layer, h].item())]
    top = [{"layer": layer, "head": h, "value": v, "effect": v - m_corr,
            "recovered": (v - m_corr) / span if span else None}
           for layer, h, v in sorted(cells, key=lambda c: -abs(c[2] - m_corr))[:args.top]]
    return {"model": getattr(loaded, "name", args.model), **info,
            "receivers": receivers if isinstance(receivers, str) else [list(r) for r in receivers],
            "via": None if receivers == "logits" else args.via, "metric_clean": m_clean, "metric_corrupted": m_corr,
            "table": [[None if math.isnan(x) else round(x, 6) for x in row] for row in table.tolist()],
            "top": top, "seconds": round(seconds, 2)}


def _title(r: dict) -> str:
    to = "the logits (direct path)" if r["receivers"] == "logits" else \
        f"{', '.join(f'{a}.{b}' for a, b in r['receivers'])} via {r['via']}"
    return f"{r['model']}: each head's path to {to}"


def _print(r: dict) -> None:
    print(_title(r))
    print(f"metric: {r['metric']}; clean {r['metric_clean']:.4f}, corrupted {r['metric_corrupted']:.4f}")
    print_table_and_top(r, "{layer}.{head}: {value:.4f}, effect {effect:+.4f}")


def run_path(args) -> int:
    """Run `multihead heads path` from parsed arguments; 0 on success (mistakes raise UsageError)."""
    src, taken = model_source(args.model), {}
    png = output_file("--png", args.png, "path.png", source=src, taken=taken)
    html = output_file("--html", args.html, "path.html", source=src, taken=taken)
    r = path_table(args)
    heat_maps(r, png, html, "path", _title(r),
              f"{_title(r)}; metric {r['metric']}: clean {r['metric_clean']:.3f}, "
              f"corrupted {r['metric_corrupted']:.3f}",
              xlabel="sender head", ylabel="sender layer")
    print(json.dumps(r, indent=1)) if args.json else _print(r)
    return 0
