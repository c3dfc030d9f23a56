"""`multihead lab induction`: when do induction heads appear?

A 2-layer attention-only transformer (Elhage et al., 2021; Olsson et al., 2022, "In-
context Learning and Induction Heads") is trained on sequences of random tokens in which
one random segment occurs twice, at random places and of random length (so no fixed
offset solves it): once the model has seen `A B` it can predict `B` after the second
`A` only by looking back for the earlier `A` and copying what followed it. The loss
counts the second occurrence, the only predictable tokens.

It measures the accuracy on those predictions and each head's previous-token,
induction and prefix-matching scores, and names the step of the phase change.

Details: docs/lab.md, "How `lab induction` runs".
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from multihead.checkpoint import Vocab, save_lab_checkpoint
from multihead.decoder import LabConfig, LabTransformer
from multihead.lab.ablation import ablation_check, ablation_line, plot_ablation
from multihead.lab.configs import InductionConfig
from multihead.lab.devices import seed_everything
from multihead.lab.plots import distinct_colours, draw_plots, pyplot, save_figure
from multihead.lab.results import start_run, write_json_atomic
from multihead.lab.training import StepCallback, diverged_entry, train

__all__ = ["InductionConfig", "run_induction"]


def repeated_segments(cfg: InductionConfig, batch: int, gen: torch.Generator):
    """(inputs, targets, mask) `(B, T-1)`: random filler with one segment of distinct tokens
    occurring twice; mask marks the predictions inside the second occurrence (A -> B)."""
    T, V = cfg.seq_len, cfg.vocab
    xs = torch.empty(batch, T, dtype=torch.long)
    mask = torch.zeros(batch, T - 1, dtype=torch.bool)
    for b in range(batch):
        L = int(torch.randint(cfg.seg_min, cfg.seg_max + 1, (1,), generator=gen))
        perm = torch.randperm(V, generator=gen)
        seg, rest = perm[:L], perm[L:]  # filler never uses the segment's tokens
        x = rest[torch.randint(0, V - L, (T,), generator=gen)]
        s1 = int(torch.randint(0, T - 2 * L + 1, (1,), generator=gen))
        s2 = int(torch.randint(s1 + L, T - L + 1, (1,), generator=gen))
        x[s1: s1 + L] = seg
        x[s2: s2 + L] = seg
        xs[b] = x
        mask[b, s2: s2 + L - 1] = True  # at seg[k] (second copy) predict seg[k + 1]
    return xs[:, :-1], xs[:, 1:], mask


def live_model(model: LabTransformer, vocab: Vocab):
    """The model being trained, seen through multihead.inspect's `LoadedModel` interface
    (a `LabModel` that wraps the live module instead of loading a checkpoint)."""
    from multihead.interop.loaders import LabModel

    return LabModel(model, vocab, name="training", experiment="induction")


def role_scores_now(model: LabTransformer, vocab: Vocab, cfg: InductionConfig, seed: int) -> dict:
    """{"previous_token": [[layer][head]], "induction": [[...]]} with multihead.inspect's scores."""
    from multihead.inspect.capture import capture
    from multihead.inspect.roles import induction_scores, role_scores

    live = live_model(model, vocab)
    half = cfg.seq_len // 2
    prefix = induction_scores(live, seq_len=half, seed=seed, batch=cfg.score_sequences)  # (L, H)
    gen = torch.Generator().manual_seed(seed)
    prev = torch.zeros(cfg.n_layers, cfg.n_heads)
    for _ in range(cfg.score_sequences):
        ids = torch.randint(0, cfg.vocab, (cfg.seq_len,), generator=gen).tolist()
        cap = capture(" ".join(vocab.decode(ids)), model=live)
        prev += role_scores(cap)["previous_token"]
    prev /= cfg.score_sequences
    return {"previous_token": prev.tolist(), "induction": prefix.tolist()}


