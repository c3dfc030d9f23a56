"""What a `multihead lab mla` run's results say: the summary and table in results.json,
and the two plots (mla.png: bits/char against cache bytes; curves.png: validation during
training). Reads the results object only; training lives in `multihead.lab.mla`."""

from __future__ import annotations

from pathlib import Path

from multihead.lab.configs import MLAConfig
from multihead.lab.plots import pyplot, save_figure
from multihead.lab.results import finished_runs

__all__ = ["plot_curves", "plot_tradeoff", "summarise_mla"]


def summarise_mla(cfg: MLAConfig, res: dict) -> None:
    r = res["results"]
    runs = finished_runs(r["runs"])
    mha = next((x for x in runs if x["kind"] == "MHA"), None)
    r["smallest_rank_within_tolerance"] = None
    if mha is None:
        r["summary"] = "The MHA baseline did not finish, so nothing is compared."
        r["table"] = ""
        return
    limit_bytes = mha["cache_bytes_per_token"] * cfg.budget
    limit_bpc = mha["val_bpc"] + cfg.tolerance
    for x in runs:
        x["cache_vs_mha"] = x["cache_bytes_per_token"] / mha["cache_bytes_per_token"]
        x["bpc_vs_mha"] = x["val_bpc"] - mha["val_bpc"]
        x["under_budget"] = x["cache_bytes_per_token"] < limit_bytes
        x["within_tolerance"] = x["val_bpc"] <= limit_bpc
    for c in r["conversions"]:
        c["cache_vs_mha"] = c["cache_bytes_per_token"] / mha["cache_bytes_per_token"]
        c["within_tolerance_converted"] = c["val_bpc_converted"] <= limit_bpc
        c["within_tolerance_finetuned"] = c["val_bpc_finetuned"] <= limit_bpc
    mla = sorted((x for x in runs if x["kind"] == "MLA"), key=lambda x: x["kv_rank"])
    ok = [x for x in mla if x["under_budget"] and x["within_tolerance"]]
    r["smallest_rank_within_tolerance"] = ok[0]["kv_rank"] if ok else None
    conv_ok = [c for c in sorted(r["conversions"], key=lambda c: c["kv_rank"])
               if c["cache_bytes_per_token"] < limit_bytes and c["within_tolerance_finetuned"]]
    r["smallest_converted_rank_within_tolerance"] = conv_ok[0]["kv_rank"] if conv_ok else None
    r["mha_val_bpc"] = mha["val_bpc"]
    r["mha_cache_bytes_per_token"] = mha["cache_bytes_per_token"]
    r["budget_bytes_per_token"] = limit_bytes
    r["table"] = _table(cfg, runs, r["conversions"])
    r["summary"] = _summary_text(cfg, r, mha, mla, runs)


def _table(cfg, runs, conversions) -> str:
    head = f"{'model':<8}  {'cache B/token':>13}  {'vs MHA':>6}  {'val bits/char':>13}  {'vs MHA':>7}  {'params':>8}"
    lines = ["trained from scratch (cache: bf16, all layers)", head, "-" * len(head)]
    for x in runs:
        lines.append(f"{x['name']:<8}  {x['cache_bytes_per_token']:>13,}  {x['cache_vs_mha']:>6.3f}  "
                     f"{x['val_bpc']:>13.3f}  {x['bpc_vs_mha']:>+7.3f}  {x['params']:>8,}")
    if conversions:
        lines += ["", "MHA converted with multihead.convert.to_mla",
                  f"{'kv_rank':>7}  {'K/V error':>9}  {'bits/char converted':>19}  "
                  f"{f'after {cfg.finetune_steps} steps':>16}"]
        for c in conversions:
            err = sum(c["kv_reconstruction_error"]) / len(c["kv_reconstruction_error"])
            lines.append(f"{c['kv_rank']:>7}  {err:>9.3f}  {c['val_bpc_converted']:>19.3f}  "
                         f"{c['val_bpc_finetuned']:>16.3f}")
    return "\n".join(lines)


