"""What a `multihead lab uptrain` run's results say: the claims of Ainslie et al. (2023)
checked against the numbers, the summary and table in results.json, and the two plots
(uptrain.png: bits/char against uptraining; frontier.png: bits/char against KV bytes).
Reads the results object only; training lives in `multihead.lab.uptrain`."""

from __future__ import annotations

from pathlib import Path

from multihead.lab.plots import pyplot, save_figure
from multihead.lab.uptrain_config import UptrainConfig

__all__ = ["claims", "plot_frontier", "plot_uptrain", "summarise_uptrain"]

# "most of the gap": the share of the conversion's loss in bits/char that uptraining must win back
MOST = 0.5
# the uptraining fraction the paper recommends (5% of the pre-training steps)
PAPER_FRACTION = 0.05
_COLOURS = {"mean": "#55a868", "first": "#dd8452", "random": "#c44e52", "svd": "#8172b2"}


def _grid(variants: list[dict]) -> dict:
    """{target: {init: {fraction: bits/char}}}."""
    g: dict = {}
    for v in variants:
        g.setdefault(v["target"], {}).setdefault(v["init"], {})[v["uptrain_fraction"]] = v["val_bits_per_char"]
    return g


def _paper_init(target: str) -> str:
    return "svd" if target.startswith("MLA") else "mean"


def claims(res: dict) -> dict:
    """The paper's three claims, each {"held": True | False | None (not measured), "detail": text, ...}."""
    r = res["results"]
    mha = r["mha"]["val_bits_per_char"]
    g = _grid(r["variants"])
    gqa = [t for t in g if not t.startswith("MLA")]

    # 1. mean-pooling beats the first head and random K/V, before and after uptraining
    pairs, wins = [], []
    for t in gqa:
        for f, v in sorted(g[t].get("mean", {}).items()):
            others = {i: g[t][i][f] for i in ("first", "random") if f in g[t].get(i, {})}
            if others:
                pairs.append((t, f))
                if all(v < o for o in others.values()):
                    wins.append((t, f))
    losses = [f"{t} at {f:g}" for t, f in pairs if (t, f) not in wins]
    c1 = {"held": (len(wins) == len(pairs)) if pairs else None, "wins": len(wins), "of": len(pairs),
          "detail": (f"mean-pool gives the lowest bits/char in {len(wins)} of {len(pairs)} (target, fraction) "
                     "pairs" + (f"; not at {', '.join(losses)}" if losses else "")) if pairs
          else "not measured (needs the mean init beside first or random)"}

    # 2. a few percent of uptraining recovers most of the conversion's gap
    recovery = {}
    for t in g:
        curve = g[t].get(_paper_init(t), {})
        ups = [f for f in curve if f > 0]
        if 0.0 not in curve or not ups:
            continue
        f = min(ups, key=lambda x: (abs(x - PAPER_FRACTION), x))
        gap = curve[0.0] - mha
        recovery[t] = {"fraction": f, "gap_converted": gap, "gap_uptrained": curve[f] - mha,
                       "recovered": (curve[0.0] - curve[f]) / gap if gap > 0 else None}
    judged = {t: x for t, x in recovery.items() if not t.startswith("MLA") and x["recovered"] is not None}
    c2 = {"held": all(x["recovered"] >= MOST for x in judged.values()) if judged else None, "threshold": MOST,
          "per_target": recovery,
          "detail": "; ".join(f"{t} ({_paper_init(t)}): {x['gap_converted']:+.3f} -> {x['gap_uptrained']:+.3f} "
                              f"bits/char against MHA after {x['fraction']:.1%} uptraining"
                              + (f" ({x['recovered']:.0%} of the gap recovered)" if x["recovered"] is not None
                                 else " (no gap to recover)")
                              for t, x in recovery.items()) or "not measured"}

    # 3. GQA recovers more than MQA: at every uptraining fraction, each GQA's gap is smaller
    mqa = g.get("MQA", {}).get("mean", {})
    others = [t for t in gqa if t != "MQA" and "mean" in g[t]]
    checks, fails = 0, []
    for f, v in sorted(mqa.items()):
        if f == 0:
            continue
        for t in others:
            if f in g[t]["mean"]:
                checks += 1
                if not g[t]["mean"][f] < v:
                    fails.append(f"{t} at {f:g}")
    c3 = {"held": (not fails) if checks else None,
          "detail": (f"after uptraining, every GQA ends closer to MHA than MQA in {checks - len(fails)} of {checks} "
                     "comparisons" + (f"; not {', '.join(fails)}" if fails else "")) if checks
          else "not measured (needs MQA and a GQA with the mean init, and a fraction above 0)"}
    return {"mean_beats_first_and_random": c1, "uptraining_recovers_most_of_the_gap": c2,
            "gqa_recovers_more_than_mqa": c3}


