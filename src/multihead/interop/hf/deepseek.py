"""`use_latent_attention(model)`: DeepSeek-V2/V3 attention as multihead's `LatentAttention`, in place.

The attention registry (`registry`) runs every other model on multihead without
touching it. MLA is the one case it cannot serve: transformers' DeepSeek attention
decompresses the K and V of every cached token at every decode step (kv_b_proj over
the whole cache) before calling the registry, so an attention function only ever sees
the decompressed heads. `use_latent_attention` swaps each `DeepseekV2Attention` / `DeepseekV3Attention`
for a layer that keeps only the latent in transformers' cache, c_kv and the rotated
shared RoPE key, R + rope_dim values per token and layer, and decodes on
`LatentAttention`'s absorbed path (W_UK folded into the query, W_UV applied after):
each step reads the latent once and decompresses nothing.

Details: docs/mla.md, "How `use_latent_attention` swaps a layer, safely".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.interop.hf.layers import DEEPSEEK_FAMILY, from_deepseek
from multihead.interop.hf.registry import AttentionCall, WeightsAnswer, hf_mask
from multihead.latent import LatentAttention

__all__ = ["LatentAttentionLayer", "latent_attention_layers", "latent_cache_bytes", "restore_attention",
           "use_latent_attention", "uses_latent_attention"]

# (LatentAttention attribute, transformers attribute): the shared submodules.
_SHARED = (("q_proj", "q_proj"), ("q_a_proj", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b_proj", "q_b_proj"),
           ("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"),
           ("o_proj", "o_proj"))


def _rotary(position_embeddings) -> tuple[Tensor, Tensor] | None:
    """transformers' angles -> (cos, sin) `(B|1, 1, T, rope_dim/2)`.

    DeepSeek-V2 hands complex cos + i sin `(B, T, rope_dim/2)`; V3 hands (cos, sin), each
    `(B, T, rope_dim)` with both halves equal (cat(freqs, freqs)). Both already carry the
    model's RoPE scaling (YaRN's factor on cos and sin included).
    """
    if position_embeddings is None:
        return None
    if isinstance(position_embeddings, Tensor) and position_embeddings.is_complex():
        return position_embeddings.real[:, None], position_embeddings.imag[:, None]
    cos, sin = position_embeddings
    half = cos.shape[-1] // 2
    return cos[..., :half][:, None], sin[..., :half][:, None]


class LatentAttentionLayer(nn.Module):
    """What `use_latent_attention` puts in place of a DeepSeek attention layer (see the module docstring).

    Attributes:
        mla: the `LatentAttention` that computes the layer (sharing this layer's submodules;
            not registered, so its parameters appear once, under transformers' names).
        original: the replaced module, which `restore_attention` puts back.
        layer_idx: the layer's index in transformers' cache.
    """

    mla: LatentAttention
    original: nn.Module

    def _setup(self, original: nn.Module, mla: LatentAttention) -> None:
        nn.Module.__init__(self)
        for mine, theirs in _SHARED:
            module = getattr(original, theirs, None)
            if module is not None:
                setattr(self, theirs, module)  # registered under transformers' name
                setattr(mla, mine, module)  # and computing inside the LatentAttention
        self.rotary = mla.rope  # its buffers follow .to(device); none is saved
        object.__setattr__(self, "mla", mla)
        object.__setattr__(self, "original", original)
        self.layer_idx = getattr(original, "layer_idx", None)
        self.config = getattr(original, "config", None)
        self.is_causal = True
        # Hooks already on the replaced module (transformers' output capture installs them
        # once per model) keep working on the replacement.
        for name in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            src = getattr(original, name, None)
            if src:
                getattr(self, name).update(src)
        self.train(original.training)

    def __reduce_ex__(self, protocol):
        # The class is made when the layer is swapped in (it derives from the replaced transformers class),
        # so pickle cannot find it by name: it is made again from that class on load.
        return _new_replacement, (type(self).__bases__[1],), self.__getstate__()

    def extra_repr(self) -> str:
        m = self.mla
        return (f"layer_idx={self.layer_idx}, kv_rank={m.kv_rank}, rope_dim={m.rope_dim}: caches "
                f"{m.kv_rank + m.rope_dim} values per token, decodes on the absorbed path")

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, cache=None,
                position_embeddings=None, past_key_values=None, **kwargs) -> tuple[Tensor, Tensor | None]:
        """transformers' DeepSeek attention signature: x `(B, T, C)` -> (out `(B, T, C)`,
        weights `(B, H, T, S)` when output_attentions is asked, else None), computed by
        `LatentAttention.forward` with transformers' angles, mask and cache."""
        mla = self.mla
        if self.training and float(getattr(self.config, "attention_dropout", 0.0) or 0.0) > 0:
            raise ValueError("the LatentAttention DeepSeek layer has no attention dropout; set "
                             "config.attention_dropout=0 to train it, or restore_attention(model)")
        cache = cache if cache is not None else past_key_values
        x = hidden_states
        T = x.shape[1]
        rotary = _rotary(position_embeddings) if mla.rope is not None else None
        if rotary is None and mla.rope is not None:  # no angles given: positions after what the cache holds
            offset = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            rotary = mla.rope.cos_sin(torch.arange(T, device=x.device) + offset)  # (T, rope_dim/2) each
        mask = hf_mask(attention_mask, x.dtype)
        S = [T]  # the keys attended, for the request's record

        def store(latent: Tensor) -> Tensor:
            """This call's latents `(B, T, R + rope_dim)` -> every cached one `(B, S, R + rope_dim)`."""
            if cache is not None:
                # One tensor per layer in transformers' cache: the latent as the "keys" of one
                # head, and zero-width "values", so the attention reads it without a concatenation.
                keys, _ = cache.update(latent[:, None], latent[:, None, :, :0], self.layer_idx, kwargs=kwargs)
                latent = keys[:, 0]  # (B, S, R + rope_dim)
            if mask is None and 1 < T < latent.shape[1]:  # a static cache's prefill: the slots after T are empty
                latent = latent[:, :T]
            S[0] = latent.shape[1]
            return latent

        answer = WeightsAnswer.of(self, kwargs, kwargs.get("output_attentions", False))
        # forward, not __call__: hooks see this layer (multihead.heads numbers it and takes its
        # weights through the request), as they did before the LatentAttention computed it
        got = mla.forward(x, mask=mask, return_weights=answer.return_weights, rotary=rotary, store=store)
        out, weights = got if isinstance(got, tuple) else (got, None)
        answer.record(AttentionCall(self, mla.n_heads, 1, T, S[0], mla.head_dim + mla.rope_dim), weights)
        return out, answer.returned(weights)


