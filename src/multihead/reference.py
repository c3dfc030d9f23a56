"""The NumPy float64 reference: multi-head attention as the textbook writes it.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V              (Vaswani et al., 2017)
    MultiHead(X) = Concat(head_1, ..., head_H) W_O,  head_i = Attention(X W_Q^i, X W_K^i, X W_V^i)

No torch, no loops over heads: a reshape and a transpose split the heads, one batched
matmul does them all. It is the oracle of the tests, so it favours plainness over
speed. Weights are in the textbook orientation, `X @ W` with W of shape (in, out);
a torch `nn.Linear` holds the transpose (`W = linear.weight.T`).

Arrays: X `(B, T, C)` (or `(T, C)`), heads `(B, H, T, D)`. Masks: bool, True = may
attend; or float, added to the scores; broadcastable to `(B, H, T, S)`.
"""

from __future__ import annotations

import numpy as np

from multihead.checks import check_divisible

__all__ = [
    "alibi_bias",
    "alibi_slopes",
    "attention",
    "cap_scores",
    "combine_heads",
    "cross_attention",
    "gqa_forward",
    "mha_forward",
    "mla_forward",
    "rms_norm",
    "rope",
    "softmax",
    "split_heads",
]


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x - max) / sum(exp(x - max)); a row that is all -inf gives zeros, not NaN."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    """(..., T, H * D) -> (..., H, T, D)."""
    *lead, T, width = x.shape
    check_divisible("width", width, "n_heads", n_heads)
    x = x.reshape(*lead, T, n_heads, width // n_heads)  # (..., T, H, D)
    return np.swapaxes(x, -2, -3)  # (..., H, T, D)


def combine_heads(x: np.ndarray) -> np.ndarray:
    """(..., H, T, D) -> (..., T, H * D)."""
    x = np.swapaxes(x, -2, -3)  # (..., T, H, D)
    return x.reshape(*x.shape[:-2], -1)


def causal_mask(T: int, S: int) -> np.ndarray:
    """(T, S) bool, bottom-right aligned: query i sees keys j <= i + S - T."""
    return np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)


def cap_scores(scores: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(scores / cap): Gemma 2's logit soft-capping of the scaled scores."""
    return cap * np.tanh(np.asarray(scores, dtype=np.float64) / cap)


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi slopes (Press et al., 2022) as BLOOM computes them, `(H,)`.

    H a power of 2: 2^(-8/H), its square, ..., 2^(-8). Otherwise the H' = 2^floor(log2 H)
    slopes of H', then the odd powers of the 2H' schedule's ratio for the remaining heads.
    """
    closest = 2 ** int(np.floor(np.log2(n_heads)))
    ratio = 2.0 ** (-8.0 / closest)
    slopes = ratio ** np.arange(1, closest + 1)
    if closest < n_heads:
        ratio2 = 2.0 ** (-8.0 / (2 * closest))
        slopes = np.concatenate([slopes, ratio2 ** np.arange(1, 2 * (n_heads - closest), 2)])
    return slopes


def alibi_bias(slopes, T: int, S: int) -> np.ndarray:
    """`(H, T, S)` ALiBi bias slope_h * (j - p_i), query positions p_i = i + S - T (bottom-right)."""
    slopes = np.asarray(slopes, dtype=np.float64)
    dist = np.arange(S)[None, :] - (np.arange(T)[:, None] + (S - T))  # (T, S): j - p_i
    return slopes[:, None, None] * dist[None]


def attention(q, k, v, mask=None, causal=False, scale=None, return_weights=False, softcap_cap=None,
              alibi=None):
    """softmax(mod(q k^T * scale) + mask) v for q `(..., H, T, D)`, k/v `(..., Hkv, S, D|Dv)`.

    With Hkv < H (GQA/MQA), query head h uses key/value head h // (H // Hkv). The score
    mods act on the scaled scores before the mask: `softcap_cap` (cap * tanh(s / cap)),
    then `alibi` (the `(H,)` slopes; adds `alibi_bias`).
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    H, Hkv = q.shape[-3], k.shape[-3]
    check_divisible("query heads H", H, "key/value heads Hkv", Hkv)
    k = np.repeat(k, H // Hkv, axis=-3)  # (..., H, S, D): the textbook copies, the kernel does not
    v = np.repeat(v, H // Hkv, axis=-3)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ np.swapaxes(k, -1, -2) * scale  # (..., H, T, S)
    T, S = scores.shape[-2:]
    if softcap_cap is not None:
        scores = cap_scores(scores, softcap_cap)
    if alibi is not None:
        scores = scores + alibi_bias(alibi, T, S)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            scores = np.where(mask, scores, -np.inf)
        else:
            scores = scores + mask
    if causal:
        scores = np.where(causal_mask(T, S), scores, -np.inf)
    weights = softmax(scores, axis=-1)
    out = weights @ v  # (..., H, T, Dv)
    return (out, weights) if return_weights else out


def gqa_forward(X, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask=None, causal=False,
                b_q=None, b_k=None, b_v=None, b_o=None, context=None, head_dim=None,
                return_weights=False):
    """Grouped-query attention layer: X `(B, T, C)` -> `(B, T, C)`.

    W_q (C, H*D), W_k and W_v (C_ctx, Hkv*D), W_o (H*D, C); biases optional. Keys and
    values come from `context` `(B, S, C_ctx)` when given (cross-attention).
    """
    X = np.asarray(X, dtype=np.float64)
    Y = X if context is None else np.asarray(context, dtype=np.float64)

    def proj(A, W, b):
        out = A @ np.asarray(W, dtype=np.float64)
        return out if b is None else out + b

    Q = split_heads(proj(X, W_q, b_q), n_heads)  # (B, H, T, D)
    K = split_heads(proj(Y, W_k, b_k), n_kv_heads)  # (B, Hkv, S, D)
    V = split_heads(proj(Y, W_v, b_v), n_kv_heads)  # (B, Hkv, S, D)
    if head_dim is not None and Q.shape[-1] != head_dim:
        raise ValueError(f"head_dim {head_dim} does not match W_q's {Q.shape[-1]} per head")
    out, weights = attention(Q, K, V, mask=mask, causal=causal, return_weights=True)
    out = proj(combine_heads(out), W_o, b_o)  # (B, T, C)
    return (out, weights) if return_weights else out


def mha_forward(X, W_q, W_k, W_v, W_o, n_heads, mask=None, causal=False, **kw):
    """Multi-head attention layer (every head has its own K and V): see `gqa_forward`."""
    return gqa_forward(X, W_q, W_k, W_v, W_o, n_heads, n_heads, mask=mask, causal=causal, **kw)


def cross_attention(X, context, W_q, W_k, W_v, W_o, n_heads, n_kv_heads=None, mask=None, **kw):
    """Queries from X `(B, T, C)`, keys and values from context `(B, S, C_ctx)`."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    return gqa_forward(X, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask=mask, context=context, **kw)


def rms_norm(a: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """a / sqrt(mean(a^2) + eps) * weight over the last dim (RMSNorm, Zhang & Sennrich, 2019)."""
    a = np.asarray(a, dtype=np.float64)
    return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions, base: float = 10000.0, interleaved: bool = False) -> np.ndarray:
    """Rotary embedding of x `(..., T, d)` at integer `positions` `(T,)` (Su et al., 2021).

    Pair f turns by angle pos * base^(-2f/d). Half-split pairing (f, f + d/2) as HF's
    rotate_half, or interleaved (2f, 2f + 1) as GPT-J and DeepSeek-V2.
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)  # (d/2,)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]  # (T, d/2)
    cos, sin = np.cos(ang), np.sin(ang)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return np.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def mla_forward(X, W_kv_a, W_kv_b, W_o, n_heads, kv_rank, head_dim, rope_dim=0, *, W_q=None,
                W_q_a=None, g_q_a=None, W_q_b=None, g_kv=None, eps=1e-6, rope_base=10000.0,
                mask=None, causal=False, return_weights=False, softcap_cap=None):
    """Multi-head latent attention as the DeepSeek-V2 paper writes it (section 2.1).

    The latent c = RMSNorm(X W_kv_a[:, :R]) (no norm when g_kv is None) is decompressed
    into every head's key and value by W_kv_b (per head [W_UK_h | W_UV_h] columns); a
    decoupled RoPE key X W_kv_a[:, R:] is shared by all heads; queries are X W_q, or
    RMSNorm(X W_q_a) W_q_b. RoPE is interleaved; scores are scaled by 1/sqrt(D + rope_dim).
    """
    X = np.asarray(X, dtype=np.float64)
    H, Rk, D, Dr = n_heads, kv_rank, head_dim, rope_dim
    Q = X @ W_q if W_q is not None else rms_norm(X @ W_q_a, g_q_a, eps) @ W_q_b
    Q = split_heads(Q, H)  # (B, H, T, D + Dr)
    KV = X @ W_kv_a  # (B, T, R + Dr)
    c, k_pe = KV[..., :Rk], KV[..., Rk:]
    if g_kv is not None:
        c = rms_norm(c, g_kv, eps)
    if Dr:
        pos = np.arange(X.shape[-2])
        Q = np.concatenate([Q[..., :D], rope(Q[..., D:], pos, rope_base, interleaved=True)], axis=-1)
        k_pe = rope(k_pe, pos, rope_base, interleaved=True)
    up = split_heads(c @ W_kv_b, H)  # (B, H, S, D + Dv)
    B, _, S, _ = up.shape
    K = np.concatenate([up[..., :D], np.broadcast_to(k_pe[:, None], (B, H, S, Dr))], axis=-1)
    V = up[..., D:]
    out, w = attention(Q, K, V, mask=mask, causal=causal, scale=1 / np.sqrt(D + Dr), return_weights=True,
                       softcap_cap=softcap_cap)
    Y = combine_heads(out) @ W_o
    return (Y, w) if return_weights else Y
