"""`prune`: remove heads physically, where the model can hold what is left.

Every projection is narrowed in place (the module stays the same object: hooks and every
holder of it see the pruned weights), and each parameter keeps its `requires_grad`. Layers
are numbered in module order (`model.modules()`).

Details: docs/heads.md, "What `prune` can remove, model by model".
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from functools import reduce

from torch import nn

from multihead.attention import Attention
from multihead.decoder import LabConfig
from multihead.head_access import HeadAccess
from multihead.heads._interventions import check_heads
from multihead.heads.engine import is_hf, multihead_modules
from multihead.latent import LatentAttention


def _narrow(lin: nn.Linear, rows: list[int] | None = None, cols: list[int] | None = None) -> nn.Linear:
    """Keep output rows `rows` / input columns `cols` of `lin`, in place; returns `lin`."""
    w = lin.weight.detach()
    if rows is not None:
        w = w[rows]
    if cols is not None:
        w = w[:, cols]
    lin.weight = nn.Parameter(w.clone(), requires_grad=lin.weight.requires_grad)
    if lin.bias is not None and rows is not None:
        lin.bias = nn.Parameter(lin.bias.detach()[rows].clone(), requires_grad=lin.bias.requires_grad)
    lin.out_features, lin.in_features = w.shape
    return lin


def _rows(heads: list[int], width: int) -> list[int]:
    return [h * width + i for h in heads for i in range(width)]


def _plan(H: int, Hkv: int, removed: set[int], where: str) -> tuple[list[int], list[int]]:
    """(query heads kept, key/value heads of the new layout, repeated where groups are uneven)."""
    keep = [h for h in range(H) if h not in removed]
    if not keep:
        raise ValueError(f"pruning would remove every head of {where}; keep at least one (or drop the layer)")
    G = H // Hkv
    sizes = {j: sum(1 for h in keep if h // G == j) for j in range(Hkv)}
    sizes = {j: s for j, s in sizes.items() if s}
    g = reduce(math.gcd, sizes.values())
    kv = [j for j, s in sizes.items() for _ in range(s // g)]
    return keep, kv


# The classes whose head counts prune knows how to set after narrowing what `head_access()`
# names: another variant's forward may read its counts from anywhere, so it is refused by name.
_SETS_COUNTS = (Attention, LatentAttention)


def _access(m: nn.Module, i: int) -> HeadAccess:
    """Layer `i`'s heads as the tools see them; a module prune cannot narrow is refused, by name."""
    if not isinstance(m, _SETS_COUNTS):
        raise ValueError(f"cannot prune layer {i} physically: it is a {type(m).__name__}, and prune narrows only "
                         "multihead's Attention and LatentAttention (it cannot know where another module's "
                         "forward reads its head counts); use multihead.heads.ablate(model, heads) for the same "
                         "function without removing weights")
    return m.head_access()


def _prune_module(m: nn.Module, a: HeadAccess, removed: set[int], where: str) -> None:
    """Narrow the projections `a` names to the kept heads, then the module's head counts."""
    if a.kind == "attention":
        keep, kv = _plan(a.H, a.Hkv, removed, where)
        _narrow(a.k, rows=_rows(kv, a.D))
        _narrow(a.v, rows=_rows(kv, a.Dv))
        m.n_heads, m.n_kv_heads = len(keep), len(kv)
    else:  # latent: every head reads the one latent through its rows of the up-projection
        keep = [h for h in range(a.H) if h not in removed]
        _narrow(a.kv, rows=_rows(keep, a.D + a.Dv))
        m.n_heads = len(keep)
    _narrow(a.q, rows=_rows(keep, a.q.out_features // a.H))  # D, or D + rope for MLA
    _narrow(a.o, cols=_rows(keep, a.Dv))


def hf_attention_modules(model) -> list[nn.Module]:
    return [m for m in model.modules()
            if all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))]


def _refuse_hf(model, reason: str):
    raise ValueError(f"cannot prune this {type(model).__name__} physically: {reason}; use "
                     "multihead.heads.ablate(model, heads) for the same function without removing weights")


