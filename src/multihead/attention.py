"""`Attention`: multi-head attention with grouped/multi-query heads, self or cross,
causal, dropout, rotary positions and a KV cache (Vaswani et al., 2017; Shazeer, 2019,
"Fast Transformer Decoding: One Write-Head is All You Need"; Ainslie et al., 2023,
"GQA").

One module does projections, RoPE and the cache; the kernel is a function picked by
name from `multihead.functional`. Modules take and return `(B, T, C)`; inside, the
layout is `(B, H, T, D)`. The head count is read back from the projection outputs
(`view(B, T, -1, D)`), so tensor parallelism that splits q/k/v column-wise and o
row-wise (torch.distributed.tensor.parallel) works on the module unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from multihead.cache import KVCache
from multihead.functional import check_backend_name, scaled_dot_product_attention
from multihead.masks import MaskMod
from multihead.rope import RotaryEmbedding

__all__ = ["Attention"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; received {value!r}")


def _default_head_dim(d_model: int, n_heads: int, head_dim: int | None) -> int:
    """head_dim as given (checked), else d_model // n_heads when that divides evenly."""
    if head_dim is None:
        if d_model % n_heads:
            raise ValueError(
                f"d_model ({d_model}) is not divisible by n_heads ({n_heads}); pass head_dim "
                f"explicitly, or use n_heads in {', '.join(map(str, _divisors(d_model)))}"
            )
        head_dim = d_model // n_heads
    _check_int("head_dim", head_dim)
    return head_dim


