"""Which heads a model needs: activation patching, importance and pruning of its heads.

scan: patch each head from a clean run into a corrupted one (activation patching), on a
task (--task ioi: Wang et al.'s indirect-object pairs; --task induction: repeated random
tokens) or on one pair of texts (--clean/--corrupted/--answer/--wrong), print the metric
per layer x head, and check the ranking causally: the metric with the top 4 and 8 heads
mean-ablated against as many random heads. path: path patching (Wang et al., 2022), every
head as the only sender to the receivers' queries, keys or values, or to the logits.
induction: the induction heads of a decoder (Olsson et al., 2022): every head's induction
score, the loss on the repeated half with the top heads ablated, and the earlier heads
that feed them. importance: Michel et al. (2019) head importance on a task (encoders such
as the bundled MiniLM: verse-half retrieval on the bundled King James Bible; causal
models: next-token loss), and with --prune-curve the task's score as heads are removed 10%
at a time (a grouped-query transformers decoder such as SmolLM2: held-out KJV perplexity,
in whole KV groups and by query heads, by importance and in random orders). prune: remove
heads and save a copy of the model (where its format can hold fewer heads). See docs/heads.md.

examples:
  multihead heads scan --task ioi --n 8
  multihead heads scan --clean "When Mary and John went to the store, John gave a drink to" \\
      --corrupted "When Mary and John went to the store, Mary gave a drink to" --answer Mary --wrong John
  multihead heads path --task ioi --receivers 23.0,23.2 --via q
  multihead heads induction --png induction.png
  multihead heads importance --prune-curve --png curve.png
  multihead heads importance --model smollm2 --prune-curve --out docs/heads/prune-curve-smollm2
  multihead heads prune --model path/to/llama --remove 0.1,0.5,1.1,1.5 --out pruned/
  multihead heads prune --model smollm2 --curve docs/heads/prune-curve-smollm2/results.json --at groups:0.5 \
      --out pruned/
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

from multihead.cli_args import add_json, add_model, add_out, add_seed
from multihead.errors import UsageError
from multihead.files import output_file
from multihead.heads.heatmap import heat_html, heat_png, text_table
from multihead.heads.path_cli import check_fit, token_after

TOP = 10
HELD_OUT = 256  # verses the task's score is measured on (not the ones importance is computed on)
STRIDE = 37  # every 37th verse: 320 verses spread over the KJV's 30,687 of 8+ words
CHECK_KS = (4, 8)  # the causal check ablates the top k heads of a ranking ...
CHECK_SEEDS = 5  # ... against k random heads, the median of this many draws
N_PAIRS = 8  # --task ioi / induction: pairs or sequences (a scan's cost grows with them)
N_SEQUENCES = 4  # heads induction: 4 x 49 predictions on the repeated half; each ablation is a forward of them
FEEDERS = 10  # heads induction: earlier heads shortlisted by attribution, then ablated one by one
LENGTH = 50  # --task induction: tokens per half (Olsson et al.'s sequences are longer; 50 shows the heads)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="heads_command", metavar="{scan,path,circuit,induction,importance,prune}")
    sub.required = True

    s = sub.add_parser("scan", help="activation patching of every head, with a causal check of the ranking",
                       allow_abbrev=False,
                       description="Patch each head from the clean run into the corrupted one, one at a time, and "
                                   "print the metric (IOI and one pair: logit(answer) - logit(wrong) at the last "
                                   "token; induction: the loss on the repeated half); then ablate the top 4 and 8 "
                                   "heads against as many random heads.")
    s.add_argument("--task", choices=["ioi", "induction"],
                   help="ioi: indirect-object pairs of Wang et al. (2022), metric logit(IO) - logit(S); induction: "
                        "repeated random tokens, metric the loss on the repeated half. Without it, --clean, "
                        "--corrupted, --answer and --wrong give one pair")
    s.add_argument("--n", type=int, default=N_PAIRS, help=f"--task: pairs or sequences (default {N_PAIRS})")
    s.add_argument("--length", type=int, default=LENGTH,
                   help=f"--task induction: random tokens per half (default {LENGTH})")
    add_seed(s, "--task: the draw of prompts or tokens (default 0)")
    s.add_argument("--clean", help="the clean text (one pair)")
    s.add_argument("--corrupted", help="the corrupted text (one pair; the same number of tokens)")
    s.add_argument("--answer", help="the token the clean text should predict next, e.g. Mary (one token: after a "
                                    "word, the space-led piece ' Mary')")
    s.add_argument("--wrong", help="the token the corrupted text points to (one token, read as --answer is)")
    add_model(s, "smollm2", decoder=True)
    s.add_argument("--what", choices=["z", "k", "v", "pattern"], default="z",
                   help="what to patch: head outputs z (default), keys, values (per key/value head) or patterns")
    s.add_argument("--png", metavar="PATH", help="write a heat map of the table")
    s.add_argument("--html", metavar="PATH", help="write the table as a self-contained HTML heat map")
    add_json(s)

    d = sub.add_parser("induction", help="the induction heads of a decoder, checked by ablation",
                       allow_abbrev=False,
                       description="Induction heads (Olsson et al., 2022) on random tokens repeated once: every "
                                   "head's induction score (attention from a repeated token to the token after "
                                   "its first occurrence), the loss on the repeated half with the top 4 and 8 "
                                   "heads ablated against as many random heads, and the heads of earlier layers "
                                   "whose ablation most raises it (the previous-token heads that feed them).")
    add_model(d, "smollm2", decoder=True)
    d.add_argument("--n", type=int, default=N_SEQUENCES, help=f"sequences (default {N_SEQUENCES})")
    d.add_argument("--length", type=int, default=LENGTH, help=f"random tokens per half (default {LENGTH})")
    add_seed(d, "the draw of tokens (default 0)")
    d.add_argument("--png", metavar="PATH", help="write the induction and previous-token scores as heat maps")
    add_json(d)

    i = sub.add_parser("importance", help="Michel et al. (2019) head importance, and the pruning curve",
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

    p = sub.add_parser("prune", help="remove heads and save the model",
                       allow_abbrev=False,
                       description="Remove heads physically from a copy of the model and save_pretrained it "
                                   "(transformers models whose config carries head_dim, with the same head count "
                                   "left in every layer). The model's own folder is never written; --out must be "
                                   "new or empty unless --force.")
    add_model(p, "minilm")
    p.add_argument("--remove", metavar="LIST",
                   help="heads to remove as layer.head, comma-separated, e.g. 0.1,0.5,1.1,1.5")
    p.add_argument("--curve", metavar="FILE", help="instead of --remove: a results.json of `heads importance "
                                                  "--prune-curve` on this model, with --at")
    p.add_argument("--at", metavar="UNIT:FRACTION", help="with --curve: the by-importance point to prune, e.g. "
                                                         "groups:0.3 or heads:0.5")
    p.add_argument("--pad", action="store_true",
                   help="lay every layer out as the widest, with inert (all-zero) heads, so that a transformers "
                        "config's one head count holds any removal (implied by --curve)")
    add_out(p, "a new (or empty) folder to save the pruned model in", required=True)
    p.add_argument("--force", action="store_true",
                   help="replace --out when it already holds files (never the model's own folder)")
    add_json(p, help="print the result as JSON (heads removed, head counts, parameters, --out) instead of a line")

    from multihead.heads.path_cli import add_path_arguments

    add_path_arguments(sub)

    from multihead.heads.circuit_cli import add_circuit_arguments

    add_circuit_arguments(sub)


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


def _load(spec: str, fresh: bool = False):
    from multihead.interop.loaders import load_model  # it sets the hub offline for the load only

    loaded = load_model(spec, fresh=fresh)
    return loaded, loaded.model


def _language_model(spec: str, command: str):
    """A loaded decoder LM, or a one-line refusal that says why and what to use instead."""
    loaded, model = _load(spec)
    why = loaded.why_not_lm()
    if why is not None:
        name = getattr(loaded, "name", spec)
        raise UsageError(f"heads {command} reads next-token logits, and --model {name} ({type(model).__name__}) "
                         f"{why}, so there are none to read; use a decoder LM (--model smollm2, the default), or "
                         "`multihead heads importance`, whose verse-half retrieval task is made for encoders")
    return loaded, model


def _logits(out):
    """The model's own logits (a lab model returns them; a transformers LM has `.logits`)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    lg = getattr(out, "logits", None)
    if not isinstance(lg, torch.Tensor):
        raise UsageError(f"the model's output ({type(out).__name__}) holds no logits; heads scan reads a language "
                         "model's own logits (use --model smollm2)")
    return lg