def run_induction(cfg: InductionConfig | None = None, out_dir: str | Path = "lab-induction", *, seed: int = 0,
                  device: str = "auto", callback: StepCallback | None = None, progress: bool = True) -> dict:
    """Train, score heads over training; write results.json, induction.png and model/ to `out_dir`."""
    cfg = cfg or InductionConfig()
    dev, out, res, t0 = start_run("induction", cfg, out_dir, seed, device)
    vocab = Vocab("symbols", tuple(str(i) for i in range(cfg.vocab)))
    gen = seed_everything(seed)
    model = LabTransformer(model_config(cfg)).to(dev)
    eval_gen = torch.Generator().manual_seed(2_000_003 + seed)
    held_out = repeated_segments(cfg, cfg.eval_sequences, eval_gen)

    def evaluate(step: int) -> dict:
        x, y, m = (t.to(dev) for t in held_out)
        logits = model(x)
        acc = float((logits.argmax(-1) == y)[m].float().mean())
        loss = float(torch.nn.functional.cross_entropy(logits[m], y[m]))
        scores = role_scores_now(model, vocab, cfg, seed=3_000_017 + seed)
        return {"accuracy": acc, "loss": loss, **scores}

    def batches(step: int):
        return tuple(t.to(dev) for t in repeated_segments(cfg, cfg.batch_size, gen))

    hist = train(model, batches, cfg.steps, lr=cfg.lr, warmup=cfg.warmup, name="induction", callback=callback,
                 evaluate=evaluate, eval_every=cfg.eval_every, progress=progress)
    res["interrupted"] = hist["interrupted"]
    entry = diverged_entry("induction", hist)
    if entry is not None:
        res["diverged"].append(entry)
    arch = model.cfg
    res["results"] = {"evals": hist["evals"], "steps": hist["steps"], "loss": hist["loss"],
                      "steps_done": hist["steps_done"], "diverged_at": hist["diverged_at"],
                      "seconds": hist["seconds"], "tokens_per_s": hist["tokens_per_s"], "params": model.n_params(),
                      "chance_accuracy": 1 / cfg.vocab,
                      "geometry": {"variant": arch.kind, "n_layers": arch.n_layers, "d_model": arch.d_model,
                                   "n_heads": arch.n_heads, "n_kv_heads": arch.n_kv_heads or arch.n_heads,
                                   "head_dim": arch.head_dim, "kv_rank": arch.kv_rank, "rope_dim": arch.rope_dim,
                                   "positions": arch.positions, "scaled_from": cfg.scaled_from}}
    _analyse(cfg, res)
    if hist["evals"]:  # Olsson et al.'s causal check: each head ablated, then the named pair (lab.ablation)
        res["results"]["ablation"] = ablation_check(model, held_out, res["results"])
        res["results"]["summary"] += " " + ablation_line(res["results"])
    if entry is None:  # a diverged model's weights are not a result worth opening
        save_lab_checkpoint(out / "model", model, vocab, experiment="induction")
        res["checkpoint"] = "model"
    res["elapsed_s"] = time.perf_counter() - t0
    write_json_atomic(out / "results.json", res)  # the numbers first: a plot that fails cannot lose them
    if hist["evals"]:
        draw_plots(res, [lambda: _plot(cfg, res, out / "induction.png"),
                         lambda: plot_ablation(res, out / "ablation.png")])
        write_json_atomic(out / "results.json", res)
    return res


def model_config(cfg: InductionConfig) -> LabConfig:
    """The attention-only model of `cfg`: RoPE in the attention for MHA/GQA/MQA; MLA carries
    its positions in rope_dim (with learned absolute positions beside, as the lab's MLA does)."""
    mla = cfg.attention == "mla"
    return LabConfig(vocab_size=cfg.vocab, max_len=cfg.seq_len, d_model=cfg.d_model, n_layers=cfg.n_layers,
                     n_heads=cfg.n_heads, n_kv_heads=None if mla else cfg.n_kv_heads, head_dim=cfg.head_dim,
                     attention=cfg.attention, kv_rank=cfg.kv_rank if mla else None, rope_dim=cfg.rope_dim if mla else 0,
                     mlp=False, positions="learned" if mla else cfg.positions)


