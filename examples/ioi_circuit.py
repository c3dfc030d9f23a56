"""The IOI circuit of SmolLM2-135M-Instruct, found the way Wang et al. (2022) found GPT-2 small's.

    python examples/ioi_circuit.py            # writes docs/heads-circuit/results.json and figures

Steps (`multihead.heads`; clean = an IOI prompt, corrupted = the same prompt with the
subject's second name replaced by the indirect object, metric logit(IO) - logit(S) at the
last token, mean over the prompts):

1. the direct effect of every head on the metric (`path_patch_scan(..., "logits")`), and
   the attention of the heads with the largest effects from the last token to the IO, S1
   and S2 positions: name movers (positive, attending to IO) and negative movers;
2. `path_patch_scan` to the name movers' queries: the S-inhibition candidates;
3. `path_patch_scan` to the S-inhibition heads' keys and values: the induction and
   duplicate-token candidates (the scan takes the key/value head an S-inhibition head
   reads, shared by its group of query heads);
4. faithfulness: the metric with every head outside the circuit knocked out, against the
   whole model and against the circuit itself knocked out. Knocked out = its z taken
   from the ABC prompt of the same pair (the same template, place, object and first two
   names, a third name at S2: no name repeats), a one-sample stand-in for Wang et al.'s
   mean over the ABC distribution; also reported with multihead's token-mean ablation.

A head joins a class when its effect is at least THRESHOLD of the clean - corrupted gap
(at most MAX_PER_CLASS per class, largest first); name movers must also attend to IO with at
least MIN_ATTENTION and more than to S1 and S2. Heads whose direct effect passes the threshold
without attending so to IO are kept as a class of their own ("other direct").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from multihead import heads
from multihead.heads import tasks
from multihead.interop.loaders import load_model

THRESHOLD = 0.1
MAX_PER_CLASS = 5
MIN_ATTENTION = 0.2  # a name mover's attention from the last token to IO, at least
OUT = Path(__file__).resolve().parent.parent / "docs" / "heads-circuit"


def positions(task) -> dict[str, list[int]]:
    """Per prompt: where IO, S1 and S2 stand in the clean ids, and the last real token."""
    out: dict[str, list[int]] = {"IO": [], "S1": [], "S2": [], "end": task.position.tolist()}
    for ids, io, s in zip(task.clean["input_ids"].tolist(), task.answer.tolist(), task.wrong.tolist()):
        out["IO"].append(ids.index(io))
        first = ids.index(s)
        out["S1"].append(first)
        out["S2"].append(ids.index(s, first + 1))
    return out


def effects(table: torch.Tensor, base: float) -> list[tuple[int, int, float]]:
    return [(layer, h, float(table[layer, h]) - base) for layer in range(table.shape[0])
            for h in range(table.shape[1])]


def pick(cells, span: float, sign: float = 1.0, keep=lambda layer, h: True) -> list[tuple[int, int]]:
    ranked = sorted((c for c in cells if sign * c[2] >= THRESHOLD * abs(span) and keep(c[0], c[1])),
                    key=lambda c: -sign * c[2])
    return [(layer, h) for layer, h, _ in ranked[:MAX_PER_CLASS]]


def attention_to(model, task, where, pairs) -> dict[str, dict[str, float]]:
    """Mean attention of each head from the last token to IO, S1 and S2."""
    rec = heads.record(model, task.clean, what=("pattern",), layers=sorted({layer for layer, _ in pairs}))
    rows = torch.arange(len(task))
    out = {}
    for layer, h in pairs:
        p = rec["pattern", layer][:, h]  # (N, T, S)
        last = p[rows, torch.tensor(where["end"])]  # (N, S)
        out[f"{layer}.{h}"] = {k: round(float(last[rows, torch.tensor(where[k])].mean()), 4)
                               for k in ("IO", "S1", "S2")}
    return out


def knocked_out(model, task, ablated, how: str) -> float:
    """The metric on the clean prompts with `ablated` heads knocked out."""
    if not ablated:
        with torch.no_grad():
            return float(task.metric(model(**task.clean).logits))
    reference = heads.record(model, task.reference)
    with torch.no_grad(), heads.ablate(model, ablated, how=how, reference=reference):
        return float(task.metric(model(**task.clean).logits))


def heat(ax, table, base: float, title: str, marks=()):
    d = (table - base).numpy()
    lim = float(abs(d).max()) or 1.0
    im = ax.imshow(d, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for layer, h in marks:
        ax.add_patch(__import__("matplotlib.patches", fromlist=["Rectangle"]).Rectangle(
            (h - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.2))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    return im


def figures(out: Path, r: dict, tables: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    base = r["metric_corrupted"]
    fig = Figure(figsize=(15, 6.5))
    axes = fig.subplots(1, 4)
    panels = [("direct", "direct effect (receivers='logits')", r["classes"]["name_movers"] +
               r["classes"]["negative_movers"] + r["classes"]["other_direct"]),
              ("s_inhibition", "via the name movers' queries", r["classes"]["s_inhibition"]),
              ("induction_k", "via the S-inhibition heads' keys", r["classes"]["induction_duplicate"]),
              ("induction_v", "via the S-inhibition heads' values", r["classes"]["induction_duplicate"])]
    for ax, (key, title, marks) in zip(axes, panels):
        im = heat(ax, tables[key], base, title, [tuple(m) for m in marks])
        fig.colorbar(im, ax=ax, shrink=0.6)
    fig.suptitle(f"{r['model']}: path patching on {r['n']} IOI pairs, metric - corrupted (boxes: the heads picked)",
                 fontsize=10)
    fig.subplots_adjust(wspace=0.45)
    fig.savefig(out / "paths.png", dpi=90, bbox_inches="tight")

    att = r["attention"]
    names = list(att)
    fig = Figure(figsize=(1 + 0.7 * len(names), 3.2))
    ax = fig.subplots()
    for i, k in enumerate(("IO", "S1", "S2")):
        ax.bar([j + (i - 1) * 0.27 for j in range(len(names))], [att[n][k] for n in names], width=0.27, label=k)
    ax.set_xticks(range(len(names)), names, rotation=45, fontsize=8)
    ax.set_ylabel("attention from the last token")
    ax.set_title("the heads with the largest direct effects", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(out / "attention.png", dpi=90, bbox_inches="tight")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8, help="IOI pairs (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT, help=f"results folder (default {OUT})")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    loaded = load_model("smollm2")
    model = loaded.model
    task = tasks.ioi(args.n, seed=args.seed, tokenizer=loaded.tokenizer)
    where = positions(task)
    with torch.no_grad():
        m_clean = float(task.metric(model(**task.clean).logits))
        m_corr = float(task.metric(model(**task.corrupted).logits))
    span = m_clean - m_corr
    seconds, tables = {}, {}

    def scan(key, receivers, via="q"):
        t0 = time.perf_counter()
        tables[key] = heads.path_patch_scan(model, task.clean, task.corrupted, task.metric, receivers, via=via)
        seconds[key] = round(time.perf_counter() - t0, 1)
        return effects(tables[key], m_corr)

    direct = scan("direct", "logits")
    top = sorted(direct, key=lambda c: -abs(c[2]))[:8]
    attention = attention_to(model, task, where, [(layer, h) for layer, h, _ in top])

    def to_io(layer, h):
        a = attention[f"{layer}.{h}"]
        return a["IO"] >= MIN_ATTENTION and a["IO"] > max(a["S1"], a["S2"])
    if not all(f"{layer}.{h}" in attention for layer, h, e in direct if e >= THRESHOLD * abs(span)):
        extra = [(layer, h) for layer, h, e in direct if e >= THRESHOLD * abs(span)]
        attention.update(attention_to(model, task, where, extra))
    movers = pick(direct, span, keep=to_io)
    if not movers:
        raise SystemExit(f"no head moves the metric by {THRESHOLD:.0%} of clean - corrupted directly while attending "
                         f"to IO; the largest direct effects: {top}, their attention: {attention}")
    negative = pick(direct, span, sign=-1.0)
    other = pick(direct, span, keep=lambda layer, h: (layer, h) not in movers)
    s_inh = pick(scan("s_inhibition", movers, "q"), span, keep=lambda layer, h: (layer, h) not in movers + other)
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    kv = sorted({(layer, h // G) for layer, h in s_inh})
    ind_k = scan("induction_k", kv, "k")
    ind_v = scan("induction_v", kv, "v")
    both = {(layer, h): max(ek, ev, key=abs) for (layer, h, ek), (_, _, ev) in zip(ind_k, ind_v)}
    induction = pick([(layer, h, e) for (layer, h), e in both.items()], span,
                     keep=lambda layer, h: (layer, h) not in s_inh + movers)
    circuit = sorted(set(movers + negative + other + s_inh + induction))
    everything = [(layer, h) for layer in range(tables["direct"].shape[0]) for h in range(tables["direct"].shape[1])]
    outside = [p for p in everything if p not in circuit]
    faith = {}
    for how in ("resample", "mean"):
        faith[how] = {"model": knocked_out(model, task, [], how),
                      "circuit_only": knocked_out(model, task, outside, how),
                      "circuit_knocked_out": knocked_out(model, task, circuit, how)}
        faith[how]["kept_by_circuit"] = faith[how]["circuit_only"] / faith[how]["model"]
        faith[how]["kept_without_circuit"] = faith[how]["circuit_knocked_out"] / faith[how]["model"]
    r = {"model": getattr(loaded, "name", "smollm2"), "n": len(task), "seed": args.seed,
         "threshold": THRESHOLD, "max_per_class": MAX_PER_CLASS, "min_attention": MIN_ATTENTION,
         "circuit": [list(p) for p in circuit],
         "metric": "logit(IO) - logit(S) at the last token, mean over the pairs",
         "metric_clean": m_clean, "metric_corrupted": m_corr,
         "prompts": [{"clean": a, "corrupted": b, "abc": c} for a, b, c in
                     zip(task.texts, task.corrupted_texts, task.reference_texts)],
         "classes": {"name_movers": [list(p) for p in movers], "negative_movers": [list(p) for p in negative],
                     "other_direct": [list(p) for p in other],
                     "s_inhibition": [list(p) for p in s_inh], "s_inhibition_kv_heads": [list(p) for p in kv],
                     "induction_duplicate": [list(p) for p in induction]},
         "effects": {key: {f"{layer}.{h}": round(float(t[layer, h]) - m_corr, 4) for layer in range(t.shape[0])
                           for h in range(t.shape[1])} for key, t in tables.items()},
         "attention": attention, "faithfulness": faith, "seconds": seconds,
         "tables": {key: [[round(float(x), 6) for x in row] for row in t] for key, t in tables.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(r, indent=1) + "\n")
    figures(args.out, r, tables)
    return r


if __name__ == "__main__":
    res = main()
    print(json.dumps({k: res[k] for k in ("metric_clean", "metric_corrupted", "classes", "faithfulness", "seconds")},
                     indent=1))
