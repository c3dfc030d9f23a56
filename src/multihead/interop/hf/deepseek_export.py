"""A model converted by `to_mla` as a DeepSeek-V2 checkpoint that stock transformers loads.

`to_deepseek_v2(mla_model, calibration=ids)` builds a transformers `DeepseekV2ForCausalLM`
(dense MLPs in every layer: first_k_dense_replace = num_hidden_layers, no experts) with
the converted model's weights; `save_pretrained` then writes a folder that
`AutoModelForCausalLM.from_pretrained` loads with no multihead installed. Where the
architecture can represent the conversion:

Llama and Mistral without a sliding window; the kept rotary pairs as "longrope" factors
(layers that keep different pairs, as the calibrated conversion does, share one wider RoPE
key with `widen_rope=True`); the latent RMSNorm's gain fitted on calibration tokens (the
one approximation).
transformers is imported only inside `to_deepseek_v2` (it builds a model of its classes).

Details: docs/mla.md, "What the DeepSeek-V2 export can represent".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from multihead.interop.hf.layers import layer_inputs
from multihead.interop.hf.mla import LatentLlamaAttention

__all__ = ["latent_norm_fit", "rope_slots", "to_deepseek_v2"]

_STATIC_ROPE = ("default", "linear", "llama3")


def _layers(model: nn.Module) -> list[LatentLlamaAttention]:
    return [m for m in model.modules() if isinstance(m, LatentLlamaAttention)]


def _check(model: nn.Module) -> list[LatentLlamaAttention]:
    layers = _layers(model)
    name = type(model).__name__
    if not layers:
        raise TypeError(f"to_deepseek_v2 takes a model converted by multihead.convert.to_mla (a Llama-family "
                        f"transformers model); received {name}, which has no converted layer")
    for i, layer in enumerate(layers):
        m = layer.mla
        if layer.k_norm is not None:
            raise ValueError(f"to_deepseek_v2: layer {i} has a per-head key norm (Qwen3), which DeepSeek-V2's latent "
                             "path cannot hold; valid: a converted Llama or Mistral model")
        if m.q_proj.bias is not None:
            raise ValueError(f"to_deepseek_v2: layer {i} has a query bias (Qwen2), and DeepSeek-V2's q_proj has none; "
                             "valid: a converted Llama or Mistral model")
        if m.sliding_window is not None:
            raise ValueError(f"to_deepseek_v2: layer {i} attends within a sliding window of {m.sliding_window}, which "
                             "DeepSeek-V2 does not have; valid: a model without sliding_window")
        if not m.rope_dim:
            raise ValueError("to_deepseek_v2: rope_dim=0 leaves DeepSeek-V2 no rotary key (qk_rope_head_dim 0 has no "
                             "RoPE to run); valid: a model converted with rope_dim >= 2 * Hkv")
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    kind = getattr(rotary, "rope_type", "default")
    if rotary is None or kind not in _STATIC_ROPE or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise ValueError(f"to_deepseek_v2: the model's RoPE is {kind!r}; valid: {', '.join(_STATIC_ROPE)} (fixed "
                         "frequencies, no attention factor)")
    return layers


def latent_norm_fit(model: nn.Module, calibration: Tensor, *, ballast: bool = True) -> list[tuple[float, Tensor]]:
    """For each converted layer, what the export gives DeepSeek's kv_a_layernorm: (gain g,
    extra rows `(E, C)` of kv_a_proj after the latent's R), fitted on the layer's inputs over
    `calibration` ids `(B, T)`. The extra rows are the ballast row b (below), then a zero row
    where R + 1 (or R) is odd: DeepSeek views the RoPE key after the latent as complex
    pairs, which needs it to start at an even offset.

    The norm rescales each token's latent c_j by g / rms(c'_j). Without ballast c' = c; with
    it c' = [c ; b . x], one more latent feature that kv_b_proj ignores (a zero column): its
    direction is the layer input's most nearly constant one (b ~ Sigma^-1 mu, the largest
    mean-to-spread ratio) and its size the one that makes rms(c') vary least over the tokens,
    so the rescaling is closer to 1 (first tokens, whose latents are small, most of all).
    g minimises sum_j ||c_j||^2 (g / rms(c'_j) - 1)^2, the squared change of the latents.
    """
    layers = _layers(model)
    if not isinstance(calibration, Tensor) or calibration.dtype != torch.long or calibration.dim() != 2 \
            or calibration.numel() == 0:
        raise TypeError("calibration must be a non-empty LongTensor of token ids (B, T), for the latent norm's gain; "
                        "received " + (f"a {calibration.dtype} tensor of shape {tuple(calibration.shape)}"
                                       if isinstance(calibration, Tensor) else type(calibration).__name__))
    fits = []
    for layer, xs in zip(layers, layer_inputs(model, layers, calibration)):
        xs = [x.reshape(-1, x.shape[-1]) for x in xs]  # (B T, C) each
        m = layer.mla
        x = torch.cat(xs).double()  # (N, C)
        with torch.no_grad():
            c = m.kv_a_proj(torch.cat(xs))[..., : m.kv_rank].double()  # (N, R)
        sq = c.square().sum(-1)  # (N,) ||c_j||^2
        R = m.kv_rank
        width = R + ballast + (R + ballast) % 2  # kv_lora_rank
        rows = x.new_zeros(width - R, x.shape[1])
        extra = torch.zeros_like(sq)
        if ballast:
            mu = x.mean(0)
            cov = torch.cov(x.T) + 1e-6 * torch.eye(x.shape[1], dtype=torch.float64)
            b = torch.linalg.solve(cov, mu)
            z = x @ b
            b = b / z.mean()  # b . x has mean 1
            z = x @ b

            def spread(alpha: float, sq=sq, z=z, n=width) -> float:
                rho = ((sq + (alpha * z).square()) / n).sqrt()
                return float(rho.std() / rho.mean())

            scale = float(sq.mean().sqrt())
            alpha = min((scale * 10 ** (e / 4) for e in range(-8, 17)), key=spread)
            rows[0] = alpha * b
            extra = (alpha * z).square()
        rho = ((sq + extra) / width).sqrt()
        gain = float((sq / rho).sum() / (sq / rho.square()).sum())
        fits.append((gain, rows.to(m.kv_b_proj.weight.dtype)))
    return fits


def rope_slots(model: nn.Module) -> tuple[Tensor, list[Tensor]]:
    """The one RoPE key that holds every converted layer's rotary pairs: (freqs `(U,)`, the
    frequency index of each of its U pairs, ascending; per layer, `(r/2,)` the pair of it
    that each of the layer's own pairs goes to).

    DeepSeek-V2 rotates pair s of its RoPE key at the same frequency in every layer, and a
    pair's frequency is its own (permuting pairs moves them, it does not retune them), so a
    layer's pairs fit only pairs of their frequency. U holds each frequency as often as the
    layer that keeps it most often: U = r/2 when every layer keeps the same frequencies (in
    any order), more when they differ; the pairs a layer does not keep get zero weights."""
    layers = _layers(model)
    need: dict[int, int] = {}
    for layer in layers:
        for f, n in zip(*layer.slot_freq.cpu().unique(return_counts=True)):
            need[int(f)] = max(need.get(int(f), 0), int(n))
    freqs = torch.tensor([f for f in sorted(need) for _ in range(need[f])], dtype=torch.long)
    first = {f: int((freqs == f).nonzero()[0]) for f in need}  # where each frequency's run of pairs starts
    places = []
    for layer in layers:
        used: dict[int, int] = {}
        place = []
        for f in layer.slot_freq.cpu().tolist():
            place.append(first[f] + used.get(f, 0))
            used[f] = used.get(f, 0) + 1
        places.append(torch.tensor(place, dtype=torch.long))
    return freqs, places


def _widen(rows: Tensor, place: Tensor, u: int) -> Tensor:
    """Rows `(..., r, C)` of a layer's RoPE key, half-split (pair j at j and r/2 + j), ->
    `(..., 2u, C)` half-split rows of the shared key: pair j at place[j], zeros elsewhere."""
    half = rows.shape[-2] // 2
    out = rows.new_zeros(*rows.shape[:-2], 2 * u, rows.shape[-1])
    out[..., place, :] = rows[..., :half, :]
    out[..., place + u, :] = rows[..., half:, :]
    return out


def _interleave(rows: Tensor, r: int) -> Tensor:
    """The last r rows of each block, half-split (s, s + r/2) -> interleaved (2s, 2s+1)."""
    half = r // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)  # (r,)
    return rows[..., order, :]


def _config(transformers, model: nn.Module, layers: list[LatentLlamaAttention], slots: Tensor, *,
            kv_lora_rank: int, nope: int, wide: int):
    """The DeepseekV2Config of the export: `model`'s sizes, dense MLPs in every layer, and
    the shared RoPE key's pair frequencies `inv_freq[slots]` as longrope factors."""
    src = model.config
    m0 = layers[0].mla
    inv_freq = model.model.rotary_emb.inv_freq.detach().double().cpu()  # (D/2,) the original frequencies
    freqs = inv_freq[slots]  # (u,)
    base = 10000.0
    # longrope: inv_freq = 1 / (factor_s * base ** (2s / wide)), so factor_s = 1 / (freq_s * base ** (2s / wide))
    factors = (1.0 / (freqs * base ** (torch.arange(0, wide, 2, dtype=torch.float64) / wide))).tolist()
    bias = any(m.mla.kv_a_proj.bias is not None or m.mla.o_proj.bias is not None for m in layers)
    return transformers.DeepseekV2Config(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers, num_attention_heads=m0.n_heads, num_key_value_heads=m0.n_heads,
        hidden_act=src.hidden_act, max_position_embeddings=src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps, tie_word_embeddings=bool(getattr(src, "tie_word_embeddings", False)),
        attention_bias=bias, attention_dropout=0.0, mlp_bias=bool(getattr(src, "mlp_bias", False)),
        kv_lora_rank=kv_lora_rank, q_lora_rank=None, qk_nope_head_dim=nope, qk_rope_head_dim=wide,
        v_head_dim=m0.v_head_dim,
        first_k_dense_replace=src.num_hidden_layers, n_routed_experts=1, n_shared_experts=1,
        num_experts_per_tok=1, moe_intermediate_size=1, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "longrope", "rope_theta": base, "short_factor": factors,
                         "long_factor": factors, "factor": 1.0, "attention_factor": 1.0,
                         "original_max_position_embeddings": src.max_position_embeddings},
        bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id, pad_token_id=src.pad_token_id,
    )


def _copy_attention(m, dst: nn.Module, gain: float, more: Tensor, place: Tensor, *, u: int, pad: int,
                    ratio: float) -> None:
    """One converted layer's attention `m` (its MLA) into DeepSeek's `dst`: the RoPE rows
    moved to their pairs `place` of the shared key (u pairs) and interleaved, `pad` zero
    nope dims, the latent's extra rows `more` and zero columns for them, the norm's gain,
    and the queries scaled by `ratio` to undo DeepSeek's wider softmax scale."""
    H, R, Dn, r, Dv = m.n_heads, m.kv_rank, m.head_dim, m.rope_dim, m.v_head_dim
    wide, extra = 2 * u, len(more)

    def pe(rows: Tensor) -> Tensor:  # the layer's RoPE rows in the shared key's pairs
        return _interleave(_widen(rows, place, u), wide)

    q = m.q_proj.weight.view(H, Dn + r, -1) * ratio
    zeros = q.new_zeros(H, pad, q.shape[-1])
    q = torch.cat([q[:, :Dn], zeros, pe(q[:, Dn:])], dim=1)  # (H, Dn + pad + wide, C)
    dst.q_proj.weight.copy_(q.reshape(H * (Dn + pad + wide), -1))
    a = m.kv_a_proj.weight
    dst.kv_a_proj_with_mqa.weight.copy_(torch.cat([a[:R], more, pe(a[R:])]))  # (R + E + wide, C)
    if dst.kv_a_proj_with_mqa.bias is not None:
        b = m.kv_a_proj.bias
        dst.kv_a_proj_with_mqa.bias.copy_(torch.zeros_like(dst.kv_a_proj_with_mqa.bias) if b is None else
                                          torch.cat([b[:R], b.new_zeros(extra), pe(b[R:, None])[:, 0]]))
    dst.kv_a_layernorm.weight.fill_(gain)
    kv = m.kv_b_proj.weight.view(H, Dn + Dv, R)
    kv = torch.cat([kv[:, :Dn], kv.new_zeros(H, pad, R), kv[:, Dn:]], dim=1)  # (H, Dn + pad + Dv, R)
    kv = torch.cat([kv, kv.new_zeros(H, Dn + pad + Dv, extra)], dim=2)  # the extra features: zero columns
    dst.kv_b_proj.weight.copy_(kv.reshape(-1, R + extra))
    dst.o_proj.weight.copy_(m.o_proj.weight)
    if dst.o_proj.bias is not None:
        dst.o_proj.bias.copy_(torch.zeros_like(dst.o_proj.bias) if m.o_proj.bias is None else m.o_proj.bias)


def to_deepseek_v2(model: nn.Module, *, calibration: Tensor, ballast: bool = True, widen_rope: bool = False):
    """A transformers `DeepseekV2ForCausalLM` with the weights of `model` (module docstring).

    Args:
        model: a Llama/Mistral model converted by `multihead.convert.to_mla`.
        calibration: token ids `(B, T)` for the latent norm's fit (`latent_norm_fit`).
        ballast: add the one latent feature that steadies the norm (`latent_norm_fit`): the
            cache then holds R + 1 + r values per token and layer (one more zero where
            that would start the RoPE key at an odd offset).
        widen_rope: where the layers keep different rotary frequencies (the calibrated
            conversion chooses them per layer), give the exported model one RoPE key wide
            enough for every layer's (`rope_slots`): the same logits, a larger cache
            (2U rotary values per token and layer instead of rope_dim). Without it such a
            model is refused, and the error says how much larger.

    Returns:
        the DeepSeek-V2 model, in `model`'s dtype and in eval mode; `save_pretrained` it.
    """
    import transformers

    if not isinstance(widen_rope, bool):
        raise TypeError(f"widen_rope must be a bool; received {type(widen_rope).__name__}")
    layers = _check(model)
    fits = latent_norm_fit(model, calibration, ballast=ballast)
    extra = len(fits[0][1])  # the ballast feature and an even-offset zero
    m0 = layers[0].mla
    R, Dn, r = m0.kv_rank, m0.head_dim, m0.rope_dim
    # DeepSeek views q_pe / k_pe as complex pairs, which needs q_pe to start at an even offset:
    # an odd nope width (1, the zero feature of a fully rotary conversion) gets one more zero
    pad = Dn % 2
    slots, places = rope_slots(model)
    u = len(slots)
    if u > r // 2 and not widen_rope:
        raise ValueError(
            f"to_deepseek_v2: the layers keep different rotary frequencies ({u} distinct pairs over the "
            f"{len(layers)} layers, {r // 2} in each), and DeepSeek-V2 rotates each pair of its RoPE key at one "
            "frequency in every layer (a permutation of a layer's pairs cannot change their frequencies); valid: "
            f"widen_rope=True, which exports the same model with a RoPE key of {2 * u} dims instead of {r} "
            f"({2 * u - r} more cached values per token and layer), or a model converted with keep='high'")
    wide = 2 * u  # qk_rope_head_dim: r, or wider to hold every layer's frequencies
    ratio = math.sqrt((Dn + pad + wide) / (Dn + r))  # DeepSeek's scale is 1/sqrt(Dn + pad + wide): undone on q
    config = _config(transformers, model, layers, slots, kv_lora_rank=R + extra, nope=Dn + pad, wide=wide)
    w = m0.kv_b_proj.weight
    out = transformers.DeepseekV2ForCausalLM(config).to(dtype=w.dtype, device=w.device).eval()
    state = {k: v for k, v in model.state_dict().items() if ".self_attn." not in k}
    missing, _ = out.load_state_dict(state, strict=False)
    with torch.no_grad():
        for i, (layer, (gain, more), place) in enumerate(zip(layers, fits, places)):
            _copy_attention(layer.mla, out.model.layers[i].self_attn, gain, more, place, u=u, pad=pad, ratio=ratio)
    left = [k for k in missing if ".self_attn." not in k and not (config.tie_word_embeddings and k == "lm_head.weight")]
    assert not left, left  # every non-attention weight has its twin in the Llama model
    return out