def _analyse(cfg: InductionConfig, res: dict) -> None:
    r = res["results"]
    evals = r["evals"]
    if not evals:
        r["summary"] = "Training stopped before the first evaluation."
        return
    last = evals[-1]
    r["final_accuracy"] = last["accuracy"]
    r["reached_target"] = last["accuracy"] >= cfg.target_accuracy
    hit = next((e["step"] for e in evals if e["accuracy"] >= cfg.target_accuracy), None)
    r["steps_to_target"] = hit
    prev_layer = 0
    ind_layer = cfg.n_layers - 1
    prev_scores = last["previous_token"][prev_layer]
    ind_scores = last["induction"][ind_layer]
    ph = max(range(cfg.n_heads), key=lambda h: prev_scores[h])
    ih = max(range(cfg.n_heads), key=lambda h: ind_scores[h])
    r["previous_token_head"] = {"layer": prev_layer, "head": ph, "score": prev_scores[ph]}
    r["induction_head"] = {"layer": ind_layer, "head": ih, "score": ind_scores[ih]}
    curve = [e["induction"][ind_layer][ih] for e in evals]
    steps = [e["step"] for e in evals]
    # The phase change: the evaluation interval with the largest rise of the induction score.
    if len(curve) > 1:
        jumps = [curve[i + 1] - curve[i] for i in range(len(curve) - 1)]
        k = max(range(len(jumps)), key=lambda i: jumps[i])
        r["phase_change_step"] = steps[k + 1]
        r["phase_change_jump"] = jumps[k]
        lo, hi = curve[0], max(curve)
        r["induction_half_rise_step"] = next((s for s, c in zip(steps, curve) if c >= lo + (hi - lo) / 2), None)
        acc = [e["accuracy"] for e in evals]
        ajumps = [acc[i + 1] - acc[i] for i in range(len(acc) - 1)]
        r["accuracy_jump_step"] = steps[max(range(len(ajumps)), key=lambda i: ajumps[i]) + 1]
        if hi - lo < MIN_RISE or r["phase_change_jump"] <= 0:  # no rise: no step to name
            r["phase_change_step"] = r["induction_half_rise_step"] = None
        if max(acc) - acc[0] < MIN_RISE:
            r["accuracy_jump_step"] = None
    else:
        r["phase_change_step"] = r["induction_half_rise_step"] = r["accuracy_jump_step"] = None
        r["phase_change_jump"] = 0.0
    r["summary"] = _summary(cfg, r, last)


def _summary(cfg: InductionConfig, r: dict, last: dict) -> str:
    p, i = r["previous_token_head"], r["induction_head"]
    parts = []
    if r.get("diverged_at") is not None:
        parts.append(f"Training diverged at step {r['diverged_at']} (lr {cfg.lr:g} is too high); the numbers "
                     f"below are from the last evaluation before it, at step {last['step']}.")
    g = r.get("geometry") or {}
    if g.get("scaled_from"):
        parts.append(f"Trained {g['variant']} with {g['n_layers']} layers, d_model {g['d_model']}, {g['n_heads']} "
                     f"heads of {g['head_dim']}" + (f", kv_rank {g['kv_rank']}, rope_dim {g['rope_dim']}"
                                                    if g["variant"] == "MLA"
                                                    else f", {g['n_kv_heads']} KV head{'s' * (g['n_kv_heads'] > 1)}")
                     + f": the CPU-sized version of {g['scaled_from']}.")
    parts += [f"After {r['steps_done']} steps the model predicts B in `A B ... A -> B` with "
             f"{100 * r['final_accuracy']:.1f}% accuracy (chance about {100 * r['chance_accuracy']:.1f}%; "
             f"target {100 * cfg.target_accuracy:.0f}%: {'reached' if r['reached_target'] else 'NOT reached'}"
             + (f", first at step {r['steps_to_target']})." if r["steps_to_target"] is not None else ").")]
    parts.append(f"Head {p['layer']}.{p['head']} became the previous-token head (score {p['score']:.2f}) and "
                 f"head {i['layer']}.{i['head']} the induction head (prefix-matching score {i['score']:.2f}).")
    parts += _rise_words(cfg, r)
    others = [last["induction"][cfg.n_layers - 1][h] for h in range(cfg.n_heads) if h != i["head"]]
    strong = [h for h in range(cfg.n_heads) if last["induction"][cfg.n_layers - 1][h] > 0.5]
    if len(strong) > 1:
        names = ", ".join(f"{i['layer']}.{h}" for h in strong)
        parts.append(f"{len(strong)} of the {cfg.n_heads} layer-{i['layer']} heads score above 0.5 on prefix "
                     f"matching: the induction role is shared (heads {names}).")
    elif others:
        parts.append(f"The other layer-{i['layer']} heads score at most {max(others):.2f} on prefix matching.")
    return " ".join(parts)


MIN_RISE = 0.05  # a score or accuracy that moved less than this over training did not "rise"