def _run(model, inputs):
    import torch

    with torch.no_grad():  # a tokenizer's BatchEncoding is a Mapping, not a dict
        return _logits(model(**inputs) if isinstance(inputs, Mapping) else model(inputs))


def _encode(loaded, flag: str, text: str):
    if not text.strip():
        raise UsageError(f"{flag} is empty; give a text")
    enc = loaded.inputs(text)
    n = loaded.input_ids(enc).shape[1]
    if n == 0:
        raise UsageError(f"{flag} {text!r} is no tokens for this model's tokenizer; give a text")
    limit = getattr(loaded, "max_positions", None)
    if limit and n > limit:
        raise UsageError(f"{flag} is {n} tokens and this model takes at most {limit} positions; give a shorter text")
    return enc


def _as_ids(ids: list[int]):
    import torch

    return torch.tensor(ids)


def _first_difference(loaded, a: list[int], b: list[int]) -> str:
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    show = loaded.tokens
    if k == min(len(a), len(b)):
        longer = "--clean" if len(a) > len(b) else "--corrupted"
        return f"{longer} goes on after token {k - 1} with {show((a if len(a) > len(b) else b)[k:k + 3])}"
    return f"they part at token {k}: {show(a[k:k + 1])} vs {show(b[k:k + 1])}"


