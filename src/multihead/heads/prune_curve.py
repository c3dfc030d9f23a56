"""Michel, Levy & Neubig (2019)'s pruning curve on a decoder language model: held-out
perplexity as 0 to 50% of the heads go, least important first against random orders.

Heads go in units a grouped-query model can hold (whole groups, or the same count from
every group), by re-estimated importance or in seeded random orders.

Details: docs/heads.md, "The pruning curve: units, orders and text".
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

__all__ = ["FRACTIONS", "SEEDS", "UNITS", "kjv_windows", "prune_curve_lm", "padded_shape", "plot_curves"]

FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
SEEDS = (0, 1, 2)
UNITS = ("groups", "heads")
EVAL_WINDOWS, EVAL_LENGTH = 8, 256  # held-out perplexity: 8 x 256 predicted tokens
IMP_BATCHES, IMP_BATCH, IMP_LENGTH = 4, 4, 128  # importance: 4 batches of 4 x 128 tokens


def kjv_windows(tokenizer, n: int, length: int, held_out: bool) -> torch.Tensor:
    """(n, length + 1) token ids: n windows spread evenly over the KJV's held-out books
    (Romans to Revelation) or its training books (Genesis to Acts), each after the
    tokenizer's own prefix (its BOS, where it puts one)."""
    from multihead.corpus import split_kjv
    from multihead.tokens import pieces, prefix, windows

    train, held = split_kjv()
    ids = torch.tensor(pieces(tokenizer, held if held_out else train), dtype=torch.long)
    if len(ids) < n * (length + 1):
        raise ValueError(f"the KJV split has {len(ids)} tokens; {n} windows of {length + 1} need more")
    start = prefix(tokenizer)  # each window begins as a text does for the model (Gemma: <bos>)
    starts = torch.linspace(0, len(ids) - length - 1 + len(start), n).long()
    return windows(start, ids, starts, length + 1)


def _geometry(model) -> tuple[int, int, int]:
    """(layers, query heads, key/value heads) of a transformers Llama-family model."""
    from multihead.heads._prune import hf_attention_modules

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = len(hf_attention_modules(model))
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    if not layers or not isinstance(getattr(cfg, "head_dim", None), int):
        raise ValueError(f"{type(model).__name__} is not a transformers model with q/k/v/o projections and a "
                         "head_dim in its config (Llama, Mistral, Qwen2/3, ...); the pruning curve groups its heads")
    return layers, H, Hkv


def _nll(model, windows: torch.Tensor) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows.split(4):
            logits = model(input_ids=w[:, :-1], use_cache=False).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(),
                                                             reduction="sum"))
            count += w[:, 1:].numel()
    return total / count


def _ppl(model, windows, removed) -> float:
    from multihead import heads

    if not removed:
        return math.exp(_nll(model, windows))
    with heads.ablate(model, sorted(removed)):
        return math.exp(_nll(model, windows))


class _Layout:
    """Which heads are left, and the units that may still go."""

    def __init__(self, L: int, H: int, Hkv: int, unit: str):
        self.L, self.H, self.Hkv, self.G, self.unit = L, H, Hkv, H // Hkv, unit
        self.removed: set[tuple[int, int]] = set()

    def group(self, layer: int, j: int) -> list[int]:
        return [h for h in range(j * self.G, (j + 1) * self.G) if (layer, h) not in self.removed]

    def candidates(self, layer: int, score=None) -> list[list[tuple[int, int]]]:
        """The units of `layer` that may go now (each a list of its heads)."""
        groups = [self.group(layer, j) for j in range(self.Hkv)]
        if self.unit == "groups":
            alive = [hs for hs in groups if hs]
            return [[(layer, h) for h in hs] for hs in alive] if len(alive) > 1 else []
        if any(len(hs) < 2 for hs in groups):
            return []
        key = (lambda h: (score[layer, h].item(), h)) if score is not None else None
        return [[(layer, min(hs, key=key) if key else hs[0]) for hs in groups]]

    def unit_size(self) -> int:
        return self.G if self.unit == "groups" else self.Hkv


def _target_units(layout: _Layout, fraction: float) -> int:
    return int(round(fraction * layout.L * layout.H / layout.unit_size()))