def _check_config(model, text, H2: int, Hkv2: int) -> None:
    """Refuse counts transformers' own validation of the config would not take (before any change)."""
    trial = copy.deepcopy(text)
    try:
        trial.num_attention_heads = H2
        if hasattr(trial, "num_key_value_heads"):
            trial.num_key_value_heads = Hkv2
        if hasattr(trial, "validate"):
            trial.validate()
    except Exception as err:  # noqa: BLE001 (transformers' validators raise their own kinds)
        _refuse_hf(model, f"transformers' {type(text).__name__} would not hold {H2} query / {Hkv2} key-value heads "
                          f"({str(err).splitlines()[-1].strip()})")


def _padded(lin: nn.Linear, blocks: list[int | None], width: int, rows: bool) -> None:
    """Lay `lin` out as `blocks` of `width` rows (or input columns): block b copies the
    original's block `blocks[b]`, or is zero where that is None (an inert head); in place."""
    import torch

    w = lin.weight.detach()
    n = len(blocks) * width
    new = w.new_zeros((n, w.shape[1]) if rows else (w.shape[0], n))
    bias = lin.bias.detach().new_zeros(n) if rows and lin.bias is not None else None
    for b, src in enumerate(blocks):
        if src is None:
            continue
        if rows:
            new[b * width:(b + 1) * width] = w[src * width:(src + 1) * width]
            if bias is not None:
                bias[b * width:(b + 1) * width] = lin.bias.detach()[src * width:(src + 1) * width]
        else:
            new[:, b * width:(b + 1) * width] = w[:, src * width:(src + 1) * width]
    with torch.no_grad():
        lin.weight = nn.Parameter(new, requires_grad=lin.weight.requires_grad)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=lin.bias.requires_grad)
    lin.out_features, lin.in_features = new.shape


def _pad_layout(H: int, Hkv: int, removed: set[int], where: str) -> list[tuple[int, list[int]]]:
    """The kept (key/value head, its kept query heads) of one layer, in order."""
    G = H // Hkv
    groups = [(j, [h for h in range(j * G, (j + 1) * G) if h not in removed]) for j in range(Hkv)]
    groups = [(j, hs) for j, hs in groups if hs]
    if not groups:
        raise ValueError(f"pruning would remove every head of {where}; keep at least one (or drop the layer)")
    return groups


def _prune_hf_padded(model, mods: list[nn.Module], text, H: int, Hkv: int, D: int,
                     by_layer: dict[int, set[int]]) -> None:
    layouts = [_pad_layout(H, Hkv, by_layer.get(i, set()), f"layer {i}") for i in range(len(mods))]
    Hkv2 = max(len(lay) for lay in layouts)
    G2 = max(len(hs) for lay in layouts for _, hs in lay)
    _check_config(model, text, Hkv2 * G2, Hkv2)
    for m, lay in zip(mods, layouts):
        slots = lay + [(None, [])] * (Hkv2 - len(lay))  # inert groups after the kept ones
        kv = [j for j, _ in slots]
        q = [hs[t] if t < len(hs) else None for _, hs in slots for t in range(G2)]
        _padded(m.q_proj, q, D, rows=True)
        _padded(m.k_proj, kv, D, rows=True)
        _padded(m.v_proj, kv, D, rows=True)
        _padded(m.o_proj, q, D, rows=False)
        sinks = getattr(m, "sinks", None)
        if isinstance(sinks, nn.Parameter) and sinks.shape == (H,):
            new = sinks.detach().new_zeros(len(q))
            for b, src in enumerate(q):
                if src is not None:
                    new[b] = sinks.detach()[src]
            m.sinks = nn.Parameter(new, requires_grad=sinks.requires_grad)
        if hasattr(m, "num_key_value_groups"):
            m.num_key_value_groups = G2
    text.num_attention_heads = Hkv2 * G2
    if hasattr(text, "num_key_value_heads"):
        text.num_key_value_heads = Hkv2


