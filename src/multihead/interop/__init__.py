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

_MODULES = {
    "multihead.interop.hf": ("WeightsRequest", "from_bert", "from_deepseek", "from_gpt2", "from_llama",
                             "latent_attention_layers", "register", "restore_attention", "use_latent_attention"),
}

__getattr__, __dir__, _EXPORTS = lazy_exports(__name__, _MODULES, globals())
__all__ = _EXPORTS
