"""`LatentAttention`: multi-head latent attention, MLA (DeepSeek-AI, 2024, "DeepSeek-V2:
A Strong, Economical, and Efficient Mixture-of-Experts Language Model", section 2.1).

Keys and values of every head are decompressed from one small latent per token,
c_kv = RMSNorm(W_DKV x) of width R, so a cache stores R + rope_dim values per token
instead of 2 * H * D. RoPE cannot pass through the compression (a position-dependent
rotation does not commute with the up-projection), so a few extra features carry it:
a decoupled RoPE key k_pe of width rope_dim, shared by every head and cached beside
c_kv, and a RoPE part q_pe of each head's query.

Two paths compute it with equal outputs: naive (decompress K and V, then MHA) and
absorbed (W_UK folded into the query, attention over the latent itself). The layout and
weight names follow DeepSeek-V2 (and transformers' DeepseekV2Attention).

Details: docs/kernel.md, "Multi-head latent attention: the formula and its two paths".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from multihead import score_mods
from multihead.cache import LatentCache
from multihead.checks import check_nonnegative_int, check_positive_int
from multihead.functional import attend
from multihead.head_access import HeadAccess
from multihead.kernels import common
from multihead.layer_parts import check_dtype, check_input, default_head_dim, layer_options, merge_heads, with_window
from multihead.masks import MaskMod
from multihead.rope import RopeScaling, RotaryEmbedding, apply_rotary

__all__ = ["LatentAttention"]

# RMSNorm epsilon of DeepSeek-V2's q_a_layernorm / kv_a_layernorm.
_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention (MLA) with a latent KV cache and weight absorption.

    Args:
        d_model: model width C.
        n_heads: query heads H (each has its own decompressed key and value).
        kv_rank: R, width of the compressed KV latent c_kv (DeepSeek-V2: 512).
        q_rank: None for a direct query projection `q_proj`; else the rank of a low-rank
            query `q_b_proj(q_a_norm(q_a_proj(x)))` (DeepSeek-V2: 1536).
        head_dim: D, the non-rotary part of each query/key head (default d_model // n_heads).
        rope_dim: width of the decoupled RoPE part of the queries and of the one shared
            RoPE key (even; 0 for none; DeepSeek-V2: 64).
        v_head_dim: Dv, value head dim (default head_dim).
        causal: bottom-right causal masking (decoder self-attention).
        rope_base: RoPE wavelength base theta.
        backend: kernel name for `multihead.scaled_dot_product_attention`.
        latent_norm: RMSNorm on the KV latent (DeepSeek-V2 has it). False replaces it by
            the identity: the latent is then a linear function of x, which is what an
            exact conversion of an MHA layer needs (`multihead.convert.to_mla`).
        bias: biases on the query input projection (q_proj, or q_a_proj), on kv_a_proj and
            on o_proj, as transformers' `attention_bias=True`; DeepSeek-V2 has none.
        rope_scaling: a `multihead.rope.RopeScaling` (or transformers' rope_parameters
            dict): DeepSeek-V2/V3 ship YaRN, which also multiplies the softmax scale.
        rope_interleaved: RoPE over pairs (2f, 2f+1), as DeepSeek (default); False for the
            half-split pairing (DeepSeek-V3 checkpoints with rope_interleave=False).
        sliding_window: W, as `Attention`'s (query p sees keys p - W < j <= p; needs
            causal=True), on both paths; the latent cache stays static (O(max_len)).
        softcap: cap the scaled scores at +-softcap (softcap * tanh(s / softcap)), as
            `Attention`'s; the absorbed scores equal the naive ones, so both paths cap alike.

    Submodules (no biases by default): `q_proj` Linear(C, H*(D+rope_dim)) or `q_a_proj`
    Linear(C, q_rank), `q_a_norm` RMSNorm(q_rank), `q_b_proj` Linear(q_rank, H*(D+rope_dim));
    `kv_a_proj` Linear(C, R+rope_dim); `kv_a_norm` RMSNorm(R); `kv_b_proj`
    Linear(R, H*(D+Dv)), rows ordered per head as [W_UK_h ; W_UV_h]; `o_proj` Linear(H*Dv, C).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        kv_rank: int,
        *,
        q_rank: int | None = None,
        head_dim: int | None = None,
        rope_dim: int = 0,
        v_head_dim: int | None = None,
        causal: bool = False,
        rope_base: float = 10000.0,
        backend: str = "auto",
        latent_norm: bool = True,
        bias: bool = False,
        rope_scaling: RopeScaling | dict | None = None,
        rope_interleaved: bool = True,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        check_positive_int("kv_rank", kv_rank)
        if q_rank is not None:
            check_positive_int("q_rank", q_rank)
        head_dim = default_head_dim(d_model, n_heads, head_dim)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        check_positive_int("v_head_dim", v_head_dim)
        check_nonnegative_int("rope_dim", rope_dim)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even (RoPE rotates pairs of features); received {rope_dim}; "
                             f"valid: 0 or an even int such as {rope_dim - 1} or {rope_dim + 1}")
        if isinstance(rope_base, bool) or not isinstance(rope_base, (int, float)):
            raise TypeError(f"rope_base must be a number > 1; received {rope_base!r} ({type(rope_base).__name__})")
        if not rope_base > 1:
            raise ValueError(f"rope_base must be a number > 1; received {rope_base!r}")
        options = layer_options(causal, sliding_window, softcap, backend)

        self.d_model = d_model
        self.n_heads = n_heads
        self.kv_rank = kv_rank
        self.q_rank = q_rank
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.v_head_dim = v_head_dim
        self.causal, self.sliding_window, self.softcap, self.backend = options
        self.latent_norm = bool(latent_norm)
        qk_dim = head_dim + rope_dim
        if q_rank is None:
            self.q_proj = nn.Linear(d_model, n_heads * qk_dim, bias=bias)
        else:
            self.q_a_proj = nn.Linear(d_model, q_rank, bias=bias)
            self.q_a_norm = nn.RMSNorm(q_rank, eps=_NORM_EPS)
            self.q_b_proj = nn.Linear(q_rank, n_heads * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(d_model, kv_rank + rope_dim, bias=bias)
        self.kv_a_norm = nn.RMSNorm(kv_rank, eps=_NORM_EPS) if latent_norm else nn.Identity()
        self.kv_b_proj = nn.Linear(kv_rank, n_heads * (head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * v_head_dim, d_model, bias=bias)
        if rope_scaling is not None and not rope_dim:
            raise ValueError("rope_scaling was given but rope_dim is 0 (no rotary features to scale)")
        self.rope = RotaryEmbedding(rope_dim, rope_base, interleaved=rope_interleaved,
                                    scaling=rope_scaling) if rope_dim else None

    def head_access(self) -> HeadAccess:
        """What the head tools hook (`multihead.head_access`): per-head keys and values through
        the up-projection `kv_b_proj`, the latent from `kv_a_proj`."""
        return HeadAccess("latent", self.n_heads, self.n_heads, self.head_dim, self.v_head_dim,
                          q=self.q_proj if self.q_rank is None else self.q_b_proj, o=self.o_proj, kv=self.kv_b_proj,
                          latent=self.kv_a_proj)

    @property
    def scale(self) -> float:
        """Softmax scale 1 / sqrt(D + rope_dim): the full query/key width of the naive path;
        times YaRN's mscale(factor, mscale_all_dim)^2 under DeepSeek's YaRN RoPE scaling."""
        factor = self.rope.scaling.softmax_factor if self.rope is not None and self.rope.scaling else 1.0
        return factor / math.sqrt(self.head_dim + self.rope_dim)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, kv_rank={self.kv_rank}, "
                f"q_rank={self.q_rank}, head_dim={self.head_dim}, rope_dim={self.rope_dim}, "
                f"v_head_dim={self.v_head_dim}, causal={self.causal}, latent_norm={self.latent_norm}, "
                f"backend={self.backend!r}"
                + "".join(f", {n}={v}" for n, v in (("sliding_window", self.sliding_window),
                                                      ("softcap", self.softcap)) if v is not None))

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> LatentCache:
        """A static latent cache `(B, max_len, R + rope_dim)`: R + rope_dim values per token."""
        w = self.kv_a_proj.weight
        return LatentCache(batch_size, max_len, self.kv_rank, self.rope_dim,
                           dtype=w.dtype if dtype is None else dtype,
                           device=w.device if device is None else device)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | MaskMod | None = None,
        cache: LatentCache | None = None,
        return_weights: bool | Sequence[int] = False,
        absorb: bool | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
        store: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Self-attention over x `(B, T, d_model)`.

        Args:
            mask: bool (True = may attend) / float tensor broadcastable to `(B, H, T, S)`,
                or a `multihead.masks` predicate; combined with the module's causality.
            cache: a `LatentCache` from `new_cache`: this call's latents are appended and
                every cached token is attended (RoPE positions continue from its length).
            return_weights: True, or a list of head indices, to also get the attention
                weights `(B, h, T, S)` of those heads.
            absorb: True for the absorbed path, False for the naive one, None to pick the
                one with fewer multiply-adds for this T and S (`absorb_is_cheaper`):
                absorbed when decoding over a cache, naive for a long prefill.
            rotary: precomputed `(cos, sin)`, each `(T, rope_dim/2)` or
                `(B|1, 1, T, rope_dim/2)`, for a caller that owns the positions (a Hugging
                Face model: its RoPE scaling, left padding). Default: positions 0..T-1
                after what the cache holds.
            store: a caller's own cache in place of `cache` (the Hugging Face patch keeps
                the latent in transformers' cache): called with this call's latents
                `(B, T, R + rope_dim)`, it returns every latent to attend over
                `(B, S, R + rope_dim)`. The positions are then the caller's: pass `rotary=`.

        Returns:
            `(B, T, d_model)`, or `(out, weights)`.
        """
        self._check_input(x)
        if cache is not None:
            self._check_cache(cache)
        if absorb is not None and not isinstance(absorb, bool):
            raise TypeError(f"absorb must be True, False or None; received {absorb!r}")
        self._check_rotary_and_store(rotary, store, cache)
        B, T, _ = x.shape
        offset = cache.length if cache is not None else 0
        q_nope, q_pe = self.queries(x, offset, rotary=rotary)  # (B, H, T, D), (B, H, T, rope_dim)
        latent = self.latents(x, offset, rotary=rotary)  # (B, T, R + rope_dim)
        if store is not None:
            latent = store(latent)  # (B, S, R + rope_dim)
        if cache is None:
            return self._attend_and_project(q_nope, q_pe, latent, mask, return_weights, absorb)
        with cache.checkpoint(T):  # a call that raises leaves the cache as it was
            latent = cache.update(latent)  # (B, S, R + rope_dim)
            return self._attend_and_project(q_nope, q_pe, latent, mask, return_weights, absorb)

    def _attend_and_project(self, q_nope, q_pe, latent, mask, return_weights, absorb):
        S = latent.shape[1]
        if absorb is None:
            absorb = self.absorb_is_cheaper(q_nope.shape[2], S)
        attend = self.attend_absorbed if absorb else self.attend_naive
        out, weights = attend(q_nope, q_pe, latent, mask, return_weights=return_weights)
        out = self.o_proj(merge_heads(out))  # (B, T, C)
        return out if weights is None else (out, weights)

    def queries(self, x: Tensor, offset: int = 0, *,
                rotary: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Per-head queries of x `(B, T, C)` whose first token sits at `offset`, or rotated
        by given angles `rotary=(cos, sin)`, each `(T, rope_dim/2)` or `(B|1, 1, T, rope_dim/2)`
        (a caller that owns the positions, such as a Hugging Face model with left padding).

        Returns q_nope `(B, H, T, D)` and the rotated q_pe `(B, H, T, rope_dim)`.
        """
        B, T, _ = x.shape
        if self.q_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        W = self.head_dim + self.rope_dim
        q = q.view(B, T, q.shape[-1] // W, W).transpose(1, 2)  # (B, H, T, D + rope_dim)
        q_nope, q_pe = q.split([self.head_dim, self.rope_dim], dim=-1)
        if self.rope is not None:
            q_pe = self.rope(q_pe, offset) if rotary is None else \
                apply_rotary(q_pe, *rotary, interleaved=self.rope.interleaved)
        return q_nope, q_pe

    def latents(self, x: Tensor, offset: int = 0, *, rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """What the cache stores for x `(B, T, C)`: [c_kv ; RoPE(k_pe)] `(B, T, R + rope_dim)`
        (rotated from `offset`, or by given angles `rotary=(cos, sin)` as in `queries`)."""
        c_kv, k_pe = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (B, T, R), (B, T, rope_dim)
        c_kv = self.kv_a_norm(c_kv)
        if self.rope is not None:  # one shared RoPE key "head"
            k_pe = self.rope(k_pe[:, None], offset)[:, 0] if rotary is None else \
                apply_rotary(k_pe[:, None], *rotary, interleaved=self.rope.interleaved)[:, 0]
        return torch.cat([c_kv, k_pe], dim=-1)

    def attend_naive(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor,
                     mask: Tensor | MaskMod | None = None, *,
                     return_weights: bool | Sequence[int] = False) -> tuple[Tensor, Tensor | None]:
        """Decompress K and V of every token in `latent` `(B, S, R + rope_dim)`, then MHA.

        Returns the heads' outputs `(B, H, T, Dv)` (before o_proj) and the weights or None.
        """
        B, S, _ = latent.shape
        D, Dv = self.head_dim, self.v_head_dim
        c_kv, k_pe = latent.split([self.kv_rank, self.rope_dim], dim=-1)  # (B, S, R), (B, S, rope_dim)
        kv = self.kv_b_proj(c_kv)  # (B, S, H * (D + Dv))
        kv = kv.view(B, S, kv.shape[-1] // (D + Dv), D + Dv).transpose(1, 2)  # (B, H, S, D + Dv)
        k_nope, v = kv.split([D, Dv], dim=-1)  # (B, H, S, D), (B, H, S, Dv)
        H = k_nope.shape[1]
        k = torch.cat([k_nope, k_pe[:, None].expand(B, H, S, self.rope_dim)], dim=-1)  # (B, H, S, D + rope_dim)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, H, T, D + rope_dim)
        return self._kernel(q, k, v, mask, return_weights)

    def attend_absorbed(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor,
                        mask: Tensor | MaskMod | None = None, *,
                        return_weights: bool | Sequence[int] = False) -> tuple[Tensor, Tensor | None]:
        """Attend over the latent itself, with W_UK folded into the query and W_UV after.

        q_h . k_h,j = (W_UK_h^T q_nope_h) . c_j + q_pe_h . k_pe_j, so the absorbed query
        `(B, H, T, R + rope_dim)` meets the latent `(B, 1, S, R + rope_dim)` as one shared
        key head, and the value head is c_kv `(B, 1, S, R)`: MQA with head dim
        R + rope_dim. The kernel folds the H query heads into the query length,
        `(B, 1, H*T, R + rope_dim)`, so the latent is read once per step for all heads.
        One new token without mask or weights takes `_one_token` instead. Same outputs
        as `attend_naive`.
        """
        D, Dv, R = self.head_dim, self.v_head_dim, self.kv_rank
        w = self.kv_b_proj.weight.view(-1, D + Dv, R)  # (H, D + Dv, R)
        w_uk, w_uv = w[:, :D], w[:, D:]  # (H, D, R), (H, Dv, R)
        q_lat = q_nope @ w_uk  # (B, H, T, R): W_UK_h^T q_nope_h
        q_abs = torch.cat([q_lat, q_pe], dim=-1)  # (B, H, T, R + rope_dim)
        if q_abs.shape[2] == 1 and mask is None and not return_weights and self.backend == "auto":
            out_lat, weights = self._one_token(q_abs, latent), None  # (B, H, 1, R)
        else:
            kv = latent[:, None]  # (B, 1, S, R + rope_dim)
            out_lat, weights = self._kernel(q_abs, kv, kv[..., :R], mask, return_weights)  # (B, H, T, R)
        out = out_lat @ w_uv.transpose(1, 2)  # (B, H, T, Dv): W_UV_h (sum_j p_j c_j)
        return out, weights

    def _one_token(self, q_abs: Tensor, latent: Tensor) -> Tensor:
        """The decode step: one query per head over the whole latent, as one tall-skinny
        GEMM (`kernels.common.one_query_shared_keys`). On CPU this is about twice as fast
        as torch's fused kernel, whose blocks are tuned for head dims up to 256, not 576
        (benchmarks/decode.py). Causality needs no mask: the one query sits at the last
        position and sees every key; a window keeps the keys the last position sees.
        """
        if self.sliding_window is not None:
            latent = latent[:, -self.sliding_window:]
        return common.one_query_shared_keys(q_abs, latent, self.kv_rank, self.scale, self.softcap)  # (B, H, 1, R)

    def absorb_is_cheaper(self, T: int, S: int) -> bool:
        """Whether the absorbed path needs fewer multiply-adds for T queries over S keys.

        naive:    S * R * H * (D + Dv)  (decompress)  +  H * T * S * (D + rope_dim + Dv)
        absorbed: H * T * R * (D + Dv)  (fold W_UK, apply W_UV)  +  H * T * S * (2R + rope_dim)
        One new token over a long cache: absorbed, by about a factor S; a prefill of T = S
        tokens: naive once T > R (D + Dv) / (2R - D - Dv) (~170 at DeepSeek-V2's sizes).
        """
        H, R, D, Dv, Dr = self.n_heads, self.kv_rank, self.head_dim, self.v_head_dim, self.rope_dim
        naive = S * R * H * (D + Dv) + H * T * S * (D + Dr + Dv)
        absorbed = H * T * R * (D + Dv) + H * T * S * (2 * R + Dr)
        return absorbed < naive

    def _kernel(self, q, k, v, mask, return_weights) -> tuple[Tensor, Tensor | None]:
        mod = None if self.softcap is None else score_mods.softcap(self.softcap)
        return attend(q, k, v, with_window(mask, self.sliding_window, q, k), causal=self.causal, scale=self.scale,
                      return_weights=return_weights, backend=self.backend, score_mod=mod)

    def _check_input(self, x) -> None:
        check_input("x", x, self.d_model, f"d_model = {self.d_model}")
        check_dtype("x", x, self.kv_a_proj.weight)

    def _check_rotary_and_store(self, rotary, store, cache) -> None:
        if store is not None:
            if cache is not None:
                raise ValueError("pass cache= (a LatentCache) or store= (a caller's cache), not both")
            if not callable(store):
                raise TypeError(f"store must be callable(latent (B, T, R + rope_dim)) -> every latent "
                                f"(B, S, R + rope_dim); received {type(store).__name__}")
            if self.rope is not None and rotary is None:
                raise ValueError("store= keeps the caller's cache, so the positions are the caller's too: "
                                 "pass rotary=(cos, sin) for this call's tokens")
        if rotary is not None and self.rope is None:
            raise ValueError("rotary=(cos, sin) was given but this module has no rotary part (rope_dim=0)")

    def _check_cache(self, cache) -> None:
        if not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache from new_cache(); received {type(cache).__name__}")
        if (cache.kv_rank, cache.rope_dim) != (self.kv_rank, self.rope_dim):
            raise ValueError(
                f"cache holds kv_rank={cache.kv_rank}, rope_dim={cache.rope_dim}; this module needs "
                f"kv_rank={self.kv_rank}, rope_dim={self.rope_dim}. Make it with new_cache()"
            )