def _importance(model, batches, removed):
    from multihead import heads

    def loss(m, b):
        logits = m(input_ids=b[:, :-1], use_cache=False).logits.float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())

    if not removed:
        return heads.importance(model, batches, loss)
    with heads.ablate(model, sorted(removed)):
        return heads.importance(model, batches, loss)


def _by_importance(model, batches, windows, L, H, Hkv, unit, fractions, say) -> list[dict]:
    layout = _Layout(L, H, Hkv, unit)
    points, units = [], 0
    for f in fractions:
        target = _target_units(layout, f)
        if target > units:
            score = _importance(model, batches, layout.removed)
            while units < target:
                cands = [c for layer in range(L) for c in layout.candidates(layer, score)]
                if not cands:
                    raise ValueError(f"no {unit} unit can go at {f:.0%} without emptying a layer or a group")
                best = min(cands, key=lambda c: (sum(score[i, h].item() for i, h in c), c))
                layout.removed.update(best)
                units += 1
        ppl = _ppl(model, windows, layout.removed)
        say(f"{unit} by importance, {f:.0%} removed: perplexity {ppl:.2f}")
        points.append({"fraction": f, "removed_heads": len(layout.removed), "val_ppl": ppl,
                       "removed": sorted([list(p) for p in layout.removed])})
    return points


def _random_order(L, H, Hkv, unit, seed: int) -> list[list[tuple[int, int]]]:
    """Every unit that can go, in a random order that keeps one group per layer (one head per group)."""
    rng = random.Random(seed)
    G = H // Hkv
    if unit == "groups":
        pool = [(i, j) for i in range(L) for j in range(Hkv)]
        rng.shuffle(pool)
        order, left = [], {i: Hkv for i in range(L)}
        for i, j in pool:
            if left[i] > 1:
                order.append([(i, h) for h in range(j * G, (j + 1) * G)])
                left[i] -= 1
        return order
    perms = {(i, j): rng.sample(range(j * G, (j + 1) * G), G) for i in range(L) for j in range(Hkv)}
    tokens = [(i, k) for i in range(L) for k in range(G - 1)]
    rng.shuffle(tokens)
    level = {i: 0 for i in range(L)}
    order = []
    for i, _ in tokens:
        order.append([(i, perms[i, j][level[i]]) for j in range(Hkv)])
        level[i] += 1
    return order


def _by_random(model, windows, L, H, Hkv, unit, fractions, seeds, say, base_ppl) -> list[dict]:
    layout = _Layout(L, H, Hkv, unit)
    orders = {s: _random_order(L, H, Hkv, unit, s) for s in seeds}
    points = []
    for f in fractions:
        n = _target_units(layout, f)
        per_seed = []
        for s in seeds:
            removed = {p for u in orders[s][:n] for p in u}
            per_seed.append(base_ppl if not removed else _ppl(model, windows, removed))
        med = statistics.median(per_seed)
        say(f"{unit} in random orders, {f:.0%} removed: median perplexity {med:.2f} "
            f"({', '.join(f'{v:.2f}' for v in per_seed)})")
        points.append({"fraction": f, "removed_heads": n * layout.unit_size(), "val_ppl_median": med,
                       "val_ppl_seeds": per_seed})
    return points


def padded_shape(L: int, H: int, Hkv: int, removed, per_head: tuple[int, int] | None = None,
                 params: int | None = None) -> dict:
    """What `heads.prune(model, removed, pad=True)` keeps: the widest layer's key/value heads
    and query heads per group (every layer is laid out so), the query heads each layer keeps,
    and with `per_head` (parameters per query head, per key/value head) and the model's
    `params`, the parameters of the pruned model."""
    G = H // Hkv
    gone = {tuple(p) for p in removed}
    kv, per_group, kept = 0, 0, []
    for i in range(L):
        sizes = [sum((i, h) not in gone for h in range(j * G, (j + 1) * G)) for j in range(Hkv)]
        kv = max(kv, sum(s > 0 for s in sizes))
        per_group = max(per_group, max(sizes))
        kept.append(sum(sizes))
    out = {"num_key_value_heads": kv, "num_attention_heads": kv * per_group, "query_heads_kept_per_layer": kept}
    if per_head is not None and params is not None:
        out["params"] = params - L * ((H - kv * per_group) * per_head[0] + (Hkv - kv) * per_head[1])
    return out


