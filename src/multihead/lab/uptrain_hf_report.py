"""The report of `multihead lab uptrain --model`: each variant's gap closed against the
control, the evaluations worse than their conversion, the freeze check's verdict, the
table and summary results.json holds (and docs/lab.md quotes), and uptrain.png.

Details: docs/lab.md, "How `lab uptrain --model` runs". `cfg` below is the run's
`uptrain_hf.HFUptrainConfig` (not imported: that module imports this one).
"""

from __future__ import annotations

import math
from pathlib import Path

from multihead.lab.plots import pyplot, save_figure

__all__ = ["gap_closed", "plot_uptrain_hf", "summarise_uptrain_hf"]


def gap_closed(converted: float, uptrained: float, control: float) -> float | None:
    """(log converted - log uptrained) / (log converted - log control): 1 when the target
    reaches the control, 0 when it stays as converted; None without a gap."""
    gap = math.log(converted) - math.log(control)
    return None if gap <= 0 else (math.log(converted) - math.log(uptrained)) / gap


def _mark_worse(r: dict, first: dict) -> None:
    """Mark every evaluation worse than the conversion it started from (uptraining must never
    do that) and list those trainings in r["worse_than_converted"]."""
    for v in r["variants"]:
        conv = first.get((v["target"], v["init"], v["objective"]))
        v.pop("worse_than_converted", None)
        if conv is not None and v["steps"] and v["val_ppl"] > conv:
            v["worse_than_converted"] = True
    r["worse_than_converted"] = sorted({f"{v['target']}/{v['init']}" + ("/distill" if v["objective"] == "distill"
                                                                        else "")
                                        for v in r["variants"] if v.get("worse_than_converted")})


def summarise_uptrain_hf(cfg, res: dict) -> None:
    """Add each variant's gap closed, the freeze check's verdict, the table and the summary."""
    r = res["results"]
    control = {c["steps"]: c["val_ppl"] for c in r["control"]}
    first: dict = {}
    for v in r["variants"]:
        k = (v["target"], v["init"], v["objective"])
        first.setdefault(k, v["val_ppl"] if v["steps"] == 0 else None)
        conv = first[k]
        v["control_ppl"] = control.get(v["steps"])
        v["gap_closed"] = (gap_closed(conv, v["val_ppl"], v["control_ppl"])
                           if conv is not None and v["control_ppl"] is not None and v["steps"] else None)
    _mark_worse(r, first)
    r["table"], sentences = _table(cfg, r, control)
    f = r["freeze"]
    _freeze_verdict(cfg, r, f)
    if r["base"] is None:
        r["summary"] = "interrupted before the base model was measured"
        return
    trains = (f"{f['frozen'].split('; ')[0]} frozen" if cfg.trainable == "attention" else "every parameter trains")
    text = (f"Base model {r['model']}: held-out perplexity {r['base']['val_ppl']:.2f}, "
            f"{r['base']['kv_bytes_per_token']:,} KV bytes per token ({r['dtype']}, measured from a generate() cache)"
            f". Uptraining: {cfg.steps} steps of {cfg.batch_size} x {cfg.context} tokens ({trains})")
    parts = [text + "."]
    if control:
        parts.append(f"The control (unconverted, same budget) goes {r['base']['val_ppl']:.2f} -> "
                     f"{control[max(control)]:.2f}.")
    parts += [s + "." for s in sentences]
    if r["worse_than_converted"]:
        parts.append(f"Worse than as converted at an evaluated step (marked worse_than_converted): "
                     f"{', '.join(r['worse_than_converted'])}.")
    if "verdict" in f:
        parts.append(f["verdict"] + ".")
    r["summary"] = " ".join(parts)


def _table(cfg, r: dict, control: dict) -> tuple[str, list[str]]:
    """The markdown table of every variant's perplexity by step, and one sentence per variant."""
    steps = list(cfg.eval_steps())

    def ppl_cells(values: dict) -> str:
        return " | ".join(f"{values[s]:.2f}" if s in values else "-" for s in steps)

    def minutes(key: str) -> str:
        cpu = r.get("cpu_seconds", {})
        wall = f"{r['seconds'][key] / 60:.1f}" if key in r["seconds"] else "-"
        return wall + (f" | {cpu[key] / 60:.1f}" if key in cpu else " | -") if cpu else wall

    timed = "control_decode" in r or any("decode" in v for v in r["variants"])  # runs before decode timing: none

    def decode(d: dict | None) -> str:
        if not timed:
            return ""
        return ("-" if d is None else f"{d['ms_per_token']:.1f} ({d['ratio']:.2f}x)") + " | "

    cpu_col = " CPU minutes |" if r.get("cpu_seconds") else ""  # wall time on a shared machine overstates the cost
    head = "| target | init | objective | KV bytes/token | " + "decode ms/token (x base) | " * timed + " | ".join(
        "converted" if s == 0 else f"step {s}" for s in steps) + " | gap closed | minutes |" + cpu_col
    lines = [head, "|" + ":--|" * 3 + "--:|" * (len(steps) + 3 + timed + bool(cpu_col))]
    if r["base"] is not None:
        kv = f"{r['base']['kv_bytes_per_token']:,}"
        base_ms = (r.get("control_decode") or {}).get("base_ms_per_token")
        ms = (f"{'-' if base_ms is None else f'{base_ms:.1f}'} | " if timed else "")
        lines.append(f"| base | - | - | {kv} | {ms}"
                     + f"{r['base']['val_ppl']:.2f} |" + " |" * (len(steps) + 1 + bool(cpu_col)))
        lines.append(f"| control | - | next-token | {kv} | {decode(r.get('control_decode'))}"
                     f"{ppl_cells(control)} | | {minutes('control')} |")
    grid: dict = {}
    for v in r["variants"]:
        grid.setdefault((v["target"], v["init"], v["objective"], v["kv_bytes_per_token"]), {})[v["steps"]] = v
    sentences = []
    for (target, init, objective, kv), row in grid.items():
        last = row[max(row)]
        closed = last.get("gap_closed")
        key = f"{target}/{init}" + ("/distill" if objective == "distill" else "")
        lines.append(f"| {target} | {init} | {objective} | {kv:,} | {decode(row[min(row)].get('decode'))}"
                     + ppl_cells({s: v["val_ppl"] for s, v in row.items()})
                     + f" | {'-' if closed is None else f'{closed:.0%}'} | {minutes(key)} |")
        if max(row) > 0 and 0 in row:
            sentences.append(f"{target} ({init}, {objective}): {row[0]['val_ppl']:.1f} as converted, "
                             f"{last['val_ppl']:.1f} after {max(row)} steps against the control's "
                             f"{last['control_ppl']:.1f}"
                             + ("" if closed is None else f" ({closed:.0%} of the log-perplexity gap closed)"))
    return "\n".join(lines), sentences