class Attention(nn.Module):
    """Multi-head attention: MHA, GQA (1 < n_kv_heads < n_heads) or MQA (n_kv_heads = 1).

    Args:
        d_model: model width C of the queries' input and of the output.
        n_heads: query heads H.
        n_kv_heads: key/value heads Hkv, dividing H (default H: MHA; 1: MQA).
        head_dim: D, default d_model // n_heads; may be set freely (Gemma-2: 256 with
            d_model 3584), then the projections are C -> H * D.
        context_dim: width of the `context` for cross-attention (default d_model).
        bias: biases on all four projections.
        dropout: on the attention probabilities, in training mode only.
        causal: bottom-right causal masking (decoder self-attention).
        rope: None, True (rotary over the whole head, half-split layout, base 10000)
            or a `RotaryEmbedding` (for another base, layout or a partial rotary dim).
        backend: kernel name for `multihead.scaled_dot_product_attention`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        context_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        rope: bool | RotaryEmbedding | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        _check_int("d_model", d_model)
        _check_int("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        _check_int("n_kv_heads", n_kv_heads)
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads}); "
                f"valid: {', '.join(map(str, _divisors(n_heads)))}"
            )
        head_dim = _default_head_dim(d_model, n_heads, head_dim)
        context_dim = d_model if context_dim is None else context_dim
        _check_int("context_dim", context_dim)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1); received {dropout!r}")
        check_backend_name(backend)
        if rope is True:
            rope = RotaryEmbedding(head_dim)
        elif rope is False:
            rope = None
        elif rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be None, True or a RotaryEmbedding; received {type(rope).__name__}")
        if rope is not None and rope.dim > head_dim:
            raise ValueError(f"rotary dim ({rope.dim}) exceeds head_dim ({head_dim})")

        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.context_dim = context_dim
        self.dropout = float(dropout)
        self.causal = bool(causal)
        self.backend = backend
        self.rope = rope
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(context_dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(context_dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)

    @property
    def n_groups(self) -> int:
        """G = H // Hkv, query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def extra_repr(self) -> str:
        kind = "MHA" if self.n_kv_heads == self.n_heads else "MQA" if self.n_kv_heads == 1 else "GQA"
        return (f"{kind}, d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, backend={self.backend!r}")

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """A static cache for this layer: `(B, Hkv, max_len, D)` keys and values."""
        w = self.k_proj.weight
        return KVCache(batch_size, self.n_kv_heads, max_len, self.head_dim,
                       dtype=w.dtype if dtype is None else dtype,
                       device=w.device if device is None else device)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | MaskMod | None = None,
        cache: KVCache | None = None,
        return_weights: bool | Sequence[int] = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x `(B, T, d_model)` to itself, or to `context` `(B, S, context_dim)`.

        Args:
            mask: bool (True = may attend) / float tensor broadcastable to `(B, H, T, S)`,
                or a `multihead.masks` predicate; combined with the module's causality.
            cache: a `KVCache` from `new_cache`. Self-attention appends this call's keys
                and values and attends over everything cached (RoPE positions continue
                from the cache length). Cross-attention fills it from `context` on the
                first call and reuses it afterwards (the context is not projected again).
            return_weights: True, or a list of head indices, to also get the attention
                weights `(B, h, T, S)` of those heads.

        Returns:
            `(B, T, d_model)`, or `(out, weights)`.
        """
        self._check_input("x", x, self.d_model)
        B, T, _ = x.shape
        D = self.head_dim
        cross = context is not None
        if cross:
            self._check_input("context", context, self.context_dim)
            if context.shape[0] != B:
                raise ValueError(f"context batch size ({context.shape[0]}) must equal x's ({B})")
            if self.rope is not None:
                raise ValueError("rotary embeddings are defined for self-attention; this module has "
                                 "rope set but received a context (cross-attention)")
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache from new_cache(); received {type(cache).__name__}")

        q = self.q_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        causal = self.causal
        if cross and cache is not None and cache.length > 0:
            k, v = cache.k[:, :, : cache.length], cache.v[:, :, : cache.length]  # reuse the context
        else:
            src = context if cross else x
            S = src.shape[1]
            k = self.k_proj(src).view(B, S, -1, D).transpose(1, 2)  # (B, Hkv, S, D)
            v = self.v_proj(src).view(B, S, -1, D).transpose(1, 2)  # (B, Hkv, S, D)
            if cache is not None and not cross and torch.compiler.is_compiling():
                q, k, v, mask = self._static_cache_step(q, k, v, mask, cache)
                causal = False  # folded into the positional mask
            else:
                if self.rope is not None:
                    offset = cache.length if cache is not None else 0
                    q = self.rope(q, offset)
                    k = self.rope(k, offset)
                if cache is not None:
                    k, v = cache.update(k, v)  # (B, Hkv, S_cached, D)

        result = scaled_dot_product_attention(
            q, k, v, mask,
            causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=return_weights,
            backend=self.backend,
        )
        out, weights = result if isinstance(result, tuple) else (result, None)
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)
        return out if weights is None else (out, weights)

    def _static_cache_step(self, q, k, v, mask, cache: KVCache):
        """The compiled decode step: positions are tensors, keys span the whole buffer and
        a positional mask hides the unwritten tail (and the future, when causal)."""
        T = q.shape[2]
        pos = cache.position.clone()  # first new token's position, read before the update
        if self.rope is not None:
            q, k = self.rope(q, pos), self.rope(k, pos)
        k, v = cache.update_static(k, v)  # (B, Hkv, S_max, D)
        kv_idx = torch.arange(cache.max_len, device=q.device)[None, :]
        q_pos = pos + torch.arange(T, device=q.device)[:, None]
        allowed = (kv_idx <= q_pos) if self.causal else (kv_idx < pos + T)  # (T, S_max)
        allowed = allowed[None, None]
        if mask is not None:
            if isinstance(mask, MaskMod):
                raise ValueError("under torch.compile a cached step takes a tensor mask over all "
                                 f"max_len ({cache.max_len}) key slots, not a predicate")
            allowed = allowed & mask if mask.dtype == torch.bool else \
                mask.masked_fill(~allowed, float("-inf"))
        return q, k, v, allowed

    @staticmethod
    def _check_input(name: str, t, width: int) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor (B, T, {width}); received {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (B, T, {width}), batch first; received shape {tuple(t.shape)}")
        if t.shape[-1] != width:
            raise ValueError(f"{name} has width {t.shape[-1]}; this module expects {width}")
        if t.shape[1] == 0:
            raise ValueError(f"{name} has no tokens (length 0)")

    # ------------------------------------------------------------ torch interop

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, *, causal: bool = False,
                   backend: str = "auto") -> Attention:
        """An `Attention` with exactly the weights of an `nn.MultiheadAttention`.

        batch_first either way is fine (this module is always batch-first). kdim == vdim
        != embed_dim becomes `context_dim`. Options with no equivalent raise: bias_k/bias_v
        and add_zero_attn (they append a learned or zero key to every sequence), and
        kdim != vdim (this module projects keys and values from one context tensor).
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"from_torch takes an nn.MultiheadAttention; received {type(mha).__name__}")
        if mha.bias_k is not None or mha.bias_v is not None:
            raise ValueError("nn.MultiheadAttention with add_bias_kv=True appends a learned key/value "
                             "to every sequence; multihead.Attention has no equivalent")
        if mha.add_zero_attn:
            raise ValueError("nn.MultiheadAttention with add_zero_attn=True appends a zero key/value; "
                             "multihead.Attention has no equivalent")
        if mha.kdim != mha.vdim:
            raise ValueError(f"kdim ({mha.kdim}) != vdim ({mha.vdim}): multihead.Attention projects keys "
                             "and values from one context tensor; valid: kdim == vdim")
        E, H = mha.embed_dim, mha.num_heads
        bias = mha.in_proj_bias is not None
        attn = cls(E, H, head_dim=mha.head_dim, context_dim=mha.kdim, bias=bias, dropout=mha.dropout,
                   causal=causal, backend=backend)
        attn = attn.to(device=mha.out_proj.weight.device, dtype=mha.out_proj.weight.dtype)
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                wq, wk, wv = mha.in_proj_weight.chunk(3)
            else:
                wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
            for lin, w in ((attn.q_proj, wq), (attn.k_proj, wk), (attn.v_proj, wv)):
                lin.weight.copy_(w)
            attn.o_proj.weight.copy_(mha.out_proj.weight)
            if bias:
                for lin, b in zip((attn.q_proj, attn.k_proj, attn.v_proj), mha.in_proj_bias.chunk(3)):
                    lin.bias.copy_(b)
                attn.o_proj.bias.copy_(mha.out_proj.bias)
        return attn

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """An `nn.MultiheadAttention` with exactly these weights (MHA only, D = C / H, no RoPE)."""
        reasons = []
        if self.n_kv_heads != self.n_heads:
            reasons.append(f"n_kv_heads ({self.n_kv_heads}) != n_heads ({self.n_heads}): "
                           "nn.MultiheadAttention has no grouped heads")
        if self.head_dim * self.n_heads != self.d_model:
            reasons.append(f"head_dim * n_heads ({self.head_dim * self.n_heads}) != d_model "
                           f"({self.d_model}): nn.MultiheadAttention needs head_dim = d_model / n_heads")
        if self.rope is not None:
            reasons.append("rotary embeddings have no nn.MultiheadAttention equivalent")
        has_bias = [lin.bias is not None for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj)]
        if any(has_bias) and not all(has_bias):
            reasons.append("biases on some projections only (nn.MultiheadAttention: all or none)")
        if reasons:
            raise ValueError("cannot convert to nn.MultiheadAttention: " + "; ".join(reasons))
        w = self.q_proj.weight
        mha = nn.MultiheadAttention(
            self.d_model, self.n_heads, dropout=self.dropout, bias=all(has_bias),
            kdim=self.context_dim, vdim=self.context_dim, batch_first=batch_first,
            device=w.device, dtype=w.dtype,
        )
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                mha.in_proj_weight.copy_(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
            else:
                mha.q_proj_weight.copy_(self.q_proj.weight)
                mha.k_proj_weight.copy_(self.k_proj.weight)
                mha.v_proj_weight.copy_(self.v_proj.weight)
            mha.out_proj.weight.copy_(self.o_proj.weight)
            if all(has_bias):
                mha.in_proj_bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
                mha.out_proj.bias.copy_(self.o_proj.bias)
        return mha