def _rise_words(cfg: InductionConfig, r: dict) -> list[str]:
    """The phase change in words, saying only what was measured: nothing about a jump, a
    half-rise step or an accuracy jump when there was no rise to speak of (a --quick run of
    a few steps: "+-0.00 in 25 steps; half its rise by step 0" said nothing true)."""
    evals = r["evals"]
    if len(evals) < 2:
        return [f"Only {len(evals)} evaluation{'s' * (len(evals) != 1)}: no rise can be measured "
                "(train longer, or evaluate more often)."]
    i = r["induction_head"]
    curve = [e["induction"][i["layer"]][i["head"]] for e in evals]
    acc = [e["accuracy"] for e in evals]
    first, last_step = evals[0]["step"], evals[-1]["step"]
    out = []
    if r.get("phase_change_step") is None:
        out.append(f"The induction score did not rise between steps {first} and {last_step} "
                   f"({curve[0]:.2f} -> {curve[-1]:.2f}, at most {max(curve):.2f}): no phase change in this run.")
    else:
        out.append(f"The induction score rose from {curve[0]:.2f} to {max(curve):.2f}, most sharply just before "
                   f"step {r['phase_change_step']} (+{r['phase_change_jump']:.2f} in the {cfg.eval_every} steps "
                   f"before it); it had risen half way by step {r['induction_half_rise_step']}.")
    if r.get("accuracy_jump_step") is not None:
        out.append(f"The accuracy jumped most just before step {r['accuracy_jump_step']} "
                   f"({100 * acc[0]:.1f}% -> {100 * max(acc):.1f}% over the run).")
    else:
        out.append(f"The accuracy did not rise ({100 * acc[0]:.1f}% -> {100 * acc[-1]:.1f}%).")
    return out


def _plot(cfg: InductionConfig, res: dict, path: Path) -> str:
    plt = pyplot()
    r = res["results"]
    evals = r["evals"]
    steps = [e["step"] for e in evals]
    # The head legends sit outside the axes, right of them: inside, 16 entries covered the
    # curves and the phase-change label.
    legend_cols = 1 if cfg.n_heads <= 12 else 2
    fig, axes = plt.subplots(3, 1, figsize=(7.5 + 1.3 * legend_cols, 8.2), sharex=True)
    ax = axes[0]
    ax.plot(steps, [100 * e["accuracy"] for e in evals], color="black", lw=2, label="A B ... A -> B accuracy")
    ax.axhline(100 * cfg.target_accuracy, color="grey", ls="--", lw=1,
               label=f"target {100 * cfg.target_accuracy:.0f}%")
    ax.axhline(100 * r["chance_accuracy"], color="grey", ls=":", lw=1,
               label=f"chance {100 * r['chance_accuracy']:.1f}% (1 / {cfg.vocab} symbols)")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 102)
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    g = r.get("geometry") or {}
    kind = g.get("variant", "MHA")
    heads = f"{cfg.n_heads} heads per layer" + (f" ({g.get('n_kv_heads')} KV)" if kind in ("GQA", "MQA") else "")
    ax.set_title(f"{cfg.n_layers}-layer attention-only transformer ({kind}), {heads}, d_model {cfg.d_model}"
                 + (f", head_dim {g['head_dim']}" if g.get("scaled_from") else ""), fontsize=10)
    colours = distinct_colours(cfg.n_heads)
    for ax, key, layer, label in ((axes[1], "previous_token", 0, "previous-token score, layer 0"),
                                  (axes[2], "induction", cfg.n_layers - 1,
                                   f"induction (prefix-matching) score, layer {cfg.n_layers - 1}")):
        for h in range(cfg.n_heads):
            ax.plot(steps, [e[key][layer][h] for e in evals], color=colours[h], lw=1.8,
                    label=f"head {layer}.{h}")
        ax.set_ylabel(label.split(",")[0].replace(" score", "") + " score")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(frameon=False, fontsize=8, ncol=legend_cols, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title(label, fontsize=9)
    for ax in axes:
        if r.get("phase_change_step") is not None:
            ax.axvline(r["phase_change_step"], color="#c44e52", lw=1, ls="--")
    if r.get("phase_change_step") is not None:
        axes[2].text(r["phase_change_step"], 0.3, " phase change", color="#c44e52", fontsize=8)
    axes[-1].set_xlabel("training step")
    fig.tight_layout()
    return save_figure(fig, path)