def _freeze_verdict(cfg, r: dict, f: dict) -> None:
    """The freeze check's verdict in `f` (r["freeze"]): MQA (mean) training the attention layers
    against training every parameter, when both ran to the end."""
    check = [c for c in f["check"] if c["steps"] == cfg.steps]
    same = [v for v in r["variants"] if (v["target"], v["init"], v["objective"], v["steps"])
            == ("mqa", "mean", "next-token", cfg.steps)]
    if not (check and same and len(f["seconds_per_step"]) == 2):
        return
    s = f["seconds_per_step"]
    cpu = r.get("cpu_seconds", {})
    keys = {"attention": "mqa/mean", "all": "mqa/mean/all"} if cfg.trainable == "attention" else \
        {"all": "mqa/mean", "attention": "mqa/mean/attention"}
    if all(k in cpu for k in keys.values()):  # CPU time: comparable when the machine's load changes between them
        f["cpu_seconds_per_step"] = {t: cpu[k] / cfg.steps for t, k in keys.items()}
    c = f.get("cpu_seconds_per_step")

    def rate(t: str) -> str:
        return f"{s[t]:.2f} s/step" + (f", {c[t]:.2f} s of CPU with its evaluations" if c else "")
    f["verdict"] = (f"MQA (mean) after {cfg.steps} steps: {same[0]['val_ppl']:.2f} held-out perplexity training "
                    f"the attention layers ({f['trainable_params']['attention']:,} parameters, "
                    f"{rate('attention')}) against {check[0]['val_ppl']:.2f} training every parameter "
                    f"({f['trainable_params']['all']:,}, {rate('all')})")


def plot_uptrain_hf(res: dict, path: Path) -> str:
    """Held-out perplexity (log) against uptraining steps per target, and the final
    perplexity against measured KV bytes per token."""
    plt = pyplot()
    r = res["results"]
    fig, (ax, fr) = plt.subplots(1, 2, figsize=(11, 4.2))
    per_step = res["config"]["batch_size"] * res["config"]["context"]  # tokens seen per uptraining step
    curves: dict = {}
    for v in r["variants"]:
        curves.setdefault((v["target"], v["init"], v["objective"]), []).append((v["steps"] * per_step, v["val_ppl"],
                                                                                v["kv_bytes_per_token"]))
    for (target, init, objective), pts in curves.items():
        pts.sort()
        label = f"{target} {init}" + (" (distill)" if objective == "distill" else "")
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label,
                        ls="--" if objective == "distill" else "-")
        fr.scatter([pts[-1][2]], [pts[-1][1]], color=line.get_color(), label=label)
        fr.scatter([pts[0][2]], [pts[0][1]], color=line.get_color(), marker="x")
    c = sorted((x["steps"] * per_step, x["val_ppl"]) for x in r["control"])
    if c:
        ax.plot([p[0] for p in c], [p[1] for p in c], color="black", marker="s", ms=3, label="control")
        fr.scatter([r["base"]["kv_bytes_per_token"]], [c[-1][1]], color="black", marker="s", label="control")
    ax.axhline(r["base"]["val_ppl"], color="grey", ls=":", label="base, as loaded")
    fr.scatter([r["base"]["kv_bytes_per_token"]], [r["base"]["val_ppl"]], color="grey", marker="D", label="base")
    for a in (ax, fr):
        a.set_yscale("log")
        a.set_ylabel("held-out perplexity (KJV Romans-Revelation)")
    ax.set_xlabel("tokens seen in uptraining")
    ax.set_title(f"{r['model']}: converted, then uptrained")
    fr.set_xlabel("KV-cache bytes per token (measured, generate cache)")
    fr.set_title("after uptraining (dots) and as converted (x)")
    ax.legend(fontsize=7)
    return save_figure(fig, path)
