"""Hugging Face attention layers as `multihead.Attention`, and models run on multihead.

Two levels:

- `from_bert`, `from_gpt2`, `from_llama` (and `convert`, which picks one) build a
  standalone `multihead.Attention` with exactly the weights of one HF attention layer:

  * BERT family (BertAttention / RobertaAttention): query/key/value Linear layers plus
    the `output.dense` Linear of BertSelfOutput as o_proj. The dropout, residual and
    LayerNorm after that dense stay HF's.
  * GPT-2 (GPT2Attention): the fused, transposed Conv1D `c_attn` (y = x @ W + b,
    W `(C, 3C)`) is split into q/k/v and transposed; `c_proj` becomes o_proj; causal.
  * Llama family (Llama, Mistral, Qwen2): GQA with the model's key/value heads, RoPE in
    the half-split layout with the model's rope_theta, and biases exactly where the
    model has them (Qwen2: q/k/v biases, no o bias; o_proj.bias is then None, so
    parameter counts stay honest).

  A layer whose score scale is not 1/sqrt(D) (GPT-2's scale_attn_by_inverse_layer_idx or
  scale_attn_weights=False) gets the ratio folded into q_proj, so the module computes the
  same scores with its default scale.

- `patch(model)` swaps every supported self-attention module of a loaded model for a
  multihead-backed one, in place; the model then runs its attention on multihead and
  computes the same outputs. Each replacement implements the forward signature of the
  HF module it replaces (transformers 5.x; `past_key_values` and `cache` both accepted),
  works with HF's KV caches, and is a subclass of the replaced class, so transformers'
  `output_attentions=True` still collects weights from it. Per-head weights on demand:
  set `layer.weight_heads = [heads]` (see `patched_layers`) and the next forward keeps
  `layer.last_weights` `(B, len(heads), T, S)`, computed by multihead's weights pass for
  those heads only, while the output comes from the fused kernel.

transformers is never imported here; the functions read the modules they are given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from multihead.attention import Attention
from multihead.functional import scaled_dot_product_attention
from multihead.interop.hf.registry import hf_mask
from multihead.rope import RotaryEmbedding, apply_rotary

__all__ = ["convert", "from_bert", "from_gpt2", "from_llama", "patch", "patched_layers", "hf_mask"]

BERT_FAMILY = ("BertSelfAttention", "RobertaSelfAttention")
GPT2_FAMILY = ("GPT2Attention",)
LLAMA_FAMILY = ("LlamaAttention", "MistralAttention", "Qwen2Attention")
SUPPORTED = BERT_FAMILY + GPT2_FAMILY + LLAMA_FAMILY


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


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = getattr(config, "rope_theta", 10000.0)
    return float(theta)


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    scaling = getattr(config, "rope_scaling", None)
    if kind is None and isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
    return kind or "default"


def from_llama(attn_module: nn.Module, *, backend: str = "auto", strict_rope: bool = True) -> Attention:
    """A `LlamaAttention` / `MistralAttention` / `Qwen2Attention` -> a causal GQA `Attention`.

    RoPE: half-split layout (HF's `rotate_half`) over the whole head, base = the model's
    rope_theta. Only rope_type "default" is plain RoPE; for scaled variants (llama3,
    yarn, linear, dynamic, ...) this raises unless `strict_rope=False`, which keeps the
    plain RoPE of rope_theta (the patched model uses the model's own cos/sin instead).
    Mistral's sliding window is a mask, not a weight: pass
    `multihead.masks.sliding_window(config.sliding_window)` as `mask`.
    """
    name = _class_name(attn_module)
    if name not in LLAMA_FAMILY:
        raise TypeError(f"from_llama takes one of {', '.join(LLAMA_FAMILY)}; received {name}")
    config = attn_module.config
    rope_type = _rope_type(config)
    if strict_rope and rope_type != "default":
        raise ValueError(f"{name} uses rope_type {rope_type!r}; multihead.RotaryEmbedding is plain RoPE "
                         "(rope_type 'default'). Pass strict_rope=False to keep plain RoPE of rope_theta, "
                         "or use patch(model), which rotates with the model's own cos/sin")
    D = attn_module.head_dim
    H = attn_module.q_proj.out_features // D
    Hkv = attn_module.k_proj.out_features // D
    C = attn_module.q_proj.in_features
    rope = RotaryEmbedding(D, base=_rope_theta(config))
    attn = Attention(C, H, Hkv, head_dim=D, bias=True, dropout=float(getattr(attn_module, "attention_dropout", 0.0)),
                     causal=True, rope=rope, backend=backend)
    attn = _like(attn, attn_module, attn_module.q_proj.weight)
    for dst, src in ((attn.q_proj, attn_module.q_proj), (attn.k_proj, attn_module.k_proj),
                     (attn.v_proj, attn_module.v_proj), (attn.o_proj, attn_module.o_proj)):
        _copy_linear(dst, src.weight, src.bias)
    _fold_scale(attn, getattr(attn_module, "scaling", D ** -0.5))
    return attn


def convert(module: nn.Module, *, backend: str = "auto") -> Attention:
    """Any supported HF attention layer -> `Attention` (dispatches on the class)."""
    name = _class_name(module)
    if _class_name(getattr(module, "self", None)) in BERT_FAMILY:
        return from_bert(module, backend=backend)
    if name in GPT2_FAMILY:
        return from_gpt2(module, backend=backend)
    if name in LLAMA_FAMILY:
        return from_llama(module, backend=backend)
    raise TypeError(f"no multihead conversion for {name}; supported: BertAttention / RobertaAttention, "
                    + ", ".join(GPT2_FAMILY + LLAMA_FAMILY))


# ---------------------------------------------------------------- the wrappers


class MultiheadLayer(nn.Module):
    """The part shared by the patched layers; see `patch`.

    Attributes:
        attn: the `multihead.Attention` that holds the weights and runs the kernel.
        layer_idx: the layer's index in the model.
        weight_heads: None, True (all heads) or a tuple of head indices whose weights the
            next forwards keep in `last_weights` `(B, len(heads), T, S)`.
    """

    attn: Attention

    def _setup(self, original: nn.Module, attn: Attention) -> None:
        nn.Module.__init__(self)
        self.attn = attn
        self.layer_idx = getattr(original, "layer_idx", None)
        self.config = getattr(original, "config", None)
        self.is_causal = attn.causal
        self.weight_heads = None
        self.last_weights = None
        # Hooks already on the replaced module (transformers' output capture installs them
        # once per model) keep working on the replacement.
        for name in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            src = getattr(original, name, None)
            if src:
                getattr(self, name).update(src)
        self.train(original.training)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"

    def _run(self, x: Tensor, attention_mask, *, cache=None, rotary=None, output_attentions=False,
             cache_kwargs=None) -> tuple[Tensor, Tensor | None]:
        """Attention over x `(B, T, C)`; returns (out `(B, T, C)`, HF's weights or None)."""
        attn = self.attn
        keep = self.weight_heads
        if keep is not None and keep is not True:
            keep = tuple(int(h) for h in keep)
        output_attentions = bool(output_attentions) or _hf_collects_attentions()
        want = True if output_attentions else keep
        return_weights = False if want is None else (True if want is True else list(want))
        mask = hf_mask(attention_mask, x.dtype)
        if cache is None and rotary is None:
            result = attn(x, mask=mask, return_weights=return_weights)
        else:
            result = self._run_explicit(x, mask, cache, rotary, return_weights, cache_kwargs or {})
        out, weights = result if isinstance(result, tuple) else (result, None)
        if keep is not None:
            kept = weights if keep is True or not output_attentions else weights[:, list(keep)]
            self.last_weights = kept.detach()
        return out, (weights if output_attentions else None)

    def _run_explicit(self, x, mask, cache, rotary, return_weights, cache_kwargs):
        """The module's steps written out, for HF's caches and HF's rotary positions."""
        attn = self.attn
        B, T, _ = x.shape
        D = attn.head_dim
        q = attn.q_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        k = attn.k_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = attn.v_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, Hkv, T, D)
        if rotary is not None:
            cos, sin = rotary  # (B|1, 1, T, D/2)
            q = apply_rotary(q, cos, sin, interleaved=attn.rope.interleaved)
            k = apply_rotary(k, cos, sin, interleaved=attn.rope.interleaved)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=cache_kwargs)  # (B, Hkv, S, D)
        result = scaled_dot_product_attention(
            q, k, v, mask, causal=attn.causal, dropout_p=attn.dropout if self.training else 0.0,
            return_weights=return_weights, backend=attn.backend,
        )
        out, weights = result if isinstance(result, tuple) else (result, None)
        out = attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)
        return out if weights is None else (out, weights)


