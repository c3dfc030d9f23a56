"""Bridges to other libraries' attention layers.

`multihead.interop.hf`: Hugging Face transformers. Importing it registers
attn_implementation="multihead" (every model whose attention calls transformers'
attention registry then runs on multihead's kernel); `use_latent_attention(model)` swaps
DeepSeek-V2/V3 attention for `LatentAttention` (latent cache, absorbed decode); `from_bert`,
`from_gpt2`, `from_llama`, `from_deepseek` take one layer out as a multihead module.
Nothing here imports transformers until one of these names is used.
"""

from __future__ import annotations

from multihead._lazy import lazy_exports

_LAZY = {
    "WeightsRequest": "multihead.interop.hf",
    "from_bert": "multihead.interop.hf",
    "from_deepseek": "multihead.interop.hf",
    "from_gpt2": "multihead.interop.hf",
    "from_llama": "multihead.interop.hf",
    "latent_attention_layers": "multihead.interop.hf",
    "register": "multihead.interop.hf",
    "restore_attention": "multihead.interop.hf",
    "use_latent_attention": "multihead.interop.hf",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
