"""Hugging Face transformers models on multihead.

Importing this package registers "multihead" as a transformers attention
implementation (see `registry`), so

    import multihead.interop.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="multihead")

runs every model whose attention goes through transformers' attention registry on
multihead's kernel, with nothing else of the model changed.

Three modules: `registry` (the attention function, `WeightsRequest`), `layers` (one HF
layer as a multihead module) and `deepseek` (`use_latent_attention`).

Details: docs/inspect.md, "`multihead.interop.hf`: three jobs".
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