_COLLECTOR = []


def _hf_collects_attentions() -> bool:
    """Whether transformers is recording `attentions` for the running forward.

    transformers 5 records `output_attentions` with forward hooks on the attention
    classes and does not always pass the flag down; its active collector says.
    """
    if not _COLLECTOR:
        try:
            from transformers.utils.output_capturing import _active_collector
        except ImportError:  # another transformers version: rely on the kwargs
            _active_collector = None
        _COLLECTOR.append(_active_collector)
    collector = _COLLECTOR[0]
    if collector is None:
        return False
    collected = collector.get()
    return isinstance(collected, dict) and "attentions" in collected


def _self_cache(cache):
    """An EncoderDecoderCache's self-attention part; any other cache as is."""
    return getattr(cache, "self_attention_cache", cache)


class _BertLayer(MultiheadLayer):
    """Replaces BertSelfAttention; o_proj is the block's output.dense (now an Identity)."""

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, cache=None,
                past_key_values=None, encoder_hidden_states: Tensor | None = None, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("this multihead-patched layer is self-attention; it received encoder_hidden_states")
        cache = _self_cache(cache if cache is not None else past_key_values)
        return self._run(hidden_states, attention_mask, cache=cache,
                         output_attentions=bool(kwargs.get("output_attentions")), cache_kwargs=kwargs)