def _per_head_params(model, H: int, Hkv: int) -> tuple[int, int]:
    """(parameters of one query head: its q_proj rows and o_proj columns, of one key/value
    head: its k_proj and v_proj rows), biases included."""
    from multihead.heads._prune import hf_attention_modules

    m = hf_attention_modules(model)[0]

    def size(lin, n: int) -> int:
        return sum(p.numel() for p in lin.parameters()) // n

    o_cols = m.o_proj.weight.numel() // H  # the output bias does not scale with the heads
    return size(m.q_proj, H) + o_cols, size(m.k_proj, Hkv) + size(m.v_proj, Hkv)


def prune_curve_lm(model, tokenizer, *, units=UNITS, fractions=FRACTIONS, seeds=SEEDS, say=print) -> dict:
    """The curves of a transformers Llama-family model (on attn_implementation="multihead"):
    results.json's object (`curves[unit]["importance"|"random"]`, `base_ppl`, ...)."""
    t0, c0 = time.perf_counter(), time.process_time()
    L, H, Hkv = _geometry(model)
    bad = [u for u in units if u not in UNITS]
    if bad:
        raise ValueError(f"units must be some of {', '.join(UNITS)}; received {', '.join(map(str, bad))}")
    windows = kjv_windows(tokenizer, EVAL_WINDOWS, EVAL_LENGTH, held_out=True)
    train = kjv_windows(tokenizer, IMP_BATCHES * IMP_BATCH, IMP_LENGTH, held_out=False)
    batches = list(train.split(IMP_BATCH))
    was = model.training
    model.eval()
    try:
        base = _ppl(model, windows, set())
        say(f"base: perplexity {base:.2f}")
        first = _importance(model, batches, set())
        per_head, params = _per_head_params(model, H, Hkv), sum(p.numel() for p in model.parameters())
        curves = {}
        for unit in units:
            imp = _by_importance(model, batches, windows, L, H, Hkv, unit, fractions, say)
            for p in imp:
                p.update(padded_shape(L, H, Hkv, p["removed"], per_head, params))
            rnd = _by_random(model, windows, L, H, Hkv, unit, fractions, seeds, say, base)
            curves[unit] = {"unit_heads": H // Hkv if unit == "groups" else Hkv, "importance": imp, "random": rnd}
    finally:
        model.train(was)
    return {"layers": L, "num_attention_heads": H, "num_key_value_heads": Hkv, "total_heads": L * H,
            "metric": f"held-out perplexity: KJV Romans to Revelation, {EVAL_WINDOWS} windows of {EVAL_LENGTH} "
                      "tokens spread evenly",
            "importance_text": f"KJV Genesis to Acts, {IMP_BATCHES} batches of {IMP_BATCH} x {IMP_LENGTH} tokens",
            "fractions": list(fractions), "seeds": list(seeds), "base_ppl": base, "params": params,
            "importance": [[round(x, 6) for x in row.tolist()] for row in first], "curves": curves,
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


def plot_curves(r: dict, path, title: str) -> None:
    """Perplexity (log) against the share of heads removed: by importance and random, per unit."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from multihead.files import atomic_path

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for unit, colour in zip(r["curves"], ("tab:blue", "tab:orange")):
        c = r["curves"][unit]
        ax.plot([100 * p["fraction"] for p in c["importance"]], [p["val_ppl"] for p in c["importance"]],
                marker="o", color=colour, label=f"{unit}: by importance")
        ax.plot([100 * p["fraction"] for p in c["random"]], [p["val_ppl_median"] for p in c["random"]],
                marker="x", ls="--", color=colour, label=f"{unit}: random (median of {len(r['seeds'])})")
    ax.axhline(r["base_ppl"], color="grey", ls=":", label="no head removed")
    ax.set_yscale("log")
    ax.set_xlabel("heads removed (%)")
    ax.set_ylabel("held-out perplexity (KJV Romans-Revelation)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
