"""`multihead heads circuit`: a circuit of edges found automatically (EAP or EAP-IG), its
faithfulness curve, across torchrun's processes when launched under it. `DESCRIPTION` is
the --help text (read by `documented_parser`); docs/heads.md the guide.
"""

from __future__ import annotations

import argparse
import gc
import html
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from multihead.cli_args import add_json, add_model, add_seed, add_threads
from multihead.errors import UsageError
from multihead.files import atomic_path, output_file, write_text
from multihead.heads.cli_common import check_count, documented_parser
from multihead.interop.loaders import model_source

DESCRIPTION = """`multihead heads circuit`: a circuit of edges found automatically (EAP or EAP-IG) and its faithfulness.

Every edge of the model's graph (the input, each head and each MLP sending to each later
head's query, key and value, each MLP and the logits) is scored by edge attribution
patching (`--method eap`, Syed et al., 2023) or its integrated-gradients form (`--method
eap-ig`, Hanna et al., 2024); then the top edges at each fraction of the graph are patched
exactly (every other edge carrying its corrupted value) for the faithfulness curve, and
its areas CPR and CMD (the Mechanistic Interpretability Benchmark's scores). The task is
Wang et al.'s IOI: logit(IO) - logit(S) at the last token.

examples:
  multihead heads circuit --task ioi --n 20 --method eap
  multihead heads circuit --model smollm2 --task ioi --n 100 --method eap-ig --steps 5 --png circuit.png --json
  torchrun --nproc-per-node 4 -m -- multihead heads circuit --n 100 --threads 4 --json

across processes: under torchrun (WORLD_SIZE > 1 in the environment) every rank joins one gloo
group from torchrun's variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), loads the model,
draws the same prompts and runs its share of them (edge_scores' and faithfulness_curve's
group=: the results are one process's, to rounding); rank 0 alone prints and writes --png and
--html. On CPU give each rank --threads so that the ranks together use the cores once. The
`--` after torchrun's -m keeps torchrun from reading --n as an abbreviation of its own flags.
"""

N_PAIRS = 20
TOP = 20
DRAWN = 40


def add_circuit_arguments(subparsers) -> argparse.ArgumentParser:
    """Add the `circuit` subcommand to `multihead heads`' subparsers; returns its parser."""
    p = documented_parser(subparsers, "circuit",
                          "a circuit of edges by EAP / EAP-IG, and its faithfulness curve (CPR, CMD)", DESCRIPTION)
    add_model(p, "smollm2", decoder=True, lab=False)
    p.add_argument("--task", choices=["ioi"], default="ioi",
                   help="ioi: indirect-object pairs of Wang et al. (2022), metric logit(IO) - logit(S) (default)")
    p.add_argument("--n", type=int, default=N_PAIRS, help=f"prompt pairs (default {N_PAIRS})")
    add_seed(p, "the draw of prompts (default 0)")
    p.add_argument("--method", choices=["eap", "eap-ig"], default="eap-ig", help="edge scores (default eap-ig)")
    p.add_argument("--steps", type=int, default=5, help="--method eap-ig: interpolation steps (default 5)")
    p.add_argument("--top", type=int, default=TOP, help=f"how many top edges to list (default {TOP})")
    p.add_argument("--edges", type=int, default=DRAWN, help=f"edges in the drawn circuit (default {DRAWN})")
    p.add_argument("--png", metavar="PATH", help="write the circuit (nodes by layer) and the curve as a PNG")
    p.add_argument("--html", metavar="PATH", help="write the circuit and the curve as a self-contained HTML page")
    add_json(p)
    add_threads(p)
    return p