class _GPT2Layer(MultiheadLayer):
    """Replaces GPT2Attention (self-attention); keeps GPT-2's residual dropout."""

    def forward(self, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None,
                encoder_hidden_states: Tensor | None = None, encoder_attention_mask: Tensor | None = None,
                output_attentions: bool | None = False, past_key_values=None, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("this multihead-patched layer is self-attention; it received encoder_hidden_states")
        cache = _self_cache(cache if cache is not None else past_key_values)
        out, weights = self._run(hidden_states, attention_mask, cache=cache,
                                 output_attentions=bool(output_attentions or kwargs.get("output_attentions")),
                                 cache_kwargs=kwargs)
        return self.resid_dropout(out), weights


class _LlamaLayer(MultiheadLayer):
    """Replaces Llama/Mistral/Qwen2 attention; rotates with the model's cos/sin."""

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | None = None,
                attention_mask: Tensor | None = None, cache=None, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if position_embeddings is not None:
            # HF's cos/sin are (B, T, D) with both halves equal (cat(freqs, freqs)); the
            # model's rope scaling (llama3, yarn, ...) is already in them.
            cos, sin = position_embeddings
            half = cos.shape[-1] // 2
            rotary = (cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1))  # (B, 1, T, D/2)
        else:
            T = hidden_states.shape[1]
            offset = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            positions = torch.arange(T, device=hidden_states.device) + offset
            cos, sin = self.attn.rope.cos_sin(positions)  # (T, D/2)
            rotary = (cos, sin)
        return self._run(hidden_states, attention_mask, cache=cache, rotary=rotary,
                         output_attentions=bool(kwargs.get("output_attentions")), cache_kwargs=kwargs)


_WRAPPER_CLASSES: dict[tuple[type, type], type] = {}


def _wrapper_for(base: type, original: nn.Module) -> MultiheadLayer:
    """An instance of a class deriving from both `base` and the replaced HF class."""
    cls = type(original)
    key = (base, cls)
    if key not in _WRAPPER_CLASSES:
        _WRAPPER_CLASSES[key] = type(f"Multihead{cls.__name__}", (base, cls),
                                     {"__doc__": base.__doc__, "__module__": __name__})
    return _WRAPPER_CLASSES[key].__new__(_WRAPPER_CLASSES[key])


def _replace_child(model: nn.Module, qualified_name: str, new: nn.Module) -> None:
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def patch(model: nn.Module, *, backend: str = "auto") -> nn.Module:
    """Swap, in place, every supported self-attention layer of `model` for multihead's.

    Supported: BertSelfAttention / RobertaSelfAttention (with their block's output.dense,
    which becomes an Identity because its weights move into the layer's o_proj),
    GPT2Attention (self-attention; cross-attention layers are left as they are),
    LlamaAttention, MistralAttention, Qwen2Attention. Patching twice is a no-op. Returns
    `model`. Parameter names change (`...attention.self.attn.q_proj.weight`); the
    parameter count does not.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch takes a torch nn.Module (a loaded transformers model); received {type(model).__name__}")
    found = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, MultiheadLayer):
            found += 1
            continue
        kind = _class_name(module)
        if kind in BERT_FAMILY:
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
            dense = getattr(getattr(parent, "output", None), "dense", None)
            if parent is None or getattr(parent, "self", None) is not module or not isinstance(dense, nn.Linear):
                raise ValueError(f"{name} ({kind}) is not inside a BertAttention-like block with .output.dense; "
                                 "cannot move its output projection")
            attn = _from_bert_parts(module, dense, backend=backend)
            new = _wrapper_for(_BertLayer, module)
            new._setup(module, attn)
            parent.output.dense = nn.Identity()
        elif kind in GPT2_FAMILY:
            if getattr(module, "is_cross_attention", False):
                continue
            attn = from_gpt2(module, backend=backend)
            new = _wrapper_for(_GPT2Layer, module)
            new._setup(module, attn)
            new.resid_dropout = module.resid_dropout
        elif kind in LLAMA_FAMILY:
            attn = from_llama(module, backend=backend, strict_rope=False)
            new = _wrapper_for(_LlamaLayer, module)
            new._setup(module, attn)
        else:
            continue
        _replace_child(model, name, new)
        found += 1
    if not found:
        raise ValueError(f"no supported attention layer in {type(model).__name__}; supported: "
                         + ", ".join(SUPPORTED))
    return model


def patched_layers(model: nn.Module) -> list[MultiheadLayer]:
    """The multihead-patched self-attention layers of `model`, in layer order."""
    layers = [m for m in model.modules() if isinstance(m, MultiheadLayer)]
    if all(m.layer_idx is not None for m in layers):
        layers.sort(key=lambda m: m.layer_idx)
    return layers


def set_weight_heads(model: nn.Module, heads_by_layer: dict[int, Sequence[int] | bool] | None) -> None:
    """Ask the patched layers for weights: {layer index: heads or True}; None clears."""
    for i, layer in enumerate(patched_layers(model)):
        layer.last_weights = None
        layer.weight_heads = None if heads_by_layer is None else heads_by_layer.get(i)
