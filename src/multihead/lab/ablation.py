"""The causal check of `lab induction` (Olsson et al., 2022, "In-context Learning and
Induction Heads", section on ablations): do the heads inspect names matter?

Each head is zero-ablated alone (`multihead.heads.ablate`: its output z is 0) and the
held-out `A B ... A -> B` accuracy measured; then the reported previous-token and
induction heads are ablated together (the circuit). If the roles are right, ablating
either of them, and above all both, should cost the most accuracy.
"""

from __future__ import annotations

from pathlib import Path

import torch

from multihead import heads


def _accuracy(model, held_out, ablated: list[tuple[int, int]]) -> float:
    x, y, m = held_out
    with heads.ablate(model, ablated), torch.no_grad():
        logits = model(x)
    return float((logits.argmax(-1) == y)[m].float().mean())


def ablation_check(model, held_out, r: dict) -> dict:
    """{"accuracy": [[layer][head]] with that one head zero-ablated, "circuit_accuracy": with
    the reported previous-token and induction heads both ablated, "baseline": with none,
    "circuit": the two heads; when several induction-layer heads score above 0.5 on prefix
    matching, "induction_heads" and "induction_heads_accuracy" with all of them ablated}."""
    dev = next(model.parameters()).device
    held_out = tuple(t.to(dev) for t in held_out)
    cfg = model.cfg
    per_head = [[_accuracy(model, held_out, [(layer, h)]) for h in range(cfg.n_heads)]
                for layer in range(cfg.n_layers)]
    p, i = r["previous_token_head"], r["induction_head"]
    circuit = [(p["layer"], p["head"]), (i["layer"], i["head"])]
    out = {"accuracy": per_head, "circuit_accuracy": _accuracy(model, held_out, circuit),
           "baseline": _accuracy(model, held_out, []), "circuit": [list(c) for c in circuit]}
    # The induction role is often shared by several heads, each able to stand in for the
    # others: then ablating one costs nothing, and what matters is all of them together.
    scores = r["evals"][-1]["induction"][i["layer"]] if r.get("evals") else []
    shared = [(i["layer"], h) for h, sc in enumerate(scores) if sc > 0.5]
    if len(shared) > 1:
        out["induction_heads"] = [list(x) for x in shared]
        out["induction_heads_accuracy"] = _accuracy(model, held_out, shared)
    return out


def ablation_line(r: dict) -> str:
    """One sentence for the summary: what ablating the named heads costs, against the others."""
    ab = r["ablation"]
    acc = ab["accuracy"]
    drops = sorted(((ab["baseline"] - acc[layer][h], layer, h) for layer in range(len(acc))
                    for h in range(len(acc[layer]))), reverse=True)
    (pl, ph), (il, ih) = ab["circuit"]
    top = drops[0]
    named = {(pl, ph), (il, ih)}
    verdict = "the induction head costs the most" if (top[1], top[2]) == (il, ih) else \
        "the previous-token head costs the most" if (top[1], top[2]) == (pl, ph) else \
        f"head {top[1]}.{top[2]}, not a named one, costs the most"
    rest = [d for d in drops if (d[1], d[2]) not in named]
    worst_other = f"; no other head costs more than {100 * rest[0][0]:.1f} points" if rest else ""
    shared = ""
    if "induction_heads" in ab:
        names = ", ".join(f"{a}.{b}" for a, b in ab["induction_heads"])
        shared = (f" Without all {len(ab['induction_heads'])} heads that score above 0.5 on prefix matching "
                  f"({names}): {100 * ab['induction_heads_accuracy']:.1f}%.")
    return (f"Ablating heads (zeroing their outputs): accuracy {100 * ab['baseline']:.1f}% with none; "
            f"{100 * acc[pl][ph]:.1f}% without the previous-token head {pl}.{ph}, {100 * acc[il][ih]:.1f}% without "
            f"the induction head {il}.{ih}, {100 * ab['circuit_accuracy']:.1f}% without both: {verdict}"
            f"{worst_other}.{shared}")


def plot_ablation(res: dict, path: Path) -> str:
    """A layer x head grid of the accuracy with each head ablated, the named heads outlined."""
    from multihead.lab.plots import pyplot, save_figure

    plt = pyplot()
    ab = res["results"]["ablation"]
    acc = torch.tensor(ab["accuracy"]) * 100
    fig, ax = plt.subplots(figsize=(1.5 + 0.6 * acc.shape[1], 1.4 + 0.6 * acc.shape[0]))
    im = ax.imshow(acc.numpy(), cmap="viridis", vmin=0, vmax=100)
    for (layer, h), name in zip(ab["circuit"], ("prev", "ind")):
        ax.add_patch(plt.Rectangle((h - 0.5, layer - 0.5), 1, 1, fill=False, ec="red", lw=2))
        ax.text(h, layer, name, ha="center", va="center", color="red", fontsize=8)
    ax.set_xticks(range(acc.shape[1]))
    ax.set_yticks(range(acc.shape[0]))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"accuracy with one head ablated (none: {100 * ab['baseline']:.0f}%, "
                 f"circuit: {100 * ab['circuit_accuracy']:.0f}%)", fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    return save_figure(fig, path)