_CLASSES: dict[type, type] = {}


def _replacement_for(original: nn.Module) -> LatentAttentionLayer:
    """An instance of a class deriving from both LatentAttentionLayer and the replaced class."""
    return _new_replacement(type(original))


def _new_replacement(cls: type) -> LatentAttentionLayer:
    """An empty instance of the replacement class of `cls` (also what unpickling calls)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Multihead{cls.__name__}", (LatentAttentionLayer, cls),
                             {"__doc__": LatentAttentionLayer.__doc__, "__module__": __name__,
                              "forward": LatentAttentionLayer.forward})
    return _CLASSES[cls].__new__(_CLASSES[cls])


def _set_child(model: nn.Module, qualified_name: str, new: nn.Module) -> None:
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def use_latent_attention(model: nn.Module, *, backend: str = "auto") -> nn.Module:
    """Swap, in place, every DeepSeek-V2/V3 attention layer of `model` for multihead's MLA.

    `generate()` then keeps only the latent per token in its cache and decodes on the
    absorbed path, with the same tokens. Parameters are shared with the replaced layers
    (same names, same tensors); a second call is a no-op. Returns `model`.

    Other models need no swap: `model.set_attn_implementation("multihead")` (or
    `attn_implementation="multihead"` when loading) runs them on multihead as they are.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"use_latent_attention takes a torch nn.Module (a loaded transformers model); received "
                        f"{type(model).__name__}")
    found = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, LatentAttentionLayer):
            found += 1
            continue
        if type(module).__name__ not in DEEPSEEK_FAMILY:
            continue
        mla = from_deepseek(module, backend=backend)
        new = _replacement_for(module)
        new._setup(module, mla)
        _set_child(model, name, new)
        found += 1
    if not found:
        raise ValueError(f"use_latent_attention() swaps DeepSeek-V2/V3 attention ({', '.join(DEEPSEEK_FAMILY)}) for "
                         f"multihead's LatentAttention; {type(model).__name__} has none. To run any other model on "
                         "multihead, use model.set_attn_implementation('multihead') or from_pretrained(..., "
                         "attn_implementation='multihead') after importing multihead.interop.hf")
    return model


def latent_attention_layers(model: nn.Module) -> list[LatentAttentionLayer]:
    """The layers of `model` that `use_latent_attention` swapped in, in module order."""
    return [m for m in model.modules() if isinstance(m, LatentAttentionLayer)]


def uses_latent_attention(model: nn.Module) -> bool:
    """Whether `model` has layers swapped in by `use_latent_attention`."""
    return bool(latent_attention_layers(model))


def restore_attention(model: nn.Module) -> nn.Module:
    """Put back the original transformers modules that `use_latent_attention` replaced (a
    no-op on a model without them). Their weights are the ones the LatentAttention layers
    used and trained."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"restore_attention takes a torch nn.Module; received {type(model).__name__}")
    for name, module in list(model.named_modules()):
        if isinstance(module, LatentAttentionLayer):
            original = module.original
            original.train(module.training)
            _set_child(model, name, original)
    return model


def latent_cache_bytes(cache) -> int:
    """Bytes held by a transformers cache object (keys and values of every layer)."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
