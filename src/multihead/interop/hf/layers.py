"""One Hugging Face attention layer -> a standalone multihead module with its weights.

`from_bert`, `from_gpt2`, `from_llama` (and `from_layer`, which picks one) build a
`multihead.Attention`; `from_deepseek` a `multihead.LatentAttention`; `rotary_from_config`
reads a config's RoPE settings. To run a whole model on multihead, use
attn_implementation="multihead" (`registry`); these conversions take one layer out.
transformers is never imported here.

Details: docs/inspect.md, "One HF layer as a multihead module".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from multihead.attention import Attention
from multihead.latent import LatentAttention
from multihead.rope import RopeScaling, RotaryEmbedding

__all__ = ["from_bert", "from_deepseek", "from_gpt2", "from_layer", "from_llama", "rope_scaling_from_config",
           "rotary_from_config", "sliding_window_of"]

BERT_FAMILY = ("BertSelfAttention", "RobertaSelfAttention")
GPT2_FAMILY = ("GPT2Attention",)
LLAMA_FAMILY = ("LlamaAttention", "MistralAttention", "Qwen2Attention")
DEEPSEEK_FAMILY = ("DeepseekV2Attention", "DeepseekV3Attention")
SUPPORTED = BERT_FAMILY + GPT2_FAMILY + LLAMA_FAMILY + DEEPSEEK_FAMILY


# ------------------------------------------------------------------ weight copying


def _copy_linear(dst: nn.Linear, weight: Tensor, bias: Tensor | None) -> None:
    """dst <- (weight `(out, in)`, bias); a missing bias is removed, not zeroed."""
    with torch.no_grad():
        dst.weight.copy_(weight)
        if bias is None:
            dst.register_parameter("bias", None)
        else:
            dst.bias.copy_(bias)


def _fold_scale(attn: Attention, scaling: float) -> None:
    """Make attn's default scale 1/sqrt(D) compute `scaling`: scale q_proj by the ratio."""
    ratio = float(scaling) * math.sqrt(attn.head_dim)
    if math.isclose(ratio, 1.0, rel_tol=1e-12):
        return
    with torch.no_grad():
        attn.q_proj.weight.mul_(ratio)
        if attn.q_proj.bias is not None:
            attn.q_proj.bias.mul_(ratio)


def _like(attn: Attention, src: nn.Module, ref: Tensor) -> Attention:
    """On ref's device and dtype, in src's train/eval mode (dropout follows it)."""
    return attn.to(device=ref.device, dtype=ref.dtype).train(src.training)


def _class_name(module) -> str:
    return type(module).__name__


# ---------------------------------------------------------------- conversions


def from_bert(attention: nn.Module, *, backend: str = "auto") -> Attention:
    """A BERT-family `BertAttention` (self-attention + its BertSelfOutput) -> `Attention`.

    q/k/v are the `self.query/key/value` Linear layers, o_proj is `output.dense`. The
    module returns what `output.dense` returns; HF's BertSelfOutput then applies its
    dropout, the residual and the LayerNorm.
    """
    self_attn = getattr(attention, "self", None)
    dense = getattr(getattr(attention, "output", None), "dense", None)
    if _class_name(self_attn) not in BERT_FAMILY or not isinstance(dense, nn.Linear):
        raise TypeError(
            f"from_bert takes a BERT-family attention block (BertAttention / RobertaAttention: "
            f".self is a BertSelfAttention, .output.dense a Linear); received {_class_name(attention)}"
        )
    return _from_bert_parts(self_attn, dense, backend=backend)


def _from_bert_parts(self_attn: nn.Module, dense: nn.Linear, *, backend: str) -> Attention:
    H = self_attn.num_attention_heads
    D = self_attn.attention_head_size
    C = self_attn.query.in_features
    dropout = getattr(getattr(self_attn, "dropout", None), "p", 0.0)
    attn = Attention(C, H, head_dim=D, bias=True, dropout=dropout,
                     causal=bool(getattr(self_attn, "is_causal", False)), backend=backend)
    attn = _like(attn, self_attn, self_attn.query.weight)
    for dst, src in ((attn.q_proj, self_attn.query), (attn.k_proj, self_attn.key),
                     (attn.v_proj, self_attn.value), (attn.o_proj, dense)):
        _copy_linear(dst, src.weight, src.bias)
    _fold_scale(attn, getattr(self_attn, "scaling", D ** -0.5))
    return attn


