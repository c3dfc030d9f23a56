"""Hugging Face transformers models on multihead.

Importing this package registers "multihead" as a transformers attention
implementation (see `registry`), so

    import multihead.interop.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="multihead")

runs every model whose attention goes through transformers' attention registry on
multihead's kernel, with nothing else of the model changed.

Three jobs, one module each:

- `registry`: `register()`, the attention function, `WeightsRequest` (weights of chosen
  heads, returned by the forward) and `WeightsAnswer` (how one attention call answers
  it, written once for the attention function and the DeepSeek layer).
- `layers`: one HF attention layer -> a standalone multihead module with the same
  weights (`from_bert`, `from_gpt2`, `from_llama`, `from_deepseek`, and `from_layer`,
  which picks one by the layer's class), and the model's RoPE settings -> `RotaryEmbedding`.
- `deepseek`: the one case the registry cannot serve: `use_latent_attention(model)` swaps
  DeepSeek-V2/V3 attention for a layer that calls `LatentAttention.forward`
  (transformers' angles, mask and cache through its `rotary=` and `store=`), so
  `generate()` caches the latent and decodes on the absorbed path;
  `restore_attention(model)` puts the original layers back, and saving a model with
  LatentAttention layers writes the original keys.
"""

from __future__ import annotations

from multihead.interop.hf.deepseek import (
    latent_attention_layers,
    latent_cache_bytes,
    restore_attention,
    use_latent_attention,
    uses_latent_attention,
)
from multihead.interop.hf.layers import (
    from_bert,
    from_deepseek,
    from_gpt2,
    from_layer,
    from_llama,
    rope_scaling_from_config,
    rotary_from_config,
)
from multihead.interop.hf.registry import (
    AttentionCall,
    CaptureComplete,
    WeightsRequest,
    attention_forward,
    hf_mask,
    register,
    registered,
)

__all__ = [
    "AttentionCall",
    "CaptureComplete",
    "WeightsRequest",
    "attention_forward",
    "from_bert",
    "from_deepseek",
    "from_gpt2",
    "from_layer",
    "from_llama",
    "hf_mask",
    "latent_attention_layers",
    "latent_cache_bytes",
    "register",
    "registered",
    "restore_attention",
    "rope_scaling_from_config",
    "rotary_from_config",
    "use_latent_attention",
    "uses_latent_attention",
]

try:  # registering needs transformers; the conversions alone do not import it
    register()
except ImportError:
    pass