def summarise_uptrain(cfg: UptrainConfig, res: dict) -> None:
    r = res["results"]
    if r["mha"] is None:
        r["claims"], r["table"] = {}, ""
        r["summary"] = "The MHA baseline did not finish, so nothing was converted."
        return
    mha = r["mha"]
    for v in r["variants"] + r["scratch"]:
        v["bits_vs_mha"] = v["val_bits_per_char"] - mha["val_bits_per_char"]
        v["kv_vs_mha"] = v["kv_bytes_per_token"] / mha["kv_bytes_per_token"]
    r["claims"] = claims(res) if r["variants"] else {}
    r["table"] = _table(cfg, r)
    r["summary"] = _summary(cfg, r)


def _table(cfg: UptrainConfig, r: dict) -> str:
    fractions = sorted(cfg.fractions)
    g = _grid(r["variants"])
    scratch = {s["target"]: s for s in r["scratch"]}
    w = max([8, *(len(t) for t in g)])
    head = (f"{'target':<{w}} {'init':<6} {'KV B/tok':>8}  "
            + "  ".join(f"{f'+{f:.1%}':>7}" if f else f"{'conv.':>7}" for f in fractions) + f"  {'scratch':>7}")
    mha = r["mha"]
    lines = [f"val bits/char (MHA {mha['val_bits_per_char']:.3f} at {mha['kv_bytes_per_token']:,} KV bytes/token; "
             f"columns: converted, then uptrained for a fraction of the {cfg.steps} steps)", head, "-" * len(head)]
    kv = {v["target"]: v["kv_bytes_per_token"] for v in r["variants"]}
    for t, inits in g.items():
        for i, (init, curve) in enumerate(inits.items()):
            cells = "  ".join(f"{curve[f]:>7.3f}" if f in curve else f"{'-':>7}" for f in fractions)
            s = f"{scratch[t]['val_bits_per_char']:>7.3f}" if t in scratch and i == 0 else f"{'':>7}"
            lines.append(f"{t if i == 0 else '':<{w}} {init:<6} {kv[t] if i == 0 else '':>8}  {cells}  {s}")
    return "\n".join(lines)


def _summary(cfg: UptrainConfig, r: dict) -> str:
    mha = r["mha"]
    layers = f"{cfg.n_layers} layer{'s' if cfg.n_layers > 1 else ''}"
    parts = [f"The MHA baseline ({layers}, d_model {cfg.d_model}, {cfg.n_heads} heads, {cfg.steps} steps) reaches "
             f"{mha['val_bits_per_char']:.3f} bits/char with {mha['kv_bytes_per_token']:,} KV bytes per token."]
    c = r["claims"]
    if not c:
        return " ".join(parts + ["No conversion finished."])
    word = {True: "held", False: "did not hold", None: "was not measured"}
    c1 = c["mean_beats_first_and_random"]
    parts.append(f"Claim 1, mean-pooling beats the first head and random K/V: {word[c1['held']]} ({c1['detail']}).")
    parts.append(f"Claim 2, a few percent of uptraining recovers most (>= {MOST:.0%}) of the conversion's gap: "
                 f"{word[c['uptraining_recovers_most_of_the_gap']['held']]} "
                 f"({c['uptraining_recovers_most_of_the_gap']['detail']}).")
    parts.append(f"Claim 3, GQA recovers more than MQA: {word[c['gqa_recovers_more_than_mqa']['held']]} "
                 f"({c['gqa_recovers_more_than_mqa']['detail']}).")
    g = _grid(r["variants"])
    for s in r["scratch"]:
        curve = g.get(s["target"], {}).get(_paper_init(s["target"]), {})
        if curve:
            f = max(curve)
            better = "the converted model" if curve[f] < s["val_bits_per_char"] else "the model trained from scratch"
            parts.append(f"{s['target']}: converted ({_paper_init(s['target'])}) and uptrained {f:.1%} "
                         f"{curve[f]:.3f} against {s['val_bits_per_char']:.3f} from scratch in {cfg.steps} steps: "
                         f"{better} is better.")
    parts.append(f"Uptrained models have trained {cfg.steps} + uptraining steps in all against the baseline's "
                 f"{cfg.steps}, so one that ends below MHA shows that MHA was still improving, not that the "
                 "conversion helped.")
    return " ".join(parts)


def _fraction_label(f: float) -> str:
    return "0" if f == 0 else f"{f:.1%}"


