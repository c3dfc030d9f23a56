"""Change `num_key_value_heads` of a trained Hugging Face model: MHA/GQA -> GQA/MQA.

`transformers_to_gqa(model, n_kv_heads, init="mean")` (what `multihead.convert.to_gqa`
calls for a transformers model; use that) returns a deep copy of a transformers model
whose attention layers have separate `k_proj` / `v_proj` Linear layers and whose config
carries `num_key_value_heads` (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3
text): in every such layer each group of key/value heads becomes one (mean-pooled, as
Ainslie et al. 2023; or the first of the group; or drawn afresh, see
`multihead.convert.to_gqa`), the Linear layers shrink to the new width, and the layer's
`num_key_value_groups` and the model's
`config.num_key_value_heads` follow. The result is an ordinary transformers model:
`save_pretrained` writes it and stock transformers loads it, eager attention included.

Everything else (queries, output projections, Qwen3/Gemma3's per-head q/k norms, which
act on each head's D dims and are shared by all heads) is copied unchanged. Importing
this module registers attn_implementation="multihead" (the package does, on import).

transformers is never imported here: the model's own classes are used.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["kv_layers", "transformers_to_gqa"]


def kv_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every attention layer with k_proj and v_proj Linear
    layers and a head_dim: the layers `transformers_to_gqa` converts."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "k_proj", None), nn.Linear) and isinstance(getattr(m, "v_proj", None), nn.Linear)
            and isinstance(getattr(m, "head_dim", None), int)]


def _check(model: nn.Module, n_kv_heads) -> tuple[int, int]:
    """(n_heads, old n_kv_heads) of the model's config, after checking the request."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    H, old = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not isinstance(H, int) or not isinstance(old, int):
        raise TypeError(f"to_gqa: {name}'s config has no num_attention_heads / num_key_value_heads (a model whose "
                        "config nests them, such as a vision-language model, is not converted); valid: Llama, "
                        "Mistral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3 text models")
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1 or old % n_kv_heads:
        valid = [d for d in range(1, old + 1) if old % d == 0]
        raise ValueError(f"n_kv_heads must divide the model's {old} key/value heads (config.num_key_value_heads); "
                         f"received {n_kv_heads!r}; valid: {', '.join(map(str, valid))}")
    layers = kv_layers(model)
    if not layers:
        raise TypeError(f"to_gqa: {name} has no attention layer with separate k_proj and v_proj Linear layers "
                        "(a fused qkv projection, as Phi-3's, is not converted); valid: Llama, Mistral, Qwen2, "
                        "Qwen3, Gemma, Gemma2, Gemma3 text models")
    for lname, m in layers:
        if m.k_proj.out_features != old * m.head_dim or m.v_proj.out_features != old * m.head_dim:
            raise ValueError(f"to_gqa: layer {lname} has {m.k_proj.out_features // m.head_dim} key heads, but the "
                             f"config says num_key_value_heads = {old}")
    return H, old


def _shrunk(lin: nn.Linear, n_kv_heads: int, head_dim: int, init: str, generator) -> nn.Linear:
    """A Linear with n_kv_heads * D outputs: lin's heads pooled group by group."""
    from multihead.conversion_parts import pool_kv_heads

    w = lin.weight
    new = nn.Linear(lin.in_features, n_kv_heads * head_dim, bias=lin.bias is not None, device=w.device,
                    dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(pool_kv_heads(w, n_kv_heads, head_dim, init=init, generator=generator))
        if lin.bias is not None:
            new.bias.copy_(pool_kv_heads(lin.bias, n_kv_heads, head_dim, init=init, generator=generator))
    new.train(lin.training)
    new.weight.requires_grad_(w.requires_grad)
    return new


def transformers_to_gqa(model: nn.Module, n_kv_heads: int, *, init: str = "mean",
                        generator: torch.Generator | None = None, return_report: bool = False):
    """A copy of a transformers model with `n_kv_heads` key/value heads in every layer.

    Returns the model, or `(model, multihead.convert.ConversionReport)` with the relative
    K/V reconstruction error of every layer. The input model is untouched.

    Raises:
        ValueError: n_kv_heads does not divide config.num_key_value_heads; an unknown init.
        TypeError: a model without num_key_value_heads in its config, or without separate
            k_proj / v_proj layers.
    """
    from multihead.conversion_parts import GQA_INITS, ConversionReport, LayerConversion, grouped_kv_error

    if init not in GQA_INITS:
        raise ValueError(f"init must be one of {', '.join(GQA_INITS)}; received {init!r}")
    H, old = _check(model, n_kv_heads)
    new = copy.deepcopy(model)
    rows = []
    for name, attn in kv_layers(new):
        D = attn.head_dim
        k, v = attn.k_proj, attn.v_proj
        attn.k_proj = _shrunk(k, n_kv_heads, D, init, generator)
        attn.v_proj = _shrunk(v, n_kv_heads, D, init, generator)
        if hasattr(attn, "num_key_value_groups"):
            attn.num_key_value_groups = H // n_kv_heads
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = n_kv_heads
        rows.append(LayerConversion(name, grouped_kv_error((k.weight, v.weight, v.bias),
                                                           (attn.k_proj.weight, attn.v_proj.weight, attn.v_proj.bias),
                                                           D)))
    for module in new.modules():  # the config object is shared by the layers; nested copies too
        config = getattr(module, "config", None)
        if getattr(config, "num_key_value_heads", None) == old:
            config.num_key_value_heads = n_kv_heads
    import multihead.interop.hf  # noqa: F401  (registers attn_implementation="multihead")

    report = ConversionReport("MQA" if n_kv_heads == 1 else f"GQA-{n_kv_heads}", init, tuple(rows))
    return (new, report) if return_report else new
