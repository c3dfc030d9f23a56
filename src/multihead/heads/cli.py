"""`multihead heads`: which heads a model needs (activation patching, path patching,
induction heads, importance, pruning). The subcommands' own options live in path_cli,
circuit_cli, importance_cli and prune_cli; `DESCRIPTION` is the --help text, docs/heads.md
the guide.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

from multihead.cli_args import add_json, add_model, add_seed, add_threads, torch_threads
from multihead.errors import UsageError
from multihead.files import output_file
from multihead.heads.cli_common import (
    check_count,
    check_fit,
    check_pair_or_task,
    heat_maps,
    print_table_and_top,
    token_after,
)
from multihead.heads.importance_cli import prune_curve  # noqa: F401 (a public name of this module)
from multihead.interop.loaders import model_source

DESCRIPTION = """Which heads a model needs: activation patching, importance and pruning of its heads.

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

TOP = 10
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
    add_threads(s)

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
    add_threads(d)

    from multihead.heads.circuit_cli import add_circuit_arguments
    from multihead.heads.importance_cli import add_importance_arguments
    from multihead.heads.path_cli import add_path_arguments
    from multihead.heads.prune_cli import add_prune_arguments

    add_importance_arguments(sub)
    add_prune_arguments(sub)
    add_path_arguments(sub)
    add_circuit_arguments(sub)


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


def _run(model, inputs):
    """The logits of `model` (a loaded model's `.model`, or one a tool changed) on `inputs`."""
    import torch

    from multihead.interop.loaded import LoadedModel

    with torch.no_grad():  # a tokenizer's BatchEncoding is a Mapping, not a dict
        return LoadedModel.logits(model(**inputs) if isinstance(inputs, Mapping) else model(inputs))


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


def _check_length(loaded, length: int, limit: int | None) -> None:
    """--length L makes 2L tokens after the tokenizer's prefix (Gemma's <bos>): within the positions."""
    start = len(loaded.prefix_ids())
    if limit and 2 * length + start > limit:
        raise UsageError(f"--length {length} makes sequences of {2 * length + start} tokens and this model takes "
                         f"at most {limit} positions; give --length <= {(limit - start) // 2}")


def _one_pair(loaded, model, args):
    """(clean, corrupted, reference, metric, description) of --clean/--corrupted/--answer/--wrong."""
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

    check_count("--n", args.n, 1)
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
    check_count("--length", args.length, 2)
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
    check_pair_or_task(args, "scan", "ioi|induction", "scan")
    if args.task is not None:
        check_count("--n", args.n, 1)
        if args.task == "induction":
            check_count("--length", args.length, 2)
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

    check_count("--n", args.n, 1)
    check_count("--length", args.length, 2)
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
    print_table_and_top(r, "L{layer}H{head}: {value:.4f}")
    c = r.get("causal_check")
    if c:
        print(f"causal check: {c['how']} ablation (reference: {c['reference']}) on the clean inputs, metric "
              f"{c['metric_intact']:.4f} intact")
        for row in c["by_k"]:
            names = " ".join(f"L{a}H{b}" for a, b in row["heads"])
            print(f"  top {row['k']} ({names}): {row['ablated']:.4f}; {row['k']} random heads: median "
                  f"{row['random_median']:.4f} of {len(row['random'])} draws "
                  f"({', '.join(f'{v:.3f}' for v in row['random'])})")


def main(args) -> int:
    with torch_threads(args.threads):
        return _main(args)


def _main(args) -> int:
    cmd = args.heads_command
    if cmd == "path":
        from multihead.heads.path_cli import run_path

        return run_path(args)
    if cmd == "circuit":
        from multihead.heads.circuit_cli import run_circuit

        return run_circuit(args)
    if cmd == "importance":
        from multihead.heads.importance_cli import run_importance

        return run_importance(args)
    if cmd == "prune":
        from multihead.heads.prune_cli import run_prune

        return run_prune(args)
    if cmd == "scan":
        src, taken = model_source(args.model), {}
        png = output_file("--png", args.png, "scan.png", source=src, taken=taken)
        html = output_file("--html", args.html, "scan.html", source=src, taken=taken)
        r = _scan(args)
        task = f", {r['task']}" if r.get("task") else ""
        heat_maps(r, png, html, "scan", f"{r['model']}: patching {r['what']}{task}",
                  f"{r['model']}: patching {r['what']}, metric {r['metric']}; clean {r['metric_clean']:.3f}, "
                  f"corrupted {r['metric_corrupted']:.3f}")
        print(json.dumps(r, indent=1)) if args.json else _print_scan(r)
    elif cmd == "induction":
        png = output_file("--png", args.png, "induction.png", source=model_source(args.model))
        r = induction_study(args)
        if png:
            _induction_png(png, r)
            r["png"] = str(png)
        print(json.dumps(r, indent=1)) if args.json else _print_induction(r)
    return 0