def plot_uptrain(cfg: UptrainConfig, res: dict, path: Path) -> str:
    """One panel per target: bits/char against the uptraining fraction, a line per init."""
    plt = pyplot()
    r = res["results"]
    g = _grid(r["variants"])
    mha = r["mha"]["val_bits_per_char"]
    scratch = {s["target"]: s["val_bits_per_char"] for s in r["scratch"]}
    fractions = sorted(cfg.fractions)
    xs = list(range(len(fractions)))  # evenly spaced: 0 and a few small fractions
    # the y range from everything but the untrained random init (far above the rest)
    ys = [v for t in g for i, c in g[t].items() for f, v in c.items() if not (i == "random" and f == 0)]
    ys += [mha, *scratch.values()]
    lo, hi = min(ys), max(ys)
    pad = 0.08 * (hi - lo) + 0.02
    top = hi + 2 * pad
    fig, axes = plt.subplots(1, len(g), figsize=(3.1 * len(g) + 0.6, 3.9), sharey=True, squeeze=False)
    for ax, (t, inits) in zip(axes[0], g.items()):
        for init, curve in inits.items():
            pts = [(x, curve[f]) for x, f in zip(xs, fractions) if f in curve]
            ax.plot([p[0] for p in pts], [min(p[1], top) for p in pts], "o-", color=_COLOURS[init], lw=1.8, ms=4,
                    label=init)
            for x, y in pts:
                if y > top:
                    ax.annotate(f"{y:.2f}", (x, top), textcoords="offset points", xytext=(4, -10), fontsize=7,
                                color=_COLOURS[init])
        ax.axhline(mha, color="#4c72b0", ls="--", lw=1.2, label=f"MHA ({cfg.steps} steps)")
        if t in scratch:
            ax.axhline(scratch[t], color="black", ls=":", lw=1.2, label=f"{t} from scratch")
        ax.set_xticks(xs, [_fraction_label(f) for f in fractions])
        ax.set_xlabel("uptraining (share of the original steps)", fontsize=8)
        ax.set_title(t, fontsize=10)
        ax.legend(frameon=False, fontsize=7)
    axes[0][0].set_ylim(lo - pad, top + pad)
    axes[0][0].set_ylabel("validation bits per character")
    fig.suptitle("MHA converted whole, then uptrained (points above the frame are written beside it)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_frontier(cfg: UptrainConfig, res: dict, path: Path) -> str:
    """Bits/char against KV bytes per token, one colour per family (MQA/GQA by mean-pool,
    MLA by SVD): converted, converted and uptrained the most, and trained from scratch."""
    plt = pyplot()
    r = res["results"]
    g = _grid(r["variants"])
    mha = r["mha"]
    kv = {v["target"]: v["kv_bytes_per_token"] for v in r["variants"]}
    kv.update({s["target"]: s["kv_bytes_per_token"] for s in r["scratch"]})
    scratch = {s["target"]: s["val_bits_per_char"] for s in r["scratch"]}
    fig, ax = plt.subplots(figsize=(7.6, 4.8))
    top = max(cfg.fractions)
    families = (("MQA/GQA, mean-pool", "#55a868", lambda t: not t.startswith("MLA")),
                ("MLA, SVD", "#8172b2", lambda t: t.startswith("MLA")))
    for family, colour, member in families:
        names = sorted((t for t in kv if member(t)), key=lambda t: kv[t])
        if not names:
            continue
        for label, pts, style in (
                ("converted", [(kv[t], g[t][_paper_init(t)][0.0]) for t in names
                               if 0.0 in g.get(t, {}).get(_paper_init(t), {})], "x:"),
                (f"+ {top:.1%} uptraining", [(kv[t], g[t][_paper_init(t)][top]) for t in names
                                             if top in g.get(t, {}).get(_paper_init(t), {})], "s-"),
                (f"from scratch, {cfg.steps} steps", [(kv[t], scratch[t]) for t in names if t in scratch], "o--")):
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colour, mfc="none", ms=7, lw=1.4,
                        label=f"{family}: {label}")
        for t in names:
            if t in scratch:
                ax.annotate(t, (kv[t], scratch[t]), textcoords="offset points", xytext=(6, -12 if member(t) and
                            t.startswith("MLA") else 4), fontsize=8, color=colour)
    ax.plot(mha["kv_bytes_per_token"], mha["val_bits_per_char"], "*", color="#4c72b0", ms=14, ls="none",
            label=f"MHA baseline, {cfg.steps} steps")
    ticks = sorted(set(kv.values()) | {mha["kv_bytes_per_token"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("KV cache bytes per token (bf16, all layers, log scale)")
    ax.set_ylabel("validation bits per character")
    ax.set_title("Quality against KV cache: converted from MHA vs trained from scratch", fontsize=10)
    ax.legend(frameon=False, fontsize=7.5, loc="upper right")
    return save_figure(fig, path)
