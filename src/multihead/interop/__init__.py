"""Bridges to other libraries' attention layers.

`multihead.interop.hf`: Hugging Face transformers models (BERT-family encoders, GPT-2,
Llama / Mistral / Qwen2) as `multihead.Attention` modules with the same weights, and
`patch(model)` to run a loaded model on multihead. transformers itself is never
imported here: the functions work on the modules they are given.
"""

from __future__ import annotations

from multihead._lazy import lazy_exports

_LAZY = {
    "convert": "multihead.interop.hf",
    "from_bert": "multihead.interop.hf",
    "from_gpt2": "multihead.interop.hf",
    "from_llama": "multihead.interop.hf",
    "patch": "multihead.interop.hf",
    "patched_layers": "multihead.interop.hf",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