MAX_COUNT = 100_000  # pairs, sequences or tokens: beyond it a run would not end (a 400-digit --n loops)


def _check_count(flag: str, value: int, low: int) -> None:
    if not low <= value <= MAX_COUNT:
        shown = value if len(str(value)) <= 20 else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise UsageError(f"{flag} must be between {low} and {MAX_COUNT:,}; received {shown}")


def _check_length(loaded, length: int, limit: int | None) -> None:
    """--length L makes 2L tokens after the tokenizer's prefix (Gemma's <bos>): within the positions."""
    start = len(loaded.prefix_ids())
    if limit and 2 * length + start > limit:
        raise UsageError(f"--length {length} makes sequences of {2 * length + start} tokens and this model takes "
                         f"at most {limit} positions; give --length <= {(limit - start) // 2}")


def _one_pair(loaded, model, args):
    """(clean, corrupted, reference, metric, description) of --clean/--corrupted/--answer/--wrong."""
    missing = [f"--{k}" for k in ("clean", "corrupted", "answer", "wrong") if getattr(args, k) is None]
    if missing:
        raise UsageError(f"heads scan needs --task ioi|induction, or one pair: --clean, --corrupted, --answer and "
                         f"--wrong (missing: {', '.join(missing)})")
    clean = _encode(loaded, "--clean", args.clean)
    corrupted = _encode(loaded, "--corrupted", args.corrupted)
    ids_a = loaded.input_ids(clean)[0].tolist()
    ids_b = loaded.input_ids(corrupted)[0].tolist()
    if len(ids_a) != len(ids_b):
        raise UsageError(f"--clean is {len(ids_a)} tokens and --corrupted {len(ids_b)} tokens; patching needs the "
                         f"same number of tokens ({_first_difference(loaded, ids_a, ids_b)}; change words for "
                         "words of as many tokens)")
    ans, ans_piece = token_after(loaded, "--answer", args.clean, args.answer)
    wrong, wrong_piece = token_after(loaded, "--wrong", args.clean, args.wrong)
    check_fit(model, _as_ids([ans, wrong]))
    if ans == wrong:
        raise UsageError(f"--answer {args.answer!r} and --wrong {args.wrong!r} are the same token "
                         f"({ans_piece!r}); the metric would be 0")
    pos = loaded.last_real_position(ids_a)

    def metric(x):
        return (x[:, pos, ans] - x[:, pos, wrong]).mean()
    info = {"task": None, "answer": args.answer, "wrong": args.wrong, "answer_token": ans_piece,
            "wrong_token": wrong_piece, "position": pos,
            "metric": f"logit({ans_piece!r}) - logit({wrong_piece!r}) at token {pos}",
            "reference": "the corrupted text (its mean over positions)"}
    return clean, corrupted, corrupted, metric, info