def _check(args) -> None:
    check_count("--n", args.n, 1)
    if args.steps < 1 or args.steps > 1000:
        raise UsageError(f"--steps must be between 1 and 1000; received {args.steps}")
    for flag in ("top", "edges"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1; received {getattr(args, flag)}")


@contextmanager
def world() -> Iterator[object | None]:
    """The ranks this command runs on: None alone (WORLD_SIZE unset or 1); under torchrun the group of
    its ranks: the default group where the caller joined one already, else a gloo group joined from
    torchrun's environment for the command and left after it."""
    size = os.environ.get("WORLD_SIZE", "1")
    try:
        n = int(size)
    except ValueError:
        raise UsageError(f"WORLD_SIZE must be the number of processes (torchrun sets it); received {size!r}") from None
    if n <= 1:
        yield None
        return
    import torch.distributed as dist

    joined = not dist.is_initialized()
    if joined:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK") if not os.environ.get(v)]
        if missing:
            raise UsageError(f"WORLD_SIZE is {n} but {', '.join(missing)} is not set: run the command under "
                             "torchrun (torchrun --nproc-per-node N -m -- multihead heads circuit ...), or unset "
                             "WORLD_SIZE for one process")
        dist.init_process_group("gloo")  # env://: torchrun's variables
    try:
        if dist.get_world_size() != n:
            raise UsageError(f"WORLD_SIZE is {n} but the process group this command joined has "
                             f"{dist.get_world_size()} ranks")
        yield dist.group.WORLD
        if joined:  # every rank past its last collective before any closes its connections (a rank that
            dist.barrier()  # closes them while another still reads from them aborts that one)
    finally:
        if joined:
            dist.destroy_process_group()
            # a group that something still reaches (a cycle of closures, a traceback) keeps gloo's
            # worker threads alive to the interpreter's exit, where they abort the process (SIGABRT,
            # "terminate called without an active exception"): free it while the interpreter runs
            gc.collect()


def circuit_result(args, group=None) -> dict:
    """The result of `multihead heads circuit` as a dict (what --json prints); `group`: the ranks that
    share the prompts (None: this process alone)."""
    from multihead import heads
    from multihead.heads import tasks
    from multihead.heads.edge_graph import edge_name
    from multihead.interop.loaded import ModelError
    from multihead.interop.loaders import load_model

    _check(args)
    loaded = load_model(args.model)
    refusal = UsageError(f"heads circuit reads next-token logits; --model {args.model} is not a transformers causal "
                         "LM (use --model smollm2, the default)")
    if loaded.why_not_lm() is not None:
        raise refusal
    try:  # IOI's names need a word-level tokenizer (a lab checkpoint's has none)
        tokenizer = loaded.word_tokenizer("heads circuit")
    except ModelError:
        raise refusal from None
    try:
        heads.edges(loaded.model)
    except (TypeError, ValueError) as err:
        raise UsageError(f"--model {args.model}: {err}") from None
    try:
        task = tasks.ioi(args.n, seed=args.seed, tokenizer=tokenizer)
    except ValueError as err:
        raise UsageError(f"--task ioi on this model: {err}") from None
    t0 = time.perf_counter()
    scores = heads.edge_scores(loaded.model, task.clean, task.corrupted, task.metric, method=args.method,
                               steps=args.steps, group=group)
    t1 = time.perf_counter()
    curve = heads.faithfulness_curve(loaded.model, task.clean, task.corrupted, task.metric, scores, group=group)
    t2 = time.perf_counter()
    top = scores.top(max(args.top, args.edges))
    return {"model": getattr(loaded, "name", args.model), "task": "ioi", "n": len(task),
            "metric": "logit(IO) - logit(S) at the last token, mean over pairs", "method": args.method,
            "steps": scores.steps, "edges_total": len(scores),
            "top": [{"edge": edge_name(e), "score": s} for e, s in top[:args.top]],
            "drawn": [{"edge": edge_name(e), "score": s} for e, s in top[:args.edges]],
            "curve": curve, "seconds": {"scores": round(t1 - t0, 2), "curve": round(t2 - t1, 2)},
            "processes": 1 if group is None else _world_size(group)}


def _rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _world_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _layout(drawn: list[dict]) -> tuple[dict, list]:
    """Node -> (x, y) with y the layer (input at the bottom, logits at the top), and the edges."""
    from multihead.heads.edge_graph import parse_edge

    def key(node):
        if node == "input":
            return (-1, 0, "input")
        if node == "logits":
            return (10 ** 6, 0, "logits")
        if node[0] == "mlp":
            return (node[1], 2, f"m{node[1]}")
        if len(node) == 2:
            return (node[0], 0, f"a{node[0]}.h{node[1]}")
        return (node[0], 1, f"a{node[0]}.h{node[1]}" if node[2] == "q" else f"a{node[0]}.g{node[1]}")
    edges, nodes = [], {}
    for d in drawn:
        s, r = parse_edge(d["edge"])
        ks, kr = key(s), key(r)
        nodes[ks[2]], nodes[kr[2]] = ks, kr
        edges.append((ks[2], kr[2], d["score"], r[2] if isinstance(r, tuple) and len(r) == 3 else ""))
    levels = sorted({k[0] for k in nodes.values()})
    pos = {}
    for y, level in enumerate(levels):
        row = sorted((k for k in nodes.values() if k[0] == level), key=lambda k: (k[1], k[2]))
        for x, k in enumerate(row):
            pos[k[2]] = (x - (len(row) - 1) / 2, y)
    return pos, edges


def _png(path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pos, edges = _layout(r["drawn"])
    fig = Figure(figsize=(13, 7))
    FigureCanvasAgg(fig)
    ax, cx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    lim = max(abs(e[2]) for e in edges) or 1.0
    for a, b, s, _via in edges:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.annotate("", (x1, y1), (x0, y0), arrowprops={"arrowstyle": "->", "color": "tab:red" if s > 0 else
                                                         "tab:blue", "lw": 0.5 + 3 * abs(s) / lim, "alpha": 0.7})
    for name, (x, y) in pos.items():
        ax.text(x, y, name, ha="center", va="center", fontsize=7, bbox={"boxstyle": "round", "fc": "white"})
    ax.set_xlim(min(p[0] for p in pos.values()) - 1, max(p[0] for p in pos.values()) + 1)
    ax.set_ylim(-0.5, max(p[1] for p in pos.values()) + 0.5)
    ax.axis("off")
    ax.set_title(f"{r['model']}: top {len(edges)} edges by {r['method']} (red raises the metric)", fontsize=9)
    c = r["curve"]
    cx.plot(c["fractions"], c["faithfulness"], "o-")
    cx.set_xscale("log")
    cx.axhline(1, color="gray", lw=0.5)
    cx.set_xlabel("fraction of edges kept")
    cx.set_ylabel("faithfulness")
    cx.set_title(f"CPR {c['cpr']:.3f}, CMD {c['cmd']:.3f} ({r['n']} pairs)", fontsize=9)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")


def _html(path, r: dict) -> None:
    pos, edges = _layout(r["drawn"])
    xs = [p[0] for p in pos.values()]
    lo, ys = min(xs), max(p[1] for p in pos.values())
    sx, sy = 90, 60

    def at(name):
        x, y = pos[name]
        return 40 + (x - lo) * sx, 30 + (ys - y) * sy
    lim = max(abs(e[2]) for e in edges) or 1.0
    lines = [f'<line x1="{at(a)[0]:.0f}" y1="{at(a)[1]:.0f}" x2="{at(b)[0]:.0f}" y2="{at(b)[1]:.0f}" '
             f'stroke="{"#c33" if s > 0 else "#36c"}" stroke-width="{0.5 + 3 * abs(s) / lim:.2f}" opacity="0.7">'
             f'<title>{html.escape(a)}->{html.escape(b)}{html.escape(f"<{via}>") if via else ""}: {s:.4g}</title>'
             f'</line>' for a, b, s, via in edges]
    labels = [f'<text x="{at(n)[0]:.0f}" y="{at(n)[1]:.0f}" font-size="10" text-anchor="middle">{html.escape(n)}'
              '</text>' for n in pos]
    w, h = 80 + (max(xs) - lo) * sx, 60 + ys * sy
    c = r["curve"]
    rows = "".join(f"<tr><td>{p}</td><td>{k}</td><td>{f:.4f}</td></tr>"
                   for p, k, f in zip(c["fractions"], c["edges_kept"], c["faithfulness"]))
    title = html.escape(f"{r['model']}: {r['method']} circuit, {r['n']} IOI pairs")
    write_text(path, f"<!doctype html><meta charset='utf-8'><title>{title}</title><h1>{title}</h1>"
                     f"<p>CPR {c['cpr']:.4f}, CMD {c['cmd']:.4f}; top {len(edges)} edges drawn (red raises the "
                     f"metric)</p><svg width='{w:.0f}' height='{h:.0f}'>{''.join(lines)}{''.join(labels)}</svg>"
                     f"<table><tr><th>fraction</th><th>edges</th><th>faithfulness</th></tr>{rows}</table>")


def run_circuit(args) -> int:
    """Run `multihead heads circuit` from parsed arguments; 0 on success (mistakes raise UsageError)."""
    src, taken = model_source(args.model), {}
    png = output_file("--png", args.png, "circuit.png", source=src, taken=taken)
    page = output_file("--html", args.html, "circuit.html", source=src, taken=taken)
    with world() as group:
        r = circuit_result(args, group)
        reports = group is None or _rank(group) == 0  # every rank holds the same result: rank 0 reports it
        del group  # the group is destroyed as the block ends: nothing here may keep it alive
    if not reports:
        return 0
    if png:
        _png(png, r)
        r["png"] = str(png)
    if page:
        _html(page, r)
        r["html"] = str(page)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    c = r["curve"]
    print(f"{r['model']}: {r['method']} edge scores on {r['n']} IOI pairs ({r['edges_total']} edges); "
          f"clean {c['metric_clean']:.4f}, corrupted {c['metric_corrupted']:.4f}")
    print("top edges:")
    for t in r["top"]:
        print(f"  {t['edge']}: {t['score']:+.4f}")
    print("faithfulness curve:")
    for p, k, f in zip(c["fractions"], c["edges_kept"], c["faithfulness"]):
        print(f"  {p:>6g} ({k} edges): {f:.4f}")
    print(f"CPR {c['cpr']:.4f}, CMD {c['cmd']:.4f}; {r['seconds']['scores']} s scores, {r['seconds']['curve']} s curve")
    return 0
