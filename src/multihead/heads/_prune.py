"""`prune`: remove heads physically, where the model can hold what is left.

- multihead `Attention`: any set of query heads. A key/value head goes when all its
  query heads go. When the groups left are uneven (GQA with some heads of a group gone),
  the key/value heads are repeated so every group has G' = gcd(group sizes) query heads:
  the same function, in the module's one-G layout.
- multihead `LatentAttention`: query heads with their rows of the query projection and
  of the up-projection `kv_b_proj` ([W_UK_h ; W_UV_h]) and their columns of `o_proj`;
  the latent is shared and stays.
- transformers models whose config carries `head_dim` and whose attention has
  q_proj/k_proj/v_proj/o_proj (Llama, Mistral, Qwen2/3, Gemma, GPT-OSS, ...): removals
  that leave every layer the same H' query and Hkv' key/value heads with H'/Hkv' heads
  in every group (whole KV groups, or the same number of heads of each group). The
  config is updated, so `save_pretrained` writes a model stock transformers loads.

Layers are numbered in module order (`model.modules()`), the order they run in for the
models this applies to.
"""

from __future__ import annotations

import copy
import math
from functools import reduce

import torch
from torch import nn

from multihead.attention import Attention
from multihead.heads._engine import is_hf, multihead_modules
from multihead.heads._interventions import check_heads


def _linear(old: nn.Linear, rows: list[int] | None = None, cols: list[int] | None = None) -> nn.Linear:
    w = old.weight.detach()
    if rows is not None:
        w = w[rows]
    if cols is not None:
        w = w[:, cols]
    new = nn.Linear(w.shape[1], w.shape[0], bias=old.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if old.bias is not None:
            new.bias.copy_(old.bias.detach() if rows is None else old.bias.detach()[rows])
    new.weight.requires_grad_(old.weight.requires_grad)
    return new


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


def _prune_attention(m: Attention, removed: set[int], where: str) -> None:
    D = m.head_dim
    keep, kv = _plan(m.n_heads, m.n_kv_heads, removed, where)
    m.q_proj = _linear(m.q_proj, rows=_rows(keep, D))
    m.k_proj = _linear(m.k_proj, rows=_rows(kv, D))
    m.v_proj = _linear(m.v_proj, rows=_rows(kv, D))
    m.o_proj = _linear(m.o_proj, cols=_rows(keep, D))
    m.n_heads, m.n_kv_heads = len(keep), len(kv)


def _prune_latent(m, removed: set[int], where: str) -> None:
    keep = [h for h in range(m.n_heads) if h not in removed]
    qk = m.head_dim + m.rope_dim
    if m.q_rank is None:
        m.q_proj = _linear(m.q_proj, rows=_rows(keep, qk))
    else:
        m.q_b_proj = _linear(m.q_b_proj, rows=_rows(keep, qk))
    m.kv_b_proj = _linear(m.kv_b_proj, rows=_rows(keep, m.head_dim + m.v_head_dim))
    m.o_proj = _linear(m.o_proj, cols=_rows(keep, m.v_head_dim))
    m.n_heads = len(keep)


def _hf_attention_modules(model) -> list[nn.Module]:
    return [m for m in model.modules()
            if all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))]


def _refuse_hf(model, reason: str):
    raise ValueError(f"cannot prune this {type(model).__name__} physically: {reason}; use "
                     "multihead.heads.ablate(model, heads) for the same function without removing weights")


def _prune_hf(model, by_layer: dict[int, set[int]]) -> None:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    D = getattr(text, "head_dim", None)
    if not isinstance(D, int):
        _refuse_hf(model, f"its config ({type(text).__name__}) carries no head_dim, so it cannot describe fewer "
                          "heads of the same width")
    mods = _hf_attention_modules(model)
    if not mods:
        _refuse_hf(model, "its attention has no separate q_proj/k_proj/v_proj/o_proj")
    H, Hkv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    bad = sorted(i for i in by_layer if i >= len(mods))
    if bad:
        raise ValueError(f"layer(s) {bad} out of range: this model has {len(mods)} attention layers")
    plans = []
    for i, m in enumerate(mods):
        removed = by_layer.get(i, set())
        out = [h for h in removed if h >= H]
        if out:
            raise ValueError(f"head(s) {out} out of range in layer {i}, which has {H} query heads")
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
    trial = copy.deepcopy(text)  # the config must still pass transformers' own validation
    try:
        trial.num_attention_heads = H2
        if hasattr(trial, "num_key_value_heads"):
            trial.num_key_value_heads = Hkv2
        if hasattr(trial, "validate"):
            trial.validate()
    except Exception as err:  # noqa: BLE001 (transformers' validators raise their own kinds)
        _refuse_hf(model, f"transformers' {type(text).__name__} would not hold {H2} query / {Hkv2} key-value heads "
                          f"({str(err).splitlines()[-1].strip()})")
    for m, keep, kv in plans:
        m.q_proj = _linear(m.q_proj, rows=_rows(keep, D))
        m.k_proj = _linear(m.k_proj, rows=_rows(kv, D))
        m.v_proj = _linear(m.v_proj, rows=_rows(kv, D))
        m.o_proj = _linear(m.o_proj, cols=_rows(keep, D))
        sinks = getattr(m, "sinks", None)
        if isinstance(sinks, nn.Parameter) and sinks.shape == (H,):
            m.sinks = nn.Parameter(sinks.detach()[keep].clone(), requires_grad=sinks.requires_grad)
        if hasattr(m, "num_key_value_groups"):
            m.num_key_value_groups = len(keep) // len(kv)
    text.num_attention_heads = H2
    if hasattr(text, "num_key_value_heads"):
        text.num_key_value_heads = Hkv2


def prune(model: nn.Module, heads) -> nn.Module:
    """Remove query heads `heads` ((layer, head) pairs) physically, in place; returns the model.

    What is left computes what `ablate(model, heads)` computes. Models that cannot hold
    the result (BERT/GPT-2, whose configs derive the head width from the head count;
    uneven removals in transformers models) are refused with the reason.
    """
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
        for i, removed in by_layer.items():
            m = mine[i]
            out = [h for h in removed if h >= m.n_heads]
            if out:
                raise ValueError(f"head(s) {sorted(out)} out of range in layer {i}, which has {m.n_heads} query heads")
        for i, removed in by_layer.items():  # every check before the first change
            m = mine[i]
            if isinstance(m, Attention):
                if m.alibi:
                    raise ValueError(f"layer {i} uses ALiBi, whose slopes follow the head count: pruning would "
                                     "change the remaining heads; use multihead.heads.ablate")
                _plan(m.n_heads, m.n_kv_heads, removed, f"layer {i}")
            elif len(removed) >= m.n_heads:
                raise ValueError(f"pruning would remove every head of layer {i}; keep at least one")
        for i, removed in by_layer.items():
            m = mine[i]
            (_prune_attention if isinstance(m, Attention) else _prune_latent)(m, removed, f"layer {i}")
        return model
    if is_hf(model):
        _prune_hf(model, by_layer)
        return model
    raise ValueError(f"{type(model).__name__} has no multihead Attention/LatentAttention module and is not a "
                     "transformers model; nothing to prune")