def from_gpt2(attn_module: nn.Module, *, backend: str = "auto") -> Attention:
    """A `GPT2Attention` (self-attention) -> a causal `Attention`.

    GPT-2's Conv1D computes y = x @ W + b with W `(in, out)`; `c_attn` fuses q, k, v
    along `out`. nn.Linear holds `(out, in)`, hence the split and the transposes. The
    residual dropout after c_proj is not part of the module (the patched layer keeps it).
    """
    if _class_name(attn_module) not in GPT2_FAMILY:
        raise TypeError(f"from_gpt2 takes a GPT2Attention; received {_class_name(attn_module)}")
    if getattr(attn_module, "is_cross_attention", False):
        raise ValueError("from_gpt2 converts GPT-2 self-attention; this GPT2Attention is a cross-attention "
                         "layer (is_cross_attention=True)")
    C, H, D = attn_module.embed_dim, attn_module.num_heads, attn_module.head_dim
    w, b = attn_module.c_attn.weight, attn_module.c_attn.bias  # (C, 3C), (3C,)
    attn = Attention(C, H, head_dim=D, bias=True, dropout=attn_module.attn_dropout.p, causal=True,
                     backend=backend)
    attn = _like(attn, attn_module, w)
    wq, wk, wv = w.split(C, dim=1)  # each (C, C) as (in, out)
    bq, bk, bv = b.split(C, dim=0)
    for dst, ww, bb in ((attn.q_proj, wq, bq), (attn.k_proj, wk, bk), (attn.v_proj, wv, bv)):
        _copy_linear(dst, ww.t(), bb)
    _copy_linear(attn.o_proj, attn_module.c_proj.weight.t(), attn_module.c_proj.bias)
    _fold_scale(attn, getattr(attn_module, "scaling", D ** -0.5))
    return attn


def _rope_parameters(config) -> dict:
    """transformers' `rope_parameters` (5.x), or the older rope_theta / rope_scaling attributes."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_scaling_from_config(config) -> RopeScaling | None:
    """The RoPE scaling of a transformers config (None for plain RoPE)."""
    return RopeScaling.from_hf(_rope_parameters(config), getattr(config, "max_position_embeddings", None))


def rotary_from_config(config, dim: int, *, interleaved: bool = False) -> RotaryEmbedding:
    """A `RotaryEmbedding` over `dim` features with the config's base and RoPE scaling."""
    params = _rope_parameters(config)
    return RotaryEmbedding(dim, float(params.get("rope_theta", 10000.0)), interleaved=interleaved,
                           scaling=rope_scaling_from_config(config))


def from_llama(attn_module: nn.Module, *, backend: str = "auto") -> Attention:
    """A `LlamaAttention` / `MistralAttention` / `Qwen2Attention` -> a causal GQA `Attention`.

    RoPE: half-split layout (HF's `rotate_half`) over the whole head, with the model's
    rope_theta and RoPE scaling (linear, dynamic, llama3, yarn); Mistral's sliding
    window becomes the module's `sliding_window`.
    """
    name = _class_name(attn_module)
    if name not in LLAMA_FAMILY:
        raise TypeError(f"from_llama takes one of {', '.join(LLAMA_FAMILY)}; received {name}")
    config = attn_module.config
    D = attn_module.head_dim
    H = attn_module.q_proj.out_features // D
    Hkv = attn_module.k_proj.out_features // D
    C = attn_module.q_proj.in_features
    window = sliding_window_of(attn_module)
    attn = Attention(C, H, Hkv, head_dim=D, bias=True, dropout=float(getattr(attn_module, "attention_dropout", 0.0)),
                     causal=True, rope=rotary_from_config(config, D), backend=backend, sliding_window=window)
    attn = _like(attn, attn_module, attn_module.q_proj.weight)
    for dst, src in ((attn.q_proj, attn_module.q_proj), (attn.k_proj, attn_module.k_proj),
                     (attn.v_proj, attn_module.v_proj), (attn.o_proj, attn_module.o_proj)):
        _copy_linear(dst, src.weight, src.bias)
    _fold_scale(attn, getattr(attn_module, "scaling", D ** -0.5))
    return attn


