"""multihead: multi-head attention for PyTorch, correct on every edge case.

Shape glossary (used in every comment and docstring of the package):

    B    batch                      H    query heads
    T    query length               Hkv  key/value heads (H % Hkv == 0)
    S    key length                 G    H // Hkv, query heads per KV head
    D    query/key head dim         Dv   value head dim
    C    model width (d_model)      R    latent rank (MLA)

Modules take and return batch-first `(B, T, C)`; kernels work on `(B, H, T, D)`.
A boolean mask means True = may attend; a float mask is added to the scores.
Causal attention with S > T is aligned bottom-right (query i sees keys j <= i + S - T).
A query row with no key to attend gives zeros, never NaN. The torch-backed names below
are imported on first use: `import multihead` and `multihead.plan` do not import torch.
"""

from __future__ import annotations

from multihead._lazy import lazy_exports

__version__ = "0.1.0"

_MODULES = {
    "multihead.functional": ("scaled_dot_product_attention", "attend", "attention_weights", "clear_caches",
                             "available_backends", "register_backend", "resolve_backend"),
    "multihead.attention": ("Attention",),
    "multihead.rope": ("RotaryEmbedding",),
    "multihead.cache": ("KVCache", "LatentCache"),
    "multihead.latent": ("LatentAttention",),
}

__getattr__, __dir__, _EXPORTS = lazy_exports(__name__, _MODULES, globals())
__all__ = ["__version__", *_EXPORTS]