def _task_inputs(loaded, model, args):
    """(clean, corrupted, reference, metric, description) of --task."""
    from multihead.heads import tasks

    _check_count("--n", args.n, 1)
    limit = getattr(loaded, "max_positions", None)
    if args.task == "ioi":
        tokenizer = loaded.word_tokenizer("--task ioi")
        try:
            task = tasks.ioi(args.n, seed=args.seed, tokenizer=tokenizer)
        except ValueError as err:
            raise UsageError(f"--task ioi on this model: {err}") from None
        info = {"task": "ioi", "n": len(task), "answer": "IO", "wrong": "S", "position": task.position.tolist(),
                "metric": "logit(IO) - logit(S) at the last token, mean over pairs",
                "reference": "ABC prompts (the same templates with three different names)",
                "prompts": [{"clean": a, "corrupted": b, "order": o}
                            for a, b, o in zip(task.texts, task.corrupted_texts, task.orders)]}
        if limit and task.clean["input_ids"].shape[1] > limit:
            raise UsageError(f"the IOI prompts are {task.clean['input_ids'].shape[1]} tokens and this model takes "
                             f"at most {limit} positions")
        return task.clean, task.corrupted, task.reference, task.metric, info
    _check_count("--length", args.length, 2)
    _check_length(loaded, args.length, limit)
    task = tasks.induction(args.n, args.length, seed=args.seed, vocab=loaded.token_source)
    info = {"task": "induction", "n": len(task), "length": args.length, "answer": None, "wrong": None,
            "position": None, "metric": f"loss (nats) on the repeated half of {args.length} + {args.length} "
                                        "random tokens (lower is better)",
            "reference": "fresh random tokens (no repeat)"}
    return task.clean, task.corrupted, task.reference, task.metric, info


