"""`Attention`: multi-head attention with grouped/multi-query heads, self or cross,
causal, dropout, rotary positions and a KV cache (Vaswani et al., 2017; Shazeer, 2019,
"Fast Transformer Decoding: One Write-Head is All You Need"; Ainslie et al., 2023,
"GQA").

One module does projections, RoPE and the cache; the kernel is a function picked by
name from `multihead.functional`. Modules take and return `(B, T, C)`; inside, the
layout is `(B, H, T, D)`. The head count is read back from the projection outputs
(width // D), so tensor parallelism (q/k/v column-wise, o row-wise) works unchanged.

The kernel call goes through one method, `_attend`, so a wrapper that runs attention
another way (ring attention over a sequence split across processes) overrides that
method and nothing else. `forward` takes the positions of its tokens (`positions=`) or
precomputed rotary angles (`rotary=`) where a caller owns them (context parallelism,
Hugging Face's rotary module), so there is one forward for every caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from multihead import masks, score_mods
from multihead.cache import KVCache, RollingKVCache
from multihead.checks import check_kv_heads, check_positive_int, check_probability, variant_name
from multihead.functional import attend
from multihead.head_access import HeadAccess
from multihead.layer_parts import (
    check_dtype,
    check_input,
    default_head_dim,
    layer_options,
    merge_heads,
    split_heads,
    with_window,
)
from multihead.masks import MaskMod
from multihead.rope import RotaryEmbedding, apply_rotary

__all__ = ["Attention"]


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
        sliding_window: W, for a causal layer whose query at position p sees keys
            p - W < j <= p only (Mistral, Gemma-2's local layers); needs causal=True.
            `new_cache` then gives a `RollingKVCache` of W slots.
        softcap: cap the scaled scores at +-softcap with softcap * tanh(s / softcap)
            (Gemma-2's attention logit softcapping).
        alibi: add ALiBi's linear distance bias (Press et al., 2022; BLOOM, MPT) with the
            standard per-head slopes `multihead.score_mods.alibi_slopes(n_heads)`.
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
        sliding_window: int | None = None,
        softcap: float | None = None,
        alibi: bool = False,
    ):
        super().__init__()
        check_positive_int("d_model", d_model)
        n_kv_heads = check_kv_heads(n_heads, n_kv_heads)
        head_dim = default_head_dim(d_model, n_heads, head_dim)
        context_dim = d_model if context_dim is None else context_dim
        check_positive_int("context_dim", context_dim)
        check_probability("dropout", dropout)
        options = layer_options(causal, sliding_window, softcap, backend)
        if rope is True:
            rope = RotaryEmbedding(head_dim)
        elif rope is False:
            rope = None
        elif rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be None, True or a RotaryEmbedding; received {type(rope).__name__}")
        if rope is not None and rope.dim > head_dim:
            raise ValueError(f"rotary dim ({rope.dim}) exceeds head_dim ({head_dim})")
        if not isinstance(alibi, bool):
            raise TypeError(f"alibi must be True or False; received {alibi!r}")
        if alibi and softcap is not None:
            raise ValueError("softcap and alibi together are not supported (no model combines them); "
                             "pass one, or call the kernel with your own score_mod")

        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.context_dim = context_dim
        self.dropout = float(dropout)
        self.causal, self.sliding_window, self.softcap, self.backend = options
        self.rope = rope
        self.alibi = alibi
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(context_dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(context_dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)

    @property
    def n_groups(self) -> int:
        """G = H // Hkv, query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def head_access(self) -> HeadAccess:
        """What the head tools hook (`multihead.head_access`); head counts from the projections'
        widths, which a pruned module has narrowed."""
        D = self.head_dim
        return HeadAccess("attention", self.o_proj.in_features // D, self.k_proj.out_features // D, D, D,
                          q=self.q_proj, o=self.o_proj, k=self.k_proj, v=self.v_proj)

    def extra_repr(self) -> str:
        kind = variant_name(self.n_heads, self.n_kv_heads)
        extra = "".join(f", {name}={value}" for name, value in (
            ("sliding_window", self.sliding_window), ("softcap", self.softcap), ("alibi", self.alibi or None))
            if value is not None)
        return (f"{kind}, d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}{extra}, backend={self.backend!r}")

    def new_cache(self, batch_size: int, max_len: int | None = None, *, rolling: bool | None = None,
                  dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> KVCache:
        """A cache for this layer's keys and values.

        A static `KVCache` `(B, Hkv, max_len, D)`; or, for a sliding-window layer (the
        default there, `rolling=None`), a `RollingKVCache` of `sliding_window` slots that
        decodes sequences of any length in O(W) memory (max_len is then not needed). The
        default holds min(W, max_len) slots: with max_len <= W no key ever leaves the
        window, so a static cache of max_len serves (512 slots, not 32768, for a 512-token
        run of a layer with a 32k window). For cross-attention, either kind holds the
        whole context (a rolling cache widens to it).
        """
        if max_len is not None:
            check_positive_int("max_len", max_len)
        if rolling is None:
            rolling = self.sliding_window is not None and (max_len is None or max_len > self.sliding_window)
        if rolling and self.sliding_window is None:
            raise ValueError("rolling=True needs a sliding-window layer (Attention(..., sliding_window=W)); "
                             "this layer attends every earlier key")
        w = self.k_proj.weight
        kw = dict(dtype=w.dtype if dtype is None else dtype, device=w.device if device is None else device)
        if rolling:
            return RollingKVCache(batch_size, self.n_kv_heads, self.sliding_window, self.head_dim, **kw)
        if max_len is None:
            raise ValueError("new_cache needs max_len (the longest sequence it will hold) for a static cache")
        return KVCache(batch_size, self.n_kv_heads, max_len, self.head_dim, **kw)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | MaskMod | None = None,
        cache: KVCache | None = None,
        return_weights: bool | Sequence[int] = False,
        positions: Tensor | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x `(B, T, d_model)` to itself, or to `context` `(B, S, context_dim)`.

        Args:
            mask: bool (True = may attend) / float tensor broadcastable to `(B, H, T, S)`,
                or a `multihead.masks` predicate; combined with the module's causality.
            cache: a `KVCache` from `new_cache`. Self-attention appends this call's keys
                and values and attends over everything cached (RoPE positions continue
                from the cache length). Cross-attention fills it from `context` on the
                first call and reuses it afterwards (the context is not projected again).
                If the call raises, the cache is left exactly as it was.
            return_weights: True, or a list of head indices, to also get the attention
                weights `(B, h, T, S)` of those heads.
            positions: integer positions of x's tokens for RoPE, `(T,)` or `(B, T)`
                (default: 0..T-1 after what the cache holds). A process holding one
                shard of a sequence passes the shard's global positions.
            rotary: precomputed `(cos, sin)`, each `(T, r/2)` or `(B|1, 1, T, r/2)` for
                the rotary dim r of `self.rope` (a caller that owns the rotary angles,
                such as a Hugging Face model with RoPE scaling).

        Returns:
            `(B, T, d_model)`, or `(out, weights)`.
        """
        self._check_call(x, context, cache, positions, rotary)
        q, k, v = self._project(x, context, cache)  # (B, H, T, D), (B, Hkv, S, D) x 2 (None: a held context)
        if cache is None:
            if self.rope is not None:
                q, k = self._rotate(q, k, positions, rotary, 0)
            return self._finish(q, k, v, mask, self.causal, return_weights)
        # A call that raises leaves the cache as it was (undone at the error). A compiled step
        # reads no length on the host, so it takes no mark.
        undo = nullcontext() if k is None or (torch.compiler.is_compiling() and context is None) \
            else cache.checkpoint(k.shape[2])
        with undo:
            q, k, v, mask, folded = self._cache_step(q, k, v, mask, cache, context, positions, rotary,
                                                     return_weights)
            # folded: the mask holds causality and the window already, or the query sees every key
            return self._finish(q, k, v, mask, self.causal and not folded, return_weights, window=not folded)

    def _check_call(self, x, context, cache, positions, rotary) -> None:
        """Every check of a call's arguments, before any projection or cache write."""
        check_input("x", x, self.d_model)
        check_dtype("x", x, self.q_proj.weight)
        B, T, _ = x.shape
        if context is not None:
            check_input("context", context, self.context_dim)
            check_dtype("context", context, self.k_proj.weight)
            if context.shape[0] != B:
                raise ValueError(f"context batch size ({context.shape[0]}) must equal x's ({B})")
            if self.rope is not None:
                raise ValueError("rotary embeddings are defined for self-attention; this module has "
                                 "rope set but received a context (cross-attention)")
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache from new_cache(); received {type(cache).__name__}")
        if positions is not None and rotary is not None:
            raise ValueError("pass positions= or rotary=(cos, sin), not both")
        if (positions is not None or rotary is not None) and self.rope is None:
            raise ValueError("positions/rotary were given but this module has no rotary embedding (rope=None)")
        if positions is not None:
            self._check_positions(positions, B, T)
        if cache is not None:
            self._check_cache_fits(cache, context)

    def _project(self, x: Tensor, context: Tensor | None, cache: KVCache | None):
        """q `(B, H, T, D)`, and k, v `(B, Hkv, S, D)` of x or the context; k, v are None
        when the cache already holds the context (it is not projected again)."""
        D = self.head_dim
        q = split_heads(self.q_proj(x), D)  # (B, H, T, D)
        if context is not None and cache is not None and cache.length > 0:
            return q, None, None
        src = x if context is None else context
        return q, split_heads(self.k_proj(src), D), split_heads(self.v_proj(src), D)  # (B, Hkv, S, D)

    def _cache_step(self, q, k, v, mask, cache: KVCache, context, positions, rotary, return_weights):
        """This call's keys and values into the cache (RoPE at the cached positions first),
        and what to attend: (q, k, v, mask, folded). `folded`: the mask already holds
        causality and the window, or the one query sees every key returned."""
        if context is not None:
            # cross-attention: the first call holds the whole context, later ones reuse it
            k, v = cache.cached() if k is None else cache.hold_context(k, v)  # (B, Hkv, S, D)
            return q, k, v, mask, False
        if torch.compiler.is_compiling():
            q, k, v, mask = self._static_cache_step(q, k, v, mask, cache)
            return q, k, v, mask, True  # causality, the window and the unwritten slots: in the mask
        if self.rope is not None:
            q, k = self._rotate(q, k, positions, rotary, cache.length)
        if isinstance(cache, RollingKVCache) and q.shape[2] == 1 and mask is None and not return_weights \
                and not self.alibi:
            # one query over a rolling cache sees every cached key (the last W tokens): no
            # mask, so the slots' order does not matter; nothing copied, no tiles planned
            k, v = cache.update(k, v, ordered=False)  # (B, Hkv, min(length, W), D)
            return q, k, v, None, True
        k, v = cache.update(k, v)  # (B, Hkv, S_cached, D)
        return q, k, v, mask, False

    def _check_cache_fits(self, cache: KVCache, context: Tensor | None) -> None:
        """A cache made for other work gives wrong answers, not errors: a rolling cache of
        another window drops keys this layer still sees (or keeps keys it must not see); a
        cache holding one context answers for another. Refused, naming both."""
        if context is not None:
            if cache.length and context.shape[1] != cache.length:
                raise ValueError(f"the cache holds a cross-attention context of {cache.length} tokens; received "
                                 f"a context of {context.shape[1]}. reset() the cache for a new context")
            return
        if isinstance(cache, RollingKVCache):
            if cache.holds_context:
                raise ValueError(f"this RollingKVCache holds a cross-attention context ({cache.length} tokens); "
                                 f"reset() it before self-attention")
            if cache.window != self.sliding_window:
                layer = ("a full causal layer (sliding_window=None)" if self.sliding_window is None
                         else f"sliding_window={self.sliding_window}")
                raise ValueError(f"a RollingKVCache of window {cache.window} does not fit this layer, "
                                 f"{layer}: it keeps the last {cache.window} keys where the layer sees "
                                 f"{'every earlier key' if self.sliding_window is None else self.sliding_window}. "
                                 f"Make the cache with this layer's new_cache()")

    def _rotate(self, q: Tensor, k: Tensor, positions, rotary, offset: int) -> tuple[Tensor, Tensor]:
        """RoPE on q and k from explicit positions, given angles, or the cache offset."""
        if rotary is None and positions is None:
            return self.rope(q, offset), self.rope(k, offset)
        if rotary is None:
            pos = positions.reshape(-1)  # (T,) or (B*T,)
            cos, sin = self.rope.cos_sin(pos)  # (T | B*T, r/2)
            if positions.dim() == 2:
                cos = cos.view(positions.shape[0], 1, positions.shape[1], -1)  # (B, 1, T, r/2)
                sin = sin.view(positions.shape[0], 1, positions.shape[1], -1)
        else:
            cos, sin = rotary
        interleaved = self.rope.interleaved
        return apply_rotary(q, cos, sin, interleaved=interleaved), apply_rotary(k, cos, sin, interleaved=interleaved)

    def _finish(self, q, k, v, mask, causal, return_weights, *, window: bool = True):
        """The kernel through `_attend` (with this layer's window unless the mask has it
        already), then the output projection."""
        mask = self._layer_mask(mask, q, k) if window else mask
        out, weights = self._attend(q, k, v, mask, causal=causal,
                                    dropout_p=self.dropout if self.training else 0.0,
                                    return_weights=return_weights)
        out = self.o_proj(merge_heads(out))  # (B, T, C)
        return out if weights is None else (out, weights)

    def _layer_mask(self, mask, q: Tensor, k: Tensor):
        """The caller's mask combined with this layer's sliding window (`multihead.layer_parts.with_window`)."""
        return with_window(mask, self.sliding_window, q, k)

    def _score_mod(self):
        """The score mod this layer applies (softcap or ALiBi), or None."""
        if self.softcap is not None:
            return score_mods.softcap(self.softcap)
        if self.alibi:  # one slope per head (a tensor-parallel shard overrides this with its own)
            return score_mods.alibi(score_mods.alibi_slopes(self.n_heads))
        return None

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask, *, causal: bool, dropout_p: float,
                return_weights) -> tuple[Tensor, Tensor | None]:
        """The attention kernel on `(B, H, T, D)` q and `(B, Hkv, S, D)` k, v: returns
        `(out (B, H, T, D), weights or None)`. Wrappers override this one method."""
        return attend(q, k, v, mask, causal=causal, dropout_p=dropout_p, return_weights=return_weights,
                      backend=self.backend, score_mod=self._score_mod())

    def _static_cache_step(self, q, k, v, mask, cache: KVCache):
        """The compiled decode step: positions are tensors, keys span the whole buffer and
        a positional mask hides the unwritten tail (and the future, when causal)."""
        T = q.shape[2]
        pos = cache.position.clone()  # first new token's position, read before the update
        if self.rope is not None:
            q, k = self.rope(q, pos), self.rope(k, pos)
        k, v = cache.update(k, v, static=True)  # (B, Hkv, S_max, D)
        kv_idx = torch.arange(cache.max_len, device=q.device)[None, :]  # (1, S_max)
        q_pos = pos + torch.arange(T, device=q.device)[:, None]  # (T, 1): the new tokens' positions
        allowed = kv_idx < pos + T  # (T, S_max): the slots written so far
        if self.sliding_window is not None or self.causal:  # the layer's predicate at those positions
            layer = masks.sliding_window(self.sliding_window) if self.sliding_window is not None else masks.causal()
            allowed = allowed & layer(None, None, q_pos, kv_idx)
        allowed = allowed[None, None]
        if mask is not None:
            if isinstance(mask, MaskMod):
                raise ValueError("under torch.compile a cached step takes a tensor mask over all "
                                 f"max_len ({cache.max_len}) key slots, not a predicate")
            allowed = allowed & mask if mask.dtype == torch.bool else \
                mask.masked_fill(~allowed, float("-inf"))
        return q, k, v, allowed

    @staticmethod
    def _check_positions(positions, B: int, T: int) -> None:
        if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            got = f"dtype {positions.dtype}" if isinstance(positions, Tensor) else type(positions).__name__
            raise TypeError(f"positions must be an integer tensor (T,) or (B, T); received {got}")
        if tuple(positions.shape) not in ((T,), (B, T)):
            raise ValueError(f"positions must have shape (T,) = ({T},) or (B, T) = ({B}, {T}); "
                             f"received {tuple(positions.shape)}")
