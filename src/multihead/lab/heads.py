"""`multihead lab heads`: does the number of heads matter?

A one-layer transformer (multihead.Attention + MLP) learns a copy task: a random
sequence x_1 .. x_L, a separator, then x_1 .. x_L again; the loss counts the second
half only, where every token is determined by the first. d_model stays fixed (64), so
more heads means narrower heads (head_dim = 64 / n_heads): the experiment measures that
trade at n_heads in {1, 2, 4, 8, 16}, over several seeds, and writes

- loss.png: training loss per head count, mean over seeds with the min-max band;
- results.json: per run the loss curve, the final held-out loss and accuracy and the
  steps to reach the threshold; per head count their mean and spread; and a
  conclusion paragraph generated from those numbers;
- model/: the checkpoint of the best head count's first seed.
A run whose training diverges is listed in results.json "diverged" and left out.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from multihead.checkpoint import Vocab, save_lab_checkpoint
from multihead.checks import check_divisible
from multihead.decoder import LabConfig, LabTransformer
from multihead.lab.configs import HeadsConfig
from multihead.lab.devices import seed_everything
from multihead.lab.plots import draw_plots, pyplot, save_figure
from multihead.lab.progress import Overall
from multihead.lab.results import finished_runs, start_run, write_json_atomic
from multihead.lab.training import StepCallback, diverged_entry, train

__all__ = ["HeadsConfig", "run_heads"]

SEP = "SEP"


def copy_batch(cfg: HeadsConfig, gen: torch.Generator, batch_size: int | None = None):
    """(inputs, targets, mask) `(B, 2L)`: x SEP x shifted by one; mask on the copy."""
    B, L = batch_size or cfg.batch_size, cfg.seq_len
    x = torch.randint(0, cfg.vocab, (B, L), generator=gen)
    seq = torch.cat([x, torch.full((B, 1), cfg.vocab), x], dim=1)  # (B, 2L + 1)
    inp, tgt = seq[:, :-1], seq[:, 1:]
    mask = torch.zeros_like(tgt, dtype=torch.bool)
    mask[:, L:] = True  # predictions of the copy: from the separator on
    return inp, tgt, mask


def vocab_for(cfg: HeadsConfig) -> Vocab:
    return Vocab("symbols", tuple(str(i) for i in range(cfg.vocab)) + (SEP,))


def model_config(cfg: HeadsConfig, n_heads: int) -> LabConfig:
    return LabConfig(vocab_size=cfg.vocab + 1, max_len=2 * cfg.seq_len, d_model=cfg.d_model, n_layers=1,
                     n_heads=n_heads)


def steps_to_threshold(steps: list[int], loss: list[float], threshold: float, window: int) -> int | None:
    """First step at which the moving average of the last `window` losses is below threshold."""
    acc = []
    for s, v in zip(steps, loss):
        acc.append(v)
        recent = acc[-window:]
        if len(recent) == window and sum(recent) / window < threshold:
            return s
    return None


def run_heads(cfg: HeadsConfig | None = None, out_dir: str | Path = "lab-heads", *, seed: int = 0,
              device: str = "auto", callback: StepCallback | None = None, progress: bool = True) -> dict:
    """Run the experiment; write results.json, loss.png and model/ to `out_dir`; return the results."""
    cfg = cfg or HeadsConfig()
    for h in cfg.head_counts:
        check_divisible("d_model", cfg.d_model, "n_heads", h)
    dev, out, res, t0 = start_run("heads", cfg, out_dir, seed, device)
    runs: list[dict] = []
    res["results"] = {"runs": runs}
    best_model = {}
    overall = Overall(len(cfg.head_counts) * cfg.n_seeds, len(cfg.head_counts) * cfg.n_seeds * cfg.steps)
    try:
        for n_heads in cfg.head_counts:
            for i in range(cfg.n_seeds):
                s = seed + i
                run, model, hist = _one_run(cfg, n_heads, s, dev, callback, progress, overall)
                runs.append(run)
                entry = diverged_entry(f"heads H={n_heads} seed {s}", hist)
                if entry is not None:
                    res["diverged"].append(entry)
                else:
                    best_model[(n_heads, i)] = model
                res["elapsed_s"] = time.perf_counter() - t0
                write_json_atomic(out / "results.json", res)  # what is finished so far
                if run["interrupted"]:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        res["interrupted"] = True
    _summarise(cfg, res)
    summary = res["results"]["by_heads"]
    if summary:
        best = min(summary, key=lambda r: (r["final_loss_mean"], r["n_heads"]))
        model = best_model.get((best["n_heads"], 0))
        if model is not None:
            save_lab_checkpoint(out / "model", model, vocab_for(cfg), experiment="heads",
                                extra={"n_heads": best["n_heads"], "seed": seed})
            res["checkpoint"] = "model"
    res["elapsed_s"] = time.perf_counter() - t0
    write_json_atomic(out / "results.json", res)  # the numbers first: a plot that fails cannot lose them
    if summary:
        draw_plots(res, [lambda: _plot(cfg, res, out / "loss.png")])
        write_json_atomic(out / "results.json", res)
    return res


def _one_run(cfg: HeadsConfig, n_heads: int, seed: int, dev, callback, progress,
             overall: Overall | None = None) -> tuple[dict, LabTransformer, dict]:
    gen = seed_everything(seed)
    model = LabTransformer(model_config(cfg, n_heads)).to(dev)
    eval_gen = torch.Generator().manual_seed(10_000 + seed)
    held_out = [copy_batch(cfg, eval_gen) for _ in range(cfg.eval_batches)]

    def batches(step):
        return tuple(t.to(dev) for t in copy_batch(cfg, gen))

    label = f"heads H={n_heads:<2d} seed {seed}"
    hist = train(model, batches, cfg.steps, lr=cfg.lr, warmup=cfg.warmup, callback=callback,
                 name=overall.next_label(label) if overall is not None else label, progress=progress,
                 overall=overall)
    loss, acc = (None, None) if hist["diverged_at"] is not None else _evaluate(model, held_out, dev)
    run = {
        "n_heads": n_heads, "head_dim": cfg.d_model // n_heads, "seed": seed,
        "params": model.n_params(), "steps": hist["steps"], "loss": hist["loss"],
        "steps_done": hist["steps_done"], "interrupted": hist["interrupted"], "diverged_at": hist["diverged_at"],
        "final_loss": loss, "final_accuracy": acc,
        "steps_to_threshold": steps_to_threshold(hist["steps"], hist["loss"], cfg.threshold, cfg.smooth),
        "seconds": hist["seconds"], "tokens_per_s": hist["tokens_per_s"],
    }
    return run, model, hist


@torch.no_grad()
def _evaluate(model: LabTransformer, batches, dev) -> tuple[float, float]:
    model.eval()
    total = correct = 0
    loss_sum = 0.0
    for x, y, m in batches:
        x, y, m = x.to(dev), y.to(dev), m.to(dev)
        logits = model(x)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        mf = m.flatten()
        loss_sum += float(ce[mf].sum())
        correct += int((logits.argmax(-1) == y)[m].sum())
        total += int(m.sum())
    return loss_sum / total, correct / total


def _summarise(cfg: HeadsConfig, res: dict) -> None:
    runs = finished_runs(res["results"]["runs"])
    rows = []
    for h in cfg.head_counts:
        rs = [r for r in runs if r["n_heads"] == h]
        if not rs:
            continue
        fl = [r["final_loss"] for r in rs]
        st = [r["steps_to_threshold"] for r in rs]
        reached = [s for s in st if s is not None]
        rows.append({
            "n_heads": h, "head_dim": cfg.d_model // h, "seeds": len(rs),
            "final_loss_mean": statistics.fmean(fl), "final_loss_min": min(fl), "final_loss_max": max(fl),
            "final_loss_std": statistics.pstdev(fl),
            "final_accuracy_mean": statistics.fmean(r["final_accuracy"] for r in rs),
            "reached_threshold": len(reached),
            "steps_to_threshold_mean": statistics.fmean(reached) if reached else None,
            "steps_to_threshold_min": min(reached) if reached else None,
            "steps_to_threshold_max": max(reached) if reached else None,
        })
    res["results"]["by_heads"] = rows
    res["results"]["table"] = _table(cfg, rows)
    res["results"]["conclusion"] = conclusion(cfg, rows)


def _table(cfg: HeadsConfig, rows: list[dict]) -> str:
    head = f"{'heads':>5}  {'head_dim':>8}  {'final loss (mean ± sd)':>22}  {'accuracy':>8}  " \
           f"{f'steps to {cfg.threshold:g} nats':>20}"
    lines = [head, "-" * len(head)]
    for r in rows:
        st = ("never" if r["steps_to_threshold_mean"] is None else
              f"{r['steps_to_threshold_mean']:.0f} ({r['reached_threshold']}/{r['seeds']} seeds)")
        lines.append(f"{r['n_heads']:>5}  {r['head_dim']:>8}  "
                     f"{r['final_loss_mean']:>13.4f} ± {r['final_loss_std']:<6.4f}  "
                     f"{100 * r['final_accuracy_mean']:>7.1f}%  {st:>20}")
    return "\n".join(lines)


def conclusion(cfg: HeadsConfig, rows: list[dict]) -> str:
    """One paragraph read off the measured numbers (nothing here is written in advance)."""
    if not rows:
        return "No run finished, so there is nothing to conclude."
    n_seeds = max(r["seeds"] for r in rows)
    by_loss = sorted(rows, key=lambda r: r["final_loss_mean"])
    best, worst = by_loss[0], by_loss[-1]
    parts = [f"On the copy task (L = {cfg.seq_len}, {cfg.vocab} symbols, d_model = {cfg.d_model}, "
             f"{cfg.steps} steps, {n_seeds} seed{'s' if n_seeds > 1 else ''} per head count),"]
    # Is the gap between best and worst larger than the seeds' spread?
    spread = max(r["final_loss_max"] - r["final_loss_min"] for r in rows)
    gap = worst["final_loss_mean"] - best["final_loss_mean"]
    if len(rows) == 1:
        parts.append(f"only n_heads = {best['n_heads']} ran; its final loss is {best['final_loss_mean']:.4f}.")
        return " ".join(parts)
    if gap <= spread:
        parts.append(f"the number of heads made no difference larger than the seeds' spread: final losses "
                     f"range from {best['final_loss_mean']:.4f} (n_heads = {best['n_heads']}) to "
                     f"{worst['final_loss_mean']:.4f} (n_heads = {worst['n_heads']}), within a spread of "
                     f"{spread:.4f} between seeds.")
    else:
        parts.append(f"n_heads = {best['n_heads']} (head_dim {best['head_dim']}) reached the lowest final "
                     f"loss, {best['final_loss_mean']:.4f}, and n_heads = {worst['n_heads']} (head_dim "
                     f"{worst['head_dim']}) the highest, {worst['final_loss_mean']:.4f}; the gap "
                     f"({gap:.4f}) is larger than the spread between seeds ({spread:.4f}).")
    ordered = [r["final_loss_mean"] for r in rows]  # rows are in head-count order
    if all(a <= b for a, b in zip(ordered, ordered[1:])):
        parts.append("Final loss rises steadily with the number of heads: at this width, fewer and "
                     "wider heads copy better.")
    elif all(a >= b for a, b in zip(ordered, ordered[1:])):
        parts.append("Final loss falls steadily as heads are added: more, narrower heads copy better "
                     "at this width.")
    else:
        parts.append("The trend with the number of heads is not monotone.")
    reached = [r for r in rows if r["steps_to_threshold_mean"] is not None]
    never = [r["n_heads"] for r in rows if r["reached_threshold"] == 0]
    if reached:
        fast = min(reached, key=lambda r: r["steps_to_threshold_mean"])
        slow = max(reached, key=lambda r: r["steps_to_threshold_mean"])
        if fast is slow:
            parts.append(f"Only n_heads = {fast['n_heads']} brought the loss below {cfg.threshold:g} nats, "
                         f"after {fast['steps_to_threshold_mean']:.0f} steps on average.")
        else:
            ratio = slow["steps_to_threshold_mean"] / max(fast["steps_to_threshold_mean"], 1)
            parts.append(f"To bring the loss below {cfg.threshold:g} nats, n_heads = {fast['n_heads']} needed "
                         f"{fast['steps_to_threshold_mean']:.0f} steps on average and n_heads = "
                         f"{slow['n_heads']} {slow['steps_to_threshold_mean']:.0f} ({ratio:.1f}x as many).")
    if never:
        parts.append(f"n_heads = {', '.join(map(str, never))} never got below {cfg.threshold:g} nats "
                     f"within {cfg.steps} steps.")
    if best["n_heads"] == min(r["n_heads"] for r in rows):
        parts.append("Copying is one lookup per position (the token L places back), which a single "
                     "head can do; splitting the width into more heads only made each head's "
                     "query-key match narrower.")
    elif best["n_heads"] == max(r["n_heads"] for r in rows):
        parts.append("More heads helped here even though each one is narrower.")
    return " ".join(parts)


def _plot(cfg: HeadsConfig, res: dict, path: Path) -> str:
    plt = pyplot()
    runs = finished_runs(res["results"]["runs"])
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    cmap = plt.get_cmap("viridis")
    counts = [h for h in cfg.head_counts if any(r["n_heads"] == h for r in runs)]
    for k, h in enumerate(counts):
        rs = [r for r in runs if r["n_heads"] == h]
        steps = torch.tensor(rs[0]["steps"], dtype=torch.float64)
        curves = torch.tensor([_smooth(r["loss"], cfg.smooth) for r in rs], dtype=torch.float64)
        colour = cmap(k / max(1, len(counts) - 1) * 0.9)
        ax.plot(steps, curves.mean(0), color=colour, lw=2,
                label=f"{h} head{'s' if h > 1 else ''} (head_dim {cfg.d_model // h})")
        if len(rs) > 1:
            ax.fill_between(steps, curves.min(0).values, curves.max(0).values, color=colour, alpha=0.18, lw=0)
    ax.axhline(cfg.threshold, color="grey", ls="--", lw=1)
    ax.text(steps[-1].item(), cfg.threshold, f" threshold {cfg.threshold:g}", va="bottom", ha="right",
            color="grey", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("copy loss (nats, log scale)")
    n_seeds = max(len([r for r in runs if r["n_heads"] == h]) for h in counts)
    ax.set_title(f"Copy task, 1 layer, d_model {cfg.d_model}: loss by number of heads\n"
                 f"(mean over {n_seeds} seed{'s' if n_seeds > 1 else ''}, band = min..max, "
                 f"{cfg.smooth}-step moving average)", fontsize=10)
    ax.legend(frameon=False)
    return save_figure(fig, path)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out