def _summary_text(cfg, r, mha, mla, runs) -> str:
    frac = f"1/{round(1 / cfg.budget)}" if abs(1 / cfg.budget - round(1 / cfg.budget)) < 1e-9 else f"{cfg.budget:g}"
    parts = [f"MHA reaches {mha['val_bpc']:.3f} bits/char on held-out text with "
             f"{mha['cache_bytes_per_token']:,} cache bytes per token (bf16, {_layers(cfg)})."]
    pick = r["smallest_rank_within_tolerance"]
    if pick is not None:
        x = next(m for m in mla if m["kv_rank"] == pick)
        parts.append(f"The smallest MLA rank with a cache below {frac} of MHA's and validation loss within "
                     f"{_bits(cfg.tolerance)}/char of MHA's is kv_rank = {pick}: {x['cache_bytes_per_token']:,} bytes "
                     f"per token ({x['cache_vs_mha']:.3f} of MHA) at {x['val_bpc']:.3f} bits/char, "
                     f"{_against(x['bpc_vs_mha'])} MHA, a margin of {cfg.tolerance - x['bpc_vs_mha']:.3f} bits/char "
                     "to the tolerance.")
    else:
        under = [m for m in mla if m["under_budget"]]
        closest = min(under, key=lambda m: m["val_bpc"]) if under else None
        parts.append(f"No MLA rank tried has both a cache below {frac} of MHA's and validation loss within "
                     f"{_bits(cfg.tolerance)}/char of MHA's" + (
                         f" (ranks under the budget: {', '.join(str(m['kv_rank']) for m in under)}; the closest, "
                         f"kv_rank {closest['kv_rank']}, is {_against(closest['bpc_vs_mha'])} MHA, "
                         f"{closest['bpc_vs_mha'] - cfg.tolerance:.3f} bits/char past the tolerance)."
                         if under else "; no rank tried is under the budget."))
    if mla:
        best = min(mla, key=lambda m: m["val_bpc"])
        parts.append(f"The best MLA rank is {best['kv_rank']} at {best['val_bpc']:.3f} bits/char "
                     f"({_against(best['bpc_vs_mha'])} MHA).")
    for x in runs:
        if x["kind"] in ("GQA", "MQA"):
            same = [m for m in mla if m["cache_bytes_per_token"] == x["cache_bytes_per_token"]]
            if same:
                m = same[0]
                better = "MLA" if m["val_bpc"] < x["val_bpc"] else x["name"]
                parts.append(f"At the same cache ({x['cache_bytes_per_token']:,} B/token) {x['name']} gives "
                             f"{x['val_bpc']:.3f} and MLA-{m['kv_rank']} {m['val_bpc']:.3f} bits/char: {better} "
                             "is better.")
    conv = r["conversions"]
    if conv:
        worst = max(conv, key=lambda c: c["val_bpc_converted"] - mha["val_bpc"])
        parts.append(f"Converting the trained MHA with to_mla costs up to "
                     f"{worst['val_bpc_converted'] - mha['val_bpc']:+.3f} bits/char (kv_rank {worst['kv_rank']}) "
                     f"before fine-tuning and {worst['val_bpc_finetuned'] - mha['val_bpc']:+.3f} after "
                     f"{cfg.finetune_steps} steps.")
        best_c = min(conv, key=lambda c: c["val_bpc_finetuned"])
        if best_c["val_bpc_finetuned"] < mha["val_bpc"]:
            parts.append(f"Converted kv_rank {best_c['kv_rank']} ends below MHA ({best_c['val_bpc_finetuned']:.3f}), "
                         f"but it has trained {cfg.steps + cfg.finetune_steps} steps in all against MHA's "
                         f"{cfg.steps}: MHA was still improving when it stopped.")
        if r["smallest_converted_rank_within_tolerance"] is not None:
            parts.append(f"Converted and fine-tuned, kv_rank {r['smallest_converted_rank_within_tolerance']} is the "
                         f"smallest under the cache budget within tolerance.")
    return " ".join(parts)


def _bits(x: float) -> str:
    """'1 bit', '0.5 bits'."""
    return f"{x:g} bit" + ("" if x == 1 else "s")


def _against(delta: float) -> str:
    """'+0.042 bits/char above' / '0.013 bits/char below': the unit and the direction in words."""
    if abs(delta) < 5e-4:
        return "level with"
    return f"{abs(delta):.3f} bits/char {'above' if delta > 0 else 'below'}"


def _layers(cfg: MLAConfig) -> str:
    return f"{cfg.n_layers} layer{'s' if cfg.n_layers > 1 else ''}"