def _prune_hf(model, by_layer: dict[int, set[int]], pad: bool = False) -> None:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    D = getattr(text, "head_dim", None)
    if not isinstance(D, int):
        _refuse_hf(model, f"its config ({type(text).__name__}) carries no head_dim, so it cannot describe fewer "
                          "heads of the same width")
    mods = hf_attention_modules(model)
    if not mods:
        _refuse_hf(model, "its attention has no separate q_proj/k_proj/v_proj/o_proj")
    H, Hkv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    bad = sorted(i for i in by_layer if i >= len(mods))
    if bad:
        raise ValueError(f"layer(s) {bad} out of range: this model has {len(mods)} attention layers")
    for i, removed in by_layer.items():
        out = sorted(h for h in removed if h >= H)
        if out:
            raise ValueError(f"head(s) {out} out of range in layer {i}, which has {H} query heads")
    if pad:
        _prune_hf_padded(model, mods, text, H, Hkv, D, by_layer)
        return
    plans = []
    for i, m in enumerate(mods):
        removed = by_layer.get(i, set())
        keep, kv = _plan(H, Hkv, removed, f"layer {i}")
        if len(set(kv)) != len(kv):
            _refuse_hf(model, f"layer {i} would keep uneven groups of query heads per key/value head; remove whole "
                              "groups or the same number of heads from each group")
        plans.append((m, keep, kv))
    shapes = {(len(k), len(kv)) for _, k, kv in plans}
    if len(shapes) > 1:
        _refuse_hf(model, f"the layers would keep different head counts {sorted(shapes)} and its config holds one "
                          "count for all layers; remove the same number of heads in every layer")
    (H2, Hkv2), = shapes
    _check_config(model, text, H2, Hkv2)
    for m, keep, kv in plans:
        _narrow(m.q_proj, rows=_rows(keep, D))
        _narrow(m.k_proj, rows=_rows(kv, D))
        _narrow(m.v_proj, rows=_rows(kv, D))
        _narrow(m.o_proj, cols=_rows(keep, D))
        sinks = getattr(m, "sinks", None)
        if isinstance(sinks, nn.Parameter) and sinks.shape == (H,):
            m.sinks = nn.Parameter(sinks.detach()[keep].clone(), requires_grad=sinks.requires_grad)
        if hasattr(m, "num_key_value_groups"):
            m.num_key_value_groups = len(keep) // len(kv)
    text.num_attention_heads = H2
    if hasattr(text, "num_key_value_heads"):
        text.num_key_value_heads = Hkv2


def _owners(model: nn.Module) -> dict[int, nn.Module]:
    """id(LatentAttention) -> the patched DeepSeek layer computing with it (`interop.hf.use_latent_attention`)."""
    return {id(o.mla): o for o in model.modules() if isinstance(getattr(o, "mla", None), LatentAttention)}