def causal_check(model, inputs, metric, ranked: list[tuple[int, int]], candidates: list[tuple[int, int]],
                 reference, how: str = "mean", ks=CHECK_KS, seeds: int = CHECK_SEEDS) -> dict:
    """Does a ranking mean anything? The metric on `inputs` with the top k heads of `ranked`
    ablated, against k heads drawn at random from the other `candidates` (the median of
    `seeds` draws), for each k of `ks`. `how`: "mean" (each head's output replaced by its
    mean over `reference`'s tokens) or "zero"."""
    from multihead import heads

    rec = heads.record(model, reference) if how == "mean" else None
    kwargs = {"how": how, "reference": rec} if how == "mean" else {"how": "zero"}

    def ablated(hs):
        with heads.ablate(model, hs, **kwargs):
            return float(metric(_run(model, inputs)))
    rows = []
    # at most half the heads, so the random ones are drawn from as many others
    for k in sorted({min(k, len(ranked), len(candidates) // 2) for k in ks} - {0}):
        top = ranked[:k]
        others = [c for c in candidates if c not in top]
        draws = [random.Random(seed).sample(others, min(k, len(others))) for seed in range(seeds)]
        values = [ablated(hs) for hs in draws]
        rows.append({"k": k, "heads": [list(h) for h in top], "ablated": ablated(top), "random": values,
                     "random_median": statistics.median(values), "random_heads": [[list(h) for h in hs]
                                                                               for hs in draws]})
    return {"how": how, "metric_intact": float(metric(_run(model, inputs))), "by_k": rows}


def _scan(args) -> dict:
    import torch

    from multihead import heads

    if args.task is None and (args.n != N_PAIRS or args.length != LENGTH or args.seed != 0):
        raise UsageError("--n, --length and --seed choose a --task's prompts; add --task ioi or --task induction")
    if args.task is not None:
        given = [f"--{k}" for k in ("clean", "corrupted", "answer", "wrong") if getattr(args, k) is not None]
        if given:
            raise UsageError(f"--task {args.task} makes its own prompts; drop {', '.join(given)} (or drop --task "
                             "to scan one pair)")
    else:
        missing = [f"--{k}" for k in ("clean", "corrupted", "answer", "wrong") if getattr(args, k) is None]
        if missing:  # before the model loads: a mistake costs no wait
            raise UsageError(f"heads scan needs --task ioi|induction, or one pair: --clean, --corrupted, --answer "
                             f"and --wrong (missing: {', '.join(missing)})")
    if args.task is not None:
        _check_count("--n", args.n, 1)
        if args.task == "induction":
            _check_count("--length", args.length, 2)
    loaded, model = _language_model(args.model, "scan")
    if args.task is None:
        clean, corrupted, reference, metric, info = _one_pair(loaded, model, args)
    else:
        clean, corrupted, reference, metric, info = _task_inputs(loaded, model, args)
    check_fit(model, clean, corrupted, reference)
    m_clean, m_corr = float(metric(_run(model, clean))), float(metric(_run(model, corrupted)))
    t0 = time.perf_counter()
    table = heads.patch_scan(model, clean, corrupted, metric, what=args.what, progress=True)
    scan_s = time.perf_counter() - t0
    span = m_clean - m_corr
    cells = [(layer, h, table[layer, h].item()) for layer in range(table.shape[0]) for h in range(table.shape[1])
             if not torch.isnan(table[layer, h])]
    by_size = sorted(cells, key=lambda c: -abs(c[2] - m_corr))
    top = [{"layer": layer, "head": h, "value": v, "recovered": (v - m_corr) / span if span else None}
           for layer, h, v in by_size[:TOP]]
    result = {"model": getattr(loaded, "name", args.model), "what": args.what, **info, "metric_clean": m_clean,
              "metric_corrupted": m_corr,
              "table": [[None if torch.isnan(x) else round(x.item(), 6) for x in row] for row in table], "top": top}
    t0 = time.perf_counter()
    if args.what == "z":  # the ranking's heads are query heads, the ones ablation knocks out
        # ranked by how far patching the head moves the corrupted run towards the clean one
        sign = 1.0 if span >= 0 else -1.0
        ranked = [(layer, h) for layer, h, v in sorted(cells, key=lambda c: -sign * (c[2] - m_corr))]
        check = causal_check(model, clean, metric, ranked, [(c[0], c[1]) for c in cells], reference)
        check["ranking"] = "heads by how far patching them moves the corrupted metric towards the clean one"
        check["reference"] = info["reference"]
        check["on"] = "the clean inputs"
        result["causal_check"] = check
    result["seconds"] = {"scan": round(scan_s, 2), "causal_check": round(time.perf_counter() - t0, 2)}
    return result


def induction_study(args) -> dict:
    """`heads induction`: induction and previous-token scores of every head on repeated
    random tokens, the causal check of the induction ranking, and the earlier heads whose
    ablation most raises the loss on the repeated half."""
    import torch

    from multihead import heads
    from multihead.heads import tasks

    _check_count("--n", args.n, 1)
    _check_count("--length", args.length, 2)
    loaded, model = _language_model(args.model, "induction")
    limit = getattr(loaded, "max_positions", None)
    _check_length(loaded, args.length, limit)
    task = tasks.induction(args.n, args.length, seed=args.seed, vocab=loaded.token_source)
    check_fit(model, task.clean, task.corrupted, task.reference)
    t0 = time.perf_counter()
    rec = heads.record(model, task.clean, what=("pattern",))
    L, off, T = task.length, task.offset, task.clean.shape[1]
    query = torch.arange(L) + off + L  # every token of the repeated half ...
    key = torch.arange(L) + off + 1  # ... and the token after its first occurrence
    after = torch.arange(1, T)
    induction, previous = [], []
    for layer in range(rec.n_layers):
        pattern = rec["pattern", layer]  # (N, H, T, S)
        induction.append(pattern[:, :, query, key].mean((0, 2)).tolist())  # (H,)
        previous.append(pattern[:, :, after, after - 1].mean((0, 2)).tolist())
    del rec
    score_s = time.perf_counter() - t0
    logits = _run(model, task.clean)
    loss_first, loss_repeated = float(task.first_half_loss(logits)), float(task.metric(logits))
    loss_unrepeated = float(task.metric(_run(model, task.corrupted)))
    cells = [(layer, h) for layer, row in enumerate(induction) for h in range(len(row))]
    ranked = sorted(cells, key=lambda c: -induction[c[0]][c[1]])
    t0 = time.perf_counter()
    checks = {how: causal_check(model, task.clean, task.metric, ranked, cells, task.reference, how=how)
              for how in ("zero", "mean")}
    # The heads that feed the top induction heads sit in earlier layers. Ablating each of
    # those alone is a forward per head; attribution patching (one backward) estimates every
    # head's effect of taking its output from fresh random text, and the FEEDERS heads it
    # ranks highest among the earlier layers are then mean-ablated for real, one at a time.
    top = ranked[:max(row["k"] for row in checks["mean"]["by_k"])]
    deepest = max(layer for layer, _ in top)
    earlier = [c for c in cells if c[0] < deepest and c not in top]
    estimate = heads.attribution_scan(model, task.reference, task.clean, task.metric)
    shortlist = sorted(earlier, key=lambda c: -float(estimate[c[0], c[1]]))[:FEEDERS]
    ref = heads.record(model, task.reference)
    raised = []
    for c in shortlist:
        with heads.ablate(model, [c], how="mean", reference=ref):
            raised.append((float(task.metric(_run(model, task.clean))) - loss_repeated, c))
    raised.sort(key=lambda x: -x[0])
    feeders = [{"layer": c[0], "head": c[1], "loss_raised_by": d, "estimated": float(estimate[c[0], c[1]])
                - loss_repeated, "previous_token_score": previous[c[0]][c[1]],
                "induction_score": induction[c[0]][c[1]]} for d, c in raised]
    return {"model": getattr(loaded, "name", args.model), "n": args.n, "length": L, "seed": args.seed,
            "bos": None, "tokens": loaded.random_tokens,
            "loss_first_half": loss_first, "loss_repeated_half": loss_repeated,
            "loss_repeated_half_after_other_tokens": loss_unrepeated,
            "induction_score": [[round(x, 6) for x in row] for row in induction],
            "previous_token_score": [[round(x, 6) for x in row] for row in previous],
            "top": [{"layer": a, "head": b, "induction_score": induction[a][b],
                     "previous_token_score": previous[a][b]} for a, b in ranked[:TOP]],
            "ablation": checks, "feeders": {"among": f"the {len(earlier)} other heads of layers 0-{deepest - 1} "
                                                    f"(below the deepest of the top {len(top)} induction heads)",
                                           "how": f"the {FEEDERS} that attribution patching ranks highest, each "
                                                  "mean-ablated alone (reference: fresh random tokens)",
                                           "heads": feeders},
            "seconds": {"scores": round(score_s, 2), "ablations": round(time.perf_counter() - t0, 2)}}


def _print_induction(r: dict) -> None:
    print(f"{r['model']}: induction heads on {r['n']} sequences of {r['length']} random tokens repeated once")
    print(f"loss (nats): first half {r['loss_first_half']:.3f}, repeated half {r['loss_repeated_half']:.3f} "
          f"(the same tokens after other random ones: {r['loss_repeated_half_after_other_tokens']:.3f})")
    print("top induction heads (attention from a repeated token to the token after its first occurrence):")
    for t in r["top"]:
        print(f"  L{t['layer']}H{t['head']}: induction {t['induction_score']:.3f}, previous-token "
              f"{t['previous_token_score']:.3f}")
    for how, c in r["ablation"].items():
        print(f"loss on the repeated half, top induction heads {how}-ablated:")
        for row in c["by_k"]:
            print(f"  top {row['k']}: {row['ablated']:.3f}; {row['k']} random heads: median "
                  f"{row['random_median']:.3f} of {len(row['random'])} draws")
    f = r["feeders"]
    print(f"earlier heads whose ablation most raises that loss ({f['among']}; {f['how']}):")
    for t in f["heads"]:
        print(f"  L{t['layer']}H{t['head']}: +{t['loss_raised_by']:.3f} nats (previous-token score "
              f"{t['previous_token_score']:.3f})")


def _induction_png(path: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    from multihead.files import atomic_path

    fig = Figure(figsize=(10, 1.5 + 0.22 * len(r["induction_score"])))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(wspace=0.4)
    marks = {"induction_score": [(t["layer"], t["head"]) for t in r["top"][:max(CHECK_KS)]],
             "previous_token_score": [(t["layer"], t["head"]) for t in r["feeders"]["heads"][:5]]}
    for i, (key, title) in enumerate((("induction_score", "induction score"),
                                      ("previous_token_score", "previous-token score"))):
        ax = fig.add_subplot(1, 2, i + 1)
        a = np.array(r[key], dtype=float)
        im = ax.imshow(a, cmap="viridis", vmin=0, vmax=max(1e-6, float(a.max())), aspect="auto")
        for layer, h in marks[key]:
            ax.add_patch(Rectangle((h - 0.5, layer - 0.5), 1, 1, fill=False, ec="red", lw=1.2))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(title + (" (red: top 8)" if i == 0 else " (red: top 5 feeders by ablation)"), fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.05)
    fig.suptitle(f"{r['model']}: {r['n']} x ({r['length']} random tokens, repeated); repeated-half loss "
                 f"{r['loss_repeated_half']:.2f} vs first half {r['loss_first_half']:.2f} nats", fontsize=9)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")


def _print_scan(r: dict) -> None:
    if r.get("task"):
        print(f"{r['model']}: patching {r['what']} from clean into corrupted, --task {r['task']} ({r['n']} "
              f"{'pairs' if r['task'] == 'ioi' else 'sequences'}); metric = {r['metric']}")
    else:
        print(f"{r['model']}: patching {r['what']} from clean into corrupted; metric = {r['metric']}")
    print(f"clean {r['metric_clean']:.4f}, corrupted {r['metric_corrupted']:.4f}")
    print(text_table(r["table"]))
    print("top heads (by |patched - corrupted|):")
    for t in r["top"]:
        rec = "" if t["recovered"] is None else f" ({100 * t['recovered']:.0f}% of clean - corrupted)"
        print(f"  L{t['layer']}H{t['head']}: {t['value']:.4f}{rec}")
    c = r.get("causal_check")
    if c:
        print(f"causal check: {c['how']} ablation (reference: {c['reference']}) on the clean inputs, metric "
              f"{c['metric_intact']:.4f} intact")
        for row in c["by_k"]:
            names = " ".join(f"L{a}H{b}" for a, b in row["heads"])
            print(f"  top {row['k']} ({names}): {row['ablated']:.4f}; {row['k']} random heads: median "
                  f"{row['random_median']:.4f} of {len(row['random'])} draws "
                  f"({', '.join(f'{v:.3f}' for v in row['random'])})")


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

    _check_count("--batches", args.batches, 1)
    _check_count("--batch-size", args.batch_size, 1)
    if args.batches < 1 or args.batch_size < 2:
        raise UsageError(f"--batches must be >= 1 and --batch-size >= 2; received {args.batches} and "
                         f"{args.batch_size}")
    loaded, model = _load(args.model)
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


def _prune_target(args) -> tuple[Path, Path]:
    """(--out resolved, the model's own folder), refused before any load when --out is the
    model's folder, inside it or above it, a file, or a folder that holds files (without --force)."""
    from multihead.files import check_out_apart
    from multihead.interop.loaders import resolve_model

    _, source, _, _ = resolve_model(args.model)
    out, source_dir = check_out_apart("--out", args.out, source, tool="prune")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out!r} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"--out {args.out!r} exists and is not empty ({len(list(out.iterdir()))} entries); give a "
                         "new folder, or --force to replace it")
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out!r}: the folder {str(out.parent)!r} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {args.out!r}: cannot write in the folder {str(out.parent)!r} (permission denied)")
    return out, source_dir


def _save_atomically(out: Path, save) -> None:
    """`save(folder)` into a new folder beside `out`, then renamed over it: a reader, a crash or
    Ctrl-C sees the old folder or the whole new one, never a half-written model."""
    import shutil
    import tempfile

    from multihead.files import usual_mode

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    old = None
    try:
        save(tmp)
        os.chmod(tmp, usual_mode(folder=True))
        for f in tmp.rglob("*"):  # transformers writes model.safetensors 0600 (a temporary file renamed)
            if f.is_file():
                os.chmod(f, usual_mode())
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.rename(out, old / "replaced")
        os.rename(tmp, out)
    except BaseException:
        if old is not None and not out.exists() and (old / "replaced").exists():
            os.rename(old / "replaced", out)  # put the user's folder back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _curve_point(args) -> list[tuple[int, int]]:
    """The heads of `--curve FILE --at UNIT:FRACTION` (a by-importance point of the curve)."""
    if args.remove:
        raise UsageError("give --remove or --curve with --at, not both")
    if not args.at:
        raise UsageError("--curve needs --at UNIT:FRACTION, e.g. --at groups:0.3")
    unit, _, frac = args.at.partition(":")
    try:
        r = json.loads(Path(args.curve).read_text(encoding="utf-8"))
        curves = r["curves"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--curve {args.curve!r}: not a results.json of `heads importance --prune-curve` on a "
                         f"grouped-query decoder ({type(err).__name__}: {err})") from None
    try:
        f = float(frac)
    except ValueError:
        f = None
    points = {p["fraction"]: p for p in curves.get(unit, {}).get("importance", [])}
    if unit not in curves or f not in points:
        valid = ", ".join(f"{u}:{p['fraction']:g}" for u in curves for p in curves[u]["importance"])
        raise UsageError(f"--at {args.at!r} is not a point of {args.curve}; valid: {valid}")
    return [tuple(p) for p in points[f]["removed"]]


def _prune(args) -> dict:
    from multihead import heads

    if args.curve:
        pairs, pad = _curve_point(args), True
    elif args.remove:
        pairs, pad = _pairs(args.remove), args.pad
    else:
        raise UsageError("give the heads to remove: --remove layer.head,... or --curve FILE --at UNIT:FRACTION")
    if args.at and not args.curve:
        raise UsageError("--at picks a point of --curve FILE; give --curve too")
    out, _ = _prune_target(args)
    # a copy of its own: the session's cached model (another run, another tool) stays whole
    loaded, model = _load(args.model, fresh=True)
    if not hasattr(model, "save_pretrained"):
        raise UsageError("prune --out saves transformers models; a lab checkpoint's heads can be pruned in Python "
                         "with multihead.heads.prune(model, heads)")
    before = sum(p.numel() for p in model.parameters())
    heads.prune(model, pairs, pad=pad)

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    _save_atomically(out, save)
    cfg = model.config
    return {"model": getattr(loaded, "name", args.model), "removed": [list(p) for p in pairs], "out": str(out),
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "params_before": before, "params": sum(p.numel() for p in model.parameters())}


def main(args) -> int:
    cmd = args.heads_command
    if cmd == "path":
        from multihead.heads.path_cli import run_path

        return run_path(args)
    if cmd == "circuit":
        from multihead.heads.circuit_cli import run_circuit

        return run_circuit(args)
    if cmd == "scan":
        png, html = output_file("--png", args.png, "scan.png"), output_file("--html", args.html, "scan.html")
        r = _scan(args)
        if png:
            task = f", {r['task']}" if r.get("task") else ""
            heat_png(png, r["table"], r["metric_corrupted"], f"{r['model']}: patching {r['what']}{task}")
            r["png"] = str(png)
        if html:
            heat_html(html, r["table"], r["metric_corrupted"], "multihead heads scan",
                      f"{r['model']}: patching {r['what']}, metric {r['metric']}; clean {r['metric_clean']:.3f}, "
                      f"corrupted {r['metric_corrupted']:.3f}")
            r["html"] = str(html)
        print(json.dumps(r, indent=1)) if args.json else _print_scan(r)
    elif cmd == "induction":
        png = output_file("--png", args.png, "induction.png")
        r = induction_study(args)
        if png:
            _induction_png(png, r)
            r["png"] = str(png)
        print(json.dumps(r, indent=1)) if args.json else _print_induction(r)
    elif cmd == "importance":
        png = output_file("--png", args.png, "curve.png")
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
    else:
        r = _prune(args)
        if args.json:
            print(json.dumps(r, indent=1))
            return 0
        print(f"removed {len(r['removed'])} heads; saved to {r['out']} ({r['num_attention_heads']} query / "
              f"{r['num_key_value_heads']} key-value heads per layer; {r['params']:,} parameters, "
              f"{r['params_before']:,} before)")
    return 0