def layer_inputs(model: nn.Module, layers: list[nn.Module], ids: Tensor) -> list[list[Tensor]]:
    """Each of `layers`' input hidden states `(B, T, C)`, one per call, when `model` reads
    token ids `ids` `(B, T)` in one forward without a cache (the calibrated conversions' data)."""
    seen: list[list[Tensor]] = [[] for _ in layers]
    handles = []
    for i, m in enumerate(layers):
        def grab(module, args, kwargs, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            seen[i].append(x.detach())
        handles.append(m.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def sliding_window_of(attn_module: nn.Module) -> int | None:
    """A transformers attention layer's causal window: its own attribute, else its config's
    (per layer type where the config lists them, as Qwen2's does); None for none."""
    config = getattr(attn_module, "config", None)
    window = getattr(attn_module, "sliding_window", None)
    if window is None:
        types = getattr(config, "layer_types", None)
        idx = getattr(attn_module, "layer_idx", None)
        if types is not None and idx is not None:
            window = config.sliding_window if types[idx] == "sliding_attention" else None
        else:
            window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def from_deepseek(hf_attn: nn.Module, *, backend: str = "auto") -> LatentAttention:
    """A causal `LatentAttention` with the weights of transformers' `DeepseekV2Attention`
    or `DeepseekV3Attention`.

    Reads the sizes from `hf_attn.config` (hidden_size, num_attention_heads,
    kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, the RoPE
    parameters, V3's rope_interleave) and copies q_proj or q_a_proj / q_a_layernorm /
    q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj and o_proj. YaRN RoPE
    scaling (the published DeepSeek-V2/V3 configs) sets the frequencies, the factor on
    cos/sin and mscale(factor, mscale_all_dim)^2 on the softmax scale, as transformers does.
    """
    needed = ("config", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    missing = [n for n in needed if not hasattr(hf_attn, n)]
    if missing:
        raise TypeError(f"from_deepseek takes a transformers DeepseekV2Attention / DeepseekV3Attention; received "
                        f"{type(hf_attn).__name__} without {', '.join(missing)}")
    cfg = hf_attn.config
    params = _rope_parameters(cfg)
    bias = bool(getattr(cfg, "attention_bias", False))
    attn = LatentAttention(
        cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank,
        q_rank=cfg.q_lora_rank, head_dim=cfg.qk_nope_head_dim, rope_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, causal=True, rope_base=float(params.get("rope_theta", 10000.0)),
        backend=backend, bias=bias, rope_scaling=rope_scaling_from_config(cfg),
        rope_interleaved=bool(getattr(cfg, "rope_interleave", True)),
    )
    w = hf_attn.kv_b_proj.weight
    attn = attn.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        for mine, theirs in _deepseek_pairs(attn, hf_attn):
            mine.weight.copy_(theirs.weight)
            if getattr(mine, "bias", None) is not None:
                if theirs.bias is None:
                    mine.bias.zero_()
                else:
                    mine.bias.copy_(theirs.bias)
            if isinstance(mine, nn.RMSNorm):
                mine.eps = float(getattr(theirs, "variance_epsilon", mine.eps))
    return attn


def _deepseek_pairs(attn: LatentAttention, hf_attn: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(multihead submodule, transformers submodule) pairs of one MLA layer."""
    pairs = [(attn.kv_a_proj, hf_attn.kv_a_proj_with_mqa), (attn.kv_a_norm, hf_attn.kv_a_layernorm),
             (attn.kv_b_proj, hf_attn.kv_b_proj), (attn.o_proj, hf_attn.o_proj)]
    if attn.q_rank is None:
        pairs.append((attn.q_proj, hf_attn.q_proj))
    else:
        pairs += [(attn.q_a_proj, hf_attn.q_a_proj), (attn.q_a_norm, hf_attn.q_a_layernorm),
                  (attn.q_b_proj, hf_attn.q_b_proj)]
    return pairs


def from_layer(module: nn.Module, *, backend: str = "auto") -> Attention:
    """Any supported HF attention layer -> `Attention` / `LatentAttention` (by its class)."""
    name = _class_name(module)
    if _class_name(getattr(module, "self", None)) in BERT_FAMILY:
        return from_bert(module, backend=backend)
    if name in GPT2_FAMILY:
        return from_gpt2(module, backend=backend)
    if name in LLAMA_FAMILY:
        return from_llama(module, backend=backend)
    if name in DEEPSEEK_FAMILY:
        return from_deepseek(module, backend=backend)
    raise TypeError(f"no multihead conversion for {name}; supported: BertAttention / RobertaAttention, "
                    + ", ".join(GPT2_FAMILY + LLAMA_FAMILY + DEEPSEEK_FAMILY))