def _plan_deepseek(model: nn.Module, mine: list, owners: dict[int, nn.Module],
                   by_layer: dict[int, set[int]]) -> tuple[int, int]:
    """(H', Hkv') of a patched DeepSeek model after the removal, checked against its config."""
    left = {m.n_heads - len(by_layer.get(i, ())) for i, m in enumerate(mine) if id(m) in owners}
    if len(left) > 1:
        raise ValueError(f"cannot prune this {type(model).__name__} physically: its layers would keep different "
                         f"head counts {sorted(left)} and its config holds one count for all layers; remove the same "
                         "number of heads in every layer, or use multihead.heads.ablate(model, heads)")
    (H2,) = left
    cfg = next(iter(owners.values())).original.config
    H, Hkv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    G = H // Hkv
    if H2 % G:
        raise ValueError(f"cannot prune this {type(model).__name__} physically: its config groups {G} query heads per "
                         f"key/value head (num_attention_heads {H}, num_key_value_heads {Hkv}) and {H2} heads "
                         f"would be left; keep a multiple of {G}, or use multihead.heads.ablate(model, heads)")
    _check_config(model, cfg, H2, H2 // G)
    return H2, H2 // G


def _configs(model: nn.Module, owners: dict[int, nn.Module]) -> list:
    """Every distinct config object that states the patched layers' head count."""
    found = {}
    for owner in owners.values():
        for c in (owner.original.config, getattr(owner, "config", None)):
            if c is not None:
                found[id(c)] = c
    cfg = getattr(model, "config", None)
    if cfg is not None:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        found[id(text)] = text
    return list(found.values())


def _set_deepseek_heads(owners: dict[int, nn.Module], configs: list, H2: int, Hkv2: int) -> None:
    for c in configs:
        c.num_attention_heads = H2
        if hasattr(c, "num_key_value_heads"):
            c.num_key_value_heads = Hkv2
    for owner in owners.values():  # the transformers layers restore_attention puts back compute with these counts
        original = owner.original
        original.num_heads = H2
        if hasattr(original, "num_key_value_groups"):
            original.num_key_value_groups = H2 // Hkv2


def _follow_lab_config(model: nn.Module, mine: list) -> None:
    """A lab model's `cfg` takes the new head counts when every layer has the same."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, LabConfig) or len(mine) != cfg.n_layers:
        return
    counts = {(m.n_heads, getattr(m, "n_kv_heads", m.n_heads)) for m in mine}
    if len(counts) != 1:
        return  # per-layer counts: save_lab_checkpoint records them from the modules
    (H2, Hkv2), = counts
    model.cfg = replace(cfg, n_heads=H2, n_kv_heads=None if Hkv2 == H2 or cfg.attention == "mla" else Hkv2)


def prune(model: nn.Module, heads, *, pad: bool = False) -> nn.Module:
    """Remove query heads `heads` ((layer, head) pairs) physically, in place; returns the model.

    What is left computes what `ablate(model, heads)` computes. Models that cannot hold
    the result (BERT/GPT-2, whose configs derive the head width from the head count;
    uneven removals in transformers models) are refused with the reason, unless `pad`:
    then a transformers model's layers are laid out as its widest one, filled with inert
    (all-zero) heads, so that one head count holds for every layer (multihead modules
    hold any removal and take no padding).
    """
    if not isinstance(pad, bool):
        raise TypeError(f"pad must be a bool; received {type(pad).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module; received {type(model).__name__}")
    pairs = check_heads(heads)
    by_layer: dict[int, set[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, set()).add(head)
    mine = multihead_modules(model)
    if mine:
        bad = sorted(i for i in by_layer if i >= len(mine))
        if bad:
            raise ValueError(f"layer(s) {bad} out of range: this model has {len(mine)} attention layers "
                             f"(0..{len(mine) - 1})")
        access = {i: _access(mine[i], i) for i in by_layer}
        for i, removed in by_layer.items():
            out = [h for h in removed if h >= access[i].H]
            if out:
                raise ValueError(f"head(s) {sorted(out)} out of range in layer {i}, which has {access[i].H} query "
                                 "heads")
        for i, removed in by_layer.items():  # every check before the first change
            a = access[i]
            if a.kind == "attention":
                if getattr(mine[i], "alibi", False):
                    raise ValueError(f"layer {i} uses ALiBi, whose slopes follow the head count: pruning would "
                                     "change the remaining heads; use multihead.heads.ablate")
                _plan(a.H, a.Hkv, removed, f"layer {i}")
            elif len(removed) >= a.H:
                raise ValueError(f"pruning would remove every head of layer {i}; keep at least one")
        owners = _owners(model)
        deepseek = _plan_deepseek(model, mine, owners, by_layer) if owners else None
        for i, removed in by_layer.items():
            _prune_module(mine[i], access[i], removed, f"layer {i}")
        if deepseek is not None:
            _set_deepseek_heads(owners, _configs(model, owners), *deepseek)
        _follow_lab_config(model, mine)
        return model
    if is_hf(model):
        _prune_hf(model, by_layer, pad)
        return model
    raise ValueError(f"{type(model).__name__} has no multihead Attention/LatentAttention module and is not a "
                     "transformers model; nothing to prune")