def plot_tradeoff(cfg: MLAConfig, res: dict, path: Path) -> str:
    plt = pyplot()
    r = res["results"]
    runs = finished_runs(r["runs"])
    mha = next((x for x in runs if x["kind"] == "MHA"), None)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    mla = sorted((x for x in runs if x["kind"] == "MLA"), key=lambda x: x["kv_rank"])
    if mla:
        ax.plot([x["cache_bytes_per_token"] for x in mla], [x["val_bpc"] for x in mla], "o-", color="#8172b2",
                lw=2, label="MLA, trained")
        for x in mla:
            ax.annotate(f"R={x['kv_rank']}", (x["cache_bytes_per_token"], x["val_bpc"]), textcoords="offset points",
                        xytext=(4, 6), fontsize=8, color="#8172b2")
    conv = sorted(r["conversions"], key=lambda c: c["kv_rank"])
    if conv:
        xs = [c["cache_bytes_per_token"] for c in conv]
        ax.plot(xs, [c["val_bpc_converted"] for c in conv], "x:", color="grey", label="MHA -> to_mla, converted")
        ax.plot(xs, [c["val_bpc_finetuned"] for c in conv], "s--", color="#dd8452", mfc="none",
                label=f"MHA -> to_mla, +{cfg.finetune_steps} fine-tune steps")
    markers = {"MHA": ("*", "#4c72b0", 14), "GQA": ("D", "#55a868", 8), "MQA": ("^", "#c44e52", 9)}
    for x in runs:
        if x["kind"] in markers:
            m, c, s = markers[x["kind"]]
            ax.plot(x["cache_bytes_per_token"], x["val_bpc"], m, color=c, ms=s, ls="none", label=x["name"])
    ys = [x["val_bpc"] for x in runs] + [v for c in conv for v in (c["val_bpc_converted"], c["val_bpc_finetuned"])]
    pad = 0.08 * (max(ys) - min(ys)) + 0.02
    ax.set_ylim(min(ys) - pad, max(ys) + 3 * pad)  # from the data: the tolerance band may reach far above
    if mha is not None:
        budget = mha["cache_bytes_per_token"] * cfg.budget
        ax.axvline(budget, color="black", lw=1, ls="--")
        ax.text(budget, ax.get_ylim()[1], f" {cfg.budget:.3g} of MHA's cache", va="top", fontsize=8)
        top = mha["val_bpc"] + cfg.tolerance
        ax.axhspan(mha["val_bpc"], top, color="#4c72b0", alpha=0.08,
                   label=f"within {_bits(cfg.tolerance)}/char of MHA" + ("" if top < ax.get_ylim()[1] else
                                                                  f" (up to {top:.2f})"))
        ax.set_ylim(min(ys) - pad, max(ys) + 3 * pad)
        pick = r.get("smallest_rank_within_tolerance")
        if pick is not None:
            x = next(m for m in mla if m["kv_rank"] == pick)
            ax.plot(x["cache_bytes_per_token"], x["val_bpc"], "o", ms=16, mfc="none", mec="black", mew=1.5,
                    label=f"smallest rank within tolerance (R={pick})")
    ax.set_xscale("log", base=2)
    ticks = sorted({x["cache_bytes_per_token"] for x in runs})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("KV cache bytes per token (bf16, all layers, log scale)")
    ax.set_ylabel("validation bits per character")
    ax.set_title(f"{r['corpus']['name'].split(' (')[0]}: character LM, {_layers(cfg)}, d_model {cfg.d_model}, "
                 f"{cfg.n_heads} heads, {cfg.steps} steps", fontsize=10)
    ax.legend(frameon=False, fontsize=8, loc="upper right")
    return save_figure(fig, path)


def plot_curves(cfg: MLAConfig, res: dict, path: Path) -> str:
    plt = pyplot()
    runs = finished_runs(res["results"]["runs"])
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    cmap = plt.get_cmap("plasma")
    mla = [x for x in runs if x["kind"] == "MLA"]
    for x in runs:
        steps = [e["step"] for e in x["evals"]]
        vals = [e["val_bpc"] for e in x["evals"]]
        if x["kind"] == "MLA":
            k = mla.index(x)
            ax.plot(steps, vals, color=cmap(0.15 + 0.7 * k / max(1, len(mla) - 1)), lw=1.5, label=x["name"])
        else:
            style = {"MHA": ("#4c72b0", "-"), "GQA": ("#55a868", "--"), "MQA": ("#c44e52", ":")}[x["kind"]]
            ax.plot(steps, vals, color=style[0], ls=style[1], lw=2.2, label=x["name"])
    ax.set_xlabel("training step")
    ax.set_ylabel("validation bits per character")
    # every point shows, the untrained step-0 value included (the first segment is not clipped)
    vals = [e["val_bpc"] for x in runs for e in x["evals"]]
    pad = 0.04 * (max(vals) - min(vals)) + 0.02
    ax.set_ylim(min(vals) - pad, max(vals) + pad)
    ax.set_title("Validation bits/char during training", fontsize=10)
    ax.legend(frameon=False, fontsize=8, ncol=2)
    return save_figure(fig, path)

