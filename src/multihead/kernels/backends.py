"""The built-in backends, registered in the order `available_backends()` and the registry's
errors list them: "math", "sdpa", "chunked", "tiles", and "flex", whose module (and torch's
flex_attention) is imported on its first call only. `multihead.functional` imports this
module for its registrations; nothing imports `kernels.flex` at import time."""

from __future__ import annotations

from multihead.kernels import explicit_tiles
from multihead.kernels import math as explicit_math  # weights_pass read at call time: the tests spy on it
from multihead.kernels.registry import register_backend
from multihead.kernels.sdpa import sdpa

__all__ = ["flex", "tiles"]


def tiles(q, k, v, mask, *, causal, scale, dropout_p, weight_heads, score_mod=None):
    """The "tiles" backend: the online-softmax tile engine; weights from the weights pass."""
    out = explicit_tiles.explicit(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p,
                                  score_mod=score_mod)
    weights = None
    if weight_heads is not None:
        weights = explicit_math.weights_pass(q, k, mask, causal, scale, weight_heads, score_mod=score_mod)
    return out, weights


def flex(q, k, v, mask, **kw):
    """The "flex" backend, `kernels.flex.attention` imported on first use."""
    from multihead.kernels import flex as flex_kernel  # torch's flex_attention: imported and compiled on first use

    return flex_kernel.attention(q, k, v, mask, **kw)


register_backend("math", explicit_math.math_backend, weights=True, dropout=True, weights_with_dropout=True,
                 predicates=True, score_mods="any", sinks=True,
                 doc="explicit matmul-softmax-matmul; materialises (B, H, T, S)")
register_backend("sdpa", sdpa, weights=True, dropout=True, predicates=True, score_mods="additive",
                 doc="torch's fused kernel, block-sparse for predicates; weights from a memory-bounded pass")
register_backend("chunked", explicit_math.chunked, weights=True, dropout=False, predicates=True, score_mods="any",
                 sinks=True,
                 doc="explicit path over blocks of queries; memory bounded by one block of scores")
register_backend("tiles", tiles, weights=True, dropout=True, predicates=True, score_mods="any",
                 doc="explicit path over kept tiles, FlashAttention-2 backward: score mods and dropout in O(N) memory")
register_backend("flex", flex, weights=True, dropout=False, predicates=True, score_mods="any",
                 doc="torch.compile(flex_attention) with a cached block mask; opt-in (compiles per shape), "
                     "never picked by 'auto'")
