"""IOI circuits found automatically: EAP, EAP-IG and random edge scores, their faithfulness curves.

    python examples/ioi_edges.py --n 100      # writes docs/heads-circuits-auto/results.json and figures
    python examples/ioi_edges.py --hand-n 8 100   # adds the hand circuit on 8 and 100 pairs
    python examples/ioi_edges.py --model gemma3 --n 100   # docs/heads-circuits-auto/gemma3/ (no hand circuit)

Steps (`multihead.heads`, prompts `tasks.ioi(n, seed=0)`, metric logit(IO) - logit(S) at the
last token, mean over pairs):

1. edge scores of every edge of the graph by EAP and by EAP-IG (5 steps), and random scores
   (|N(0, 1)|, seed 0) as the baseline;
2. each one's faithfulness curve (`faithfulness_curve`, the default 10 fractions), CPR and CMD
   with 95% bootstrap intervals over the prompts (1,000 resamples; the scores are fixed);
3. (SmolLM2) the hand circuit of docs/heads-circuit.md (its 8 heads) as edges: those among its heads
   (a head to a later circuit head's query, or to the key/value head a later circuit head
   reads) and from its heads to the logits; also with every edge from the input and into
   and out of the MLPs added. Its faithfulness, and where EAP-IG's curve reaches it; and which
   senders (heads, MLPs) the top EAP-IG edges hold where the curve rises.

Results are saved after each step, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from multihead import heads
from multihead.files import write_json
from multihead.heads import tasks
from multihead.heads.edge_graph import Graph, edge_name, node_name
from multihead.interop.loaders import load_model

HAND = [(23, 3), (29, 1), (23, 0), (23, 2), (24, 4), (29, 0), (20, 0), (17, 4)]
OUT = Path(__file__).resolve().parent.parent / "docs" / "heads-circuits-auto"
MODELS = {"smollm2": ("SmolLM2-135M-Instruct", OUT), "gemma3": ("gemma-3-270m", OUT / "gemma3")}


def hand_edges(edges: list[tuple], G: int, wide: bool, fed: bool = False) -> list[tuple]:
    """The hand circuit's edges; `fed`: with the input's edges into its receivers; `wide`: with
    every edge from the input and into and out of the MLPs too."""
    hs = set(HAND)
    reads = {(h[0], h[1] // G) for h in HAND}  # (layer, KV head) a circuit head reads

    def inside(node) -> bool:
        if node == "logits":
            return True
        if len(node) == 3:
            return (node[0], node[1]) in hs if node[2] == "q" else (node[0], node[1]) in reads
        return tuple(node) in hs

    out = []
    for s, r in edges:
        mlp = (s != "input" and s[0] == "mlp") or (r != "logits" and r[0] == "mlp")
        if (s in hs or ((wide or fed) and s == "input") or (wide and mlp)) and (inside(r) or (wide and mlp)):
            out.append((s, r))
    return out


def hand(model, task, E, G, res: dict, save, folder: Path) -> None:
    """The hand circuit's faithfulness (three readings of it), and which heads the top edges hold."""
    c = res["eap-ig"]["curve"]
    for key, wide, fed in (("hand", False, False), ("hand_input", False, True), ("hand_wide", True, False)):
        keep = hand_edges(E, G, wide, fed)
        t = time.perf_counter()
        m = heads.edge_patch(model, task.clean, task.corrupted, task.metric, keep)
        f = (m - c["metric_corrupted"]) / (c["metric_clean"] - c["metric_corrupted"])
        res[key] = {"edges": len(keep), "fraction": len(keep) / len(E), "metric": m, "faithfulness": f,
                    "seconds": round(time.perf_counter() - t, 1)}
        save()
    cfg = model.config
    graph = Graph(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    scores = heads.EdgeScores(graph, torch.load(folder / "scores_eap-ig.pt"), "eap-ig", 5)
    res["input->m0"] = {}  # the edge whose two scores differ most in rank (the text of the docs)
    for method in ("eap", "eap-ig"):
        s = heads.EdgeScores(graph, torch.load(folder / f"scores_{method}.pt"), method, 1)
        names = [edge_name(e) for e, _ in s.top(len(s))]
        res["input->m0"][method] = {"score": s["input->m0"], "rank": names.index("input->m0") + 1}
    res["senders_in_top"] = {}
    for k in c["edges_kept"][2:5]:  # where the curve rises
        weight: dict = {}
        for (snd, _), v in scores.top(k):
            weight[node_name(snd)] = weight.get(node_name(snd), 0.0) + abs(v)
        ranked = sorted(weight.items(), key=lambda kv: -kv[1])
        res["senders_in_top"][str(k)] = {
            "top": [[n, round(v, 4)] for n, v in ranked[:15]],
            "hand_heads_missing": [f"a{h[0]}.h{h[1]}" for h in HAND if f"a{h[0]}.h{h[1]}" not in weight],
            "heads": sum(1 for n in weight if n.startswith("a")), "mlps": sum(1 for n in weight if n.startswith("m"))}
    save()


def hand_at(model, lm, n: int) -> dict:
    """The hand circuit's three readings on n pairs (no scores needed: edge patching only)."""
    task = tasks.ioi(n, seed=0, tokenizer=lm.tokenizer)
    E = heads.edges(model)
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():
        hi, lo = float(task.metric(model(**task.clean).logits)), float(task.metric(model(**task.corrupted).logits))
    out = {"n": n, "metric_clean": hi, "metric_corrupted": lo}
    for key, wide, fed in (("hand", False, False), ("hand_input", False, True), ("hand_wide", True, False)):
        m = heads.edge_patch(model, task.clean, task.corrupted, task.metric, hand_edges(E, G, wide, fed))
        out[key] = {"metric": m, "faithfulness": (m - lo) / (hi - lo)}
    return out


def curve(model, task, scores, label: str, log: dict) -> dict:
    def per_row(last):  # (N, vocab) at each prompt's last token
        rows = torch.arange(last.shape[0])
        return last[rows, task.answer] - last[rows, task.wrong]
    t = time.perf_counter()
    c = heads.faithfulness_curve(model, task.clean, task.corrupted, task.metric, scores, bootstrap=1000,
                                 per_row=per_row)
    log[f"curve_{label}_seconds"] = round(time.perf_counter() - t, 1)
    return c


def plot(folder: Path) -> None:
    """curves.png from results.json: the three curves and the hand circuit."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from multihead.files import atomic_path, read_json

    res = read_json(folder / "results.json")
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, label in (("eap-ig", "EAP-IG (5 steps)"), ("eap", "EAP"), ("random", "random")):
        if key in res:
            c = res[key]["curve"]
            ax.plot(c["fractions"], c["faithfulness"], "o-", label=f"{label}: CPR {c['cpr']:.3f}, CMD {c['cmd']:.3f}")
    for key, marker, label in (("hand", "*", "hand circuit (8 heads)"), ("hand_wide", "P", "hand + input + MLPs")):
        if key in res:
            ax.plot([res[key]["fraction"]], [res[key]["faithfulness"]], marker, ms=12, label=label)
    ax.set_xscale("log")
    ax.axhline(1, color="gray", lw=0.5)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("fraction of edges kept (largest |score| first)")
    ax.set_ylabel("faithfulness (m - m_corrupted) / (m_clean - m_corrupted)")
    ax.set_title(f"{res['model']}, IOI, {res['n']} pairs, {res['edges_total']} edges", fontsize=9)
    ax.legend(fontsize=7)
    with atomic_path(folder / "curves.png") as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--out", type=Path, help="the folder of results.json (default: per model, under "
                                             "docs/heads-circuits-auto)")
    ap.add_argument("--plot", action="store_true", help="only draw curves.png from the saved results.json")
    ap.add_argument("--hand", action="store_true", help="only (re)compute the hand circuit's entries of results.json")
    ap.add_argument("--hand-n", type=int, nargs="*", help="only add the hand circuit's faithfulness on these "
                                                          "numbers of pairs to results.json")
    args = ap.parse_args()
    name, default_out = MODELS[args.model]
    args.out = args.out or default_out
    if args.model != "smollm2" and (args.hand or args.hand_n):
        ap.error("the hand circuit (docs/heads-circuit.md) is SmolLM2's; --hand and --hand-n need --model smollm2")
    if args.hand_n:
        from multihead.files import read_json

        lm = load_model("smollm2")
        res = read_json(args.out / "results.json")
        res.setdefault("hand_at_n", {})
        for n in args.hand_n:
            res["hand_at_n"][str(n)] = hand_at(lm.model, lm, n)
            write_json(args.out / "results.json", res)
            print(json.dumps(res["hand_at_n"][str(n)]), flush=True)
        return
    if args.plot:
        plot(args.out)
        return
    if args.hand:
        from multihead.files import read_json

        lm = load_model("smollm2")
        res = read_json(args.out / "results.json")
        task = tasks.ioi(res["n"], seed=0, tokenizer=lm.tokenizer)
        G = lm.model.config.num_attention_heads // lm.model.config.num_key_value_heads
        path = args.out / "results.json"
        hand(lm.model, task, heads.edges(lm.model), G, res, lambda: write_json(path, res), args.out)
        plot(args.out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    lm = load_model(args.model)
    model = lm.model
    task = tasks.ioi(args.n, seed=0, tokenizer=lm.tokenizer)
    E = heads.edges(model)
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    res: dict = {"model": name, "task": "ioi", "n": len(task), "edges_total": len(E),
                 "torch_threads": torch.get_num_threads(), "seconds": {}}
    path = args.out / "results.json"

    def save():
        write_json(path, res)
    for method, steps in (("eap", 1), ("eap-ig", 5)):
        t = time.perf_counter()
        s = heads.edge_scores(model, task.clean, task.corrupted, task.metric, method=method, steps=steps)
        res["seconds"][f"scores_{method}"] = round(time.perf_counter() - t, 1)
        res[method] = {"top": [{"edge": edge_name(e), "score": v} for e, v in s.top(50)]}
        res[method]["curve"] = curve(model, task, s, method, res["seconds"])
        torch.save(s.matrix, args.out / f"scores_{method}.pt")
        save()
    g = torch.Generator().manual_seed(0)
    rand = dict(zip(E, torch.randn(len(E), generator=g, dtype=torch.float64).abs().tolist()))
    res["random"] = {"curve": curve(model, task, rand, "random", res["seconds"])}
    save()
    if args.model == "smollm2":
        hand(model, task, E, G, res, save, args.out)
    plot(args.out)
    print(json.dumps({k: v for k, v in res.items() if k not in ("eap", "eap-ig")}, indent=1))


if __name__ == "__main__":
    main()
