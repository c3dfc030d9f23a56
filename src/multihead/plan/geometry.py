"""The shape of a model's attention, and exact accounting for it: parameters, KV cache, FLOPs.

Two small frozen descriptions mirror the library's two attention modules argument for
argument, so that `attention_params(AttentionGeometry(...))` is the parameter count of
`multihead.Attention(...)` with the same arguments, and `kv_cache_bytes` is the
`nbytes` of its cache (tests/test_plan_modules.py checks both):

- `AttentionGeometry`: MHA, GQA, MQA (self or cross attention), like `multihead.Attention`.
- `LatentGeometry`: multi-head latent attention (MLA, DeepSeek-V2, arXiv:2405.04434),
  like `multihead.LatentAttention`; its cache holds the latent (R + rope dims per token
  per layer), not K and V.

`ModelGeometry` adds what a whole model needs (layers, embeddings, FFN or MoE, norms,
sliding windows) for model totals and window-aware caches. Everything is integer
arithmetic; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from multihead.checks import check_fields, check_kv_heads, check_nonnegative_int, check_positive_int, variant_name
from multihead.plan.units import bytes_for

# --- one attention block -----------------------------------------------------------


def _floor_head_dim(d_model: int, n_heads: int) -> int:
    """head_dim's default: d_model // n_heads, floored (the modules' default,
    `layer_parts.default_head_dim`, refuses a remainder; this one does not)."""
    if d_model < n_heads:
        raise ValueError(f"d_model ({d_model}) // n_heads ({n_heads}) is 0; "
                         "give head_dim or use fewer heads")
    return d_model // n_heads


@dataclass(frozen=True)
class AttentionGeometry:
    """MHA / GQA / MQA attention of one layer, with the arguments of `multihead.Attention`.

    Projections (B, T, C) -> (B, T, H*D) for q, (B, S, Cc) -> (B, S, Hkv*D) for k and v,
    (B, T, H*D) -> (B, T, C) for o, where Cc = context_dim or d_model (cross attention).
    `bias` puts a bias on q, k, v and o, like the module; `o_bias` overrides it for o
    alone (Qwen2 has q/k/v biases and no o bias). Like the module, `n_kv_heads` and
    `head_dim` hold the resolved values after construction (None gives n_heads and
    d_model // n_heads).
    """

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    context_dim: int | None = None
    bias: bool = True
    o_bias: bool | None = None

    def __post_init__(self):
        check_positive_int("d_model", self.d_model)
        n_kv_heads = check_kv_heads(self.n_heads, self.n_kv_heads)
        check_positive_int("head_dim", self.head_dim, allow_none=True)
        check_positive_int("context_dim", self.context_dim, allow_none=True)
        object.__setattr__(self, "n_kv_heads", n_kv_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", _floor_head_dim(self.d_model, self.n_heads))

    @property
    def kind(self) -> str:
        """'MHA' (Hkv = H), 'MQA' (Hkv = 1 < H) or 'GQA' (anything between)."""
        return variant_name(self.n_heads, self.n_kv_heads)

    @property
    def label(self) -> str:
        return f"GQA-{self.n_kv_heads}" if self.kind == "GQA" else self.kind

    @property
    def v_head_dim(self) -> int:
        """Dv: value head dim (= D for this module; LatentAttention's may differ)."""
        return self.head_dim

    @property
    def has_o_bias(self) -> bool:
        return self.bias if self.o_bias is None else self.o_bias

    @property
    def kv_elements_per_token(self) -> int:
        """Cached values per token in one layer: K and V, Hkv heads of D each."""
        return 2 * self.n_kv_heads * self.head_dim

    @property
    def weights(self) -> int:
        """Projection weights (no biases): what each token multiplies through."""
        h, hkv, d, c = self.n_heads, self.n_kv_heads, self.head_dim, self.d_model
        cc = self.context_dim or c
        return c * h * d + 2 * cc * hkv * d + h * d * c

    @property
    def params(self) -> int:
        h, hkv, d, c = self.n_heads, self.n_kv_heads, self.head_dim, self.d_model
        biases = (h * d + 2 * hkv * d) * self.bias + c * self.has_o_bias
        return self.weights + biases

    def score_flops(self, keys: int, *, decompressed: bool = False) -> int:
        """FLOPs of q.k and p.v for one query over `keys` keys (2 per multiply-add)."""
        return 2 * self.n_heads * keys * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class LatentGeometry:
    """Multi-head latent attention of one layer, with the arguments of `LatentAttention`.

    DeepSeek-V2 layout, no biases. Keys are compressed into a rank-R latent c (B, S, R)
    plus one shared RoPE key (B, S, rope_dim); per head, K = [W_uk c ; k_rope] and
    V = W_uv c. `head_dim` is the no-RoPE part of the query/key head (qk_nope_head_dim),
    so a query/key head is head_dim + rope_dim wide and a value head is v_head_dim.
    q_rank None means queries are projected directly (DeepSeek-V2-Lite). `latent_norm`
    is the RMSNorm on the kv latent (R weights); `bias` puts biases on the projections
    that read the model width (q or q_a, kv_a) and on o, as the module does. Like the
    module, `head_dim` and `v_head_dim` hold the resolved values after construction.
    """

    d_model: int
    n_heads: int
    kv_rank: int
    q_rank: int | None = None
    head_dim: int | None = None
    rope_dim: int = 0
    v_head_dim: int | None = None
    latent_norm: bool = True
    bias: bool = False

    def __post_init__(self):
        check_fields(self, "d_model", "n_heads", "kv_rank", minimum=1)
        check_fields(self, "q_rank", "head_dim", minimum=1, allow_none=True)
        check_fields(self, "rope_dim", minimum=0)
        check_fields(self, "v_head_dim", minimum=1, allow_none=True)
        if self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even (RoPE rotates pairs of features); "
                             f"received {self.rope_dim}")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", _floor_head_dim(self.d_model, self.n_heads))
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    kind = "MLA"

    @property
    def label(self) -> str:
        return f"MLA-{self.kv_rank}"

    @property
    def d_qk(self) -> int:
        """Full query/key head dim: no-RoPE part + RoPE part."""
        return self.head_dim + self.rope_dim

    @property
    def kv_elements_per_token(self) -> int:
        """The latent cache: R + rope_dim values per token per layer, shared by all heads."""
        return self.kv_rank + self.rope_dim

    @property
    def decompressed_kv_elements_per_token(self) -> int:
        """What a cache of decompressed K and V would hold: H*(D + rope) + H*Dv."""
        return self.n_heads * (self.d_qk + self.v_head_dim)

    @property
    def weights(self) -> int:
        h, c, r = self.n_heads, self.d_model, self.kv_rank
        q_out = h * self.d_qk
        q = c * q_out if self.q_rank is None else c * self.q_rank + self.q_rank * q_out
        kv_a = c * (r + self.rope_dim)
        kv_b = r * h * (self.head_dim + self.v_head_dim)
        o = h * self.v_head_dim * c
        return q + kv_a + kv_b + o

    @property
    def params(self) -> int:
        # The RMSNorms on the q latent (q_rank) and on the kv latent (R) carry weights.
        norms = (self.q_rank or 0) + self.kv_rank * self.latent_norm
        q_out = self.q_rank if self.q_rank is not None else self.n_heads * self.d_qk
        biases = (q_out + self.kv_rank + self.rope_dim + self.d_model) * self.bias
        return self.weights + norms + biases

    def score_flops(self, keys: int, *, decompressed: bool = False) -> int:
        """FLOPs of the scores and the weighted sum for one query over `keys` keys.

        Decompressed (naive) path: per head q.k over D + rope dims and p.v over Dv.
        Absorbed path (decoding from the latent cache): W_uk is folded into the query and
        W_uv into the output, so per head the scores run over R + rope dims and the
        weighted sum over R: more FLOPs, far fewer bytes.
        """
        if decompressed:
            return 2 * self.n_heads * keys * (self.d_qk + self.v_head_dim)
        return 2 * self.n_heads * keys * (2 * self.kv_rank + self.rope_dim)


Geometry = AttentionGeometry | LatentGeometry


def attention_params(geometry: Geometry) -> int:
    """Parameters of one attention block: the module's `sum(p.numel())`."""
    return geometry.params


def kv_cache_bytes(
    geometry: Geometry, tokens: int, batch: int = 1, dtype="bf16", *, decompressed: bool = False
) -> int:
    """Bytes of one layer's cache for `batch` sequences of `tokens` tokens.

    Equals `module.new_cache(batch, tokens, dtype=...).nbytes`: 2*B*Hkv*T*D*itemsize for
    MHA/GQA/MQA, B*T*(R + rope)*itemsize for MLA's latent cache. `decompressed=True`
    gives what an MLA implementation that caches K and V would need instead.
    """
    check_nonnegative_int("tokens", tokens)
    check_positive_int("batch", batch)
    per_token = geometry.kv_elements_per_token
    if decompressed:
        # ValueError: the geometry is a valid argument; the option is what does not apply to it
        if not isinstance(geometry, LatentGeometry):
            raise ValueError(f"decompressed=True applies to MLA only; received a "
                             f"{geometry.kind} geometry")
        per_token = geometry.decompressed_kv_elements_per_token
    return bytes_for(batch * tokens * per_token, dtype)


# --- a whole model -----------------------------------------------------------------


@dataclass(frozen=True)
class FeedForward:
    """The MLP of a layer: gated (SwiGLU/GeGLU: gate, up, down) or not (up, down)."""

    d_ff: int
    gated: bool = True
    bias: bool = False

    def __post_init__(self):
        check_positive_int("d_ff", self.d_ff)

    def params(self, d_model: int) -> int:
        mats = 3 if self.gated else 2
        biases = (self.d_ff * (mats - 1) + d_model) if self.bias else 0
        return mats * d_model * self.d_ff + biases


@dataclass(frozen=True)
class MixtureOfExperts:
    """A mixture-of-experts FFN: routed experts (top_k of n_experts per token) + shared ones.

    MoE replaces the FFN in layer i when i >= `first_dense`, (i + `freq_offset`) is a
    multiple of `layer_freq` and i is not in `dense_layers`; the other layers keep the
    model's dense `ffn`. DeepSeek: first_k_dense_replace and moe_layer_freq (offset 0);
    Qwen2/3-MoE: decoder_sparse_step counts from layer 1 (offset 1) and mlp_only_layers
    lists dense layers. Shared experts always run: DeepSeek fuses its n_shared experts
    into one MLP of n_shared * d_expert (the same parameter count); Qwen2-MoE has one
    shared MLP of width `d_shared` behind a sigmoid gate, a Linear(C, 1) (`shared_gate`).
    `expert_bias` puts biases on the experts' projections (gpt-oss). `router_bias` adds
    n_experts parameters to the router: DeepSeek-V3's score correction, or the bias of
    gpt-oss's router Linear.
    """

    n_experts: int
    top_k: int
    d_expert: int
    n_shared: int = 0
    first_dense: int = 0
    layer_freq: int = 1
    router_bias: bool = False
    d_shared: int | None = None
    shared_gate: bool = False
    expert_bias: bool = False
    freq_offset: int = 0
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        check_fields(self, "n_experts", "top_k", "d_expert", minimum=1)
        check_fields(self, "n_shared", "first_dense", minimum=0)
        check_fields(self, "layer_freq", minimum=1)
        check_fields(self, "d_shared", minimum=1, allow_none=True)
        check_fields(self, "freq_offset", minimum=0)
        for i in self.dense_layers:
            check_nonnegative_int("dense_layers[...]", i)
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")

    def is_moe_layer(self, i: int) -> bool:
        return (i >= self.first_dense and (i + self.freq_offset) % self.layer_freq == 0
                and i not in self.dense_layers)

    def count_moe_layers(self, n_layers: int) -> int:
        """How many of layers 0 .. n_layers-1 are MoE, in closed form (a config may say
        2**40 layers; counting them one by one would never finish)."""
        lo = min(self.first_dense, n_layers)
        f, off = self.layer_freq, self.freq_offset
        # i in [lo, n_layers) with (i + off) % f == 0: multiples of f in [lo+off, n_layers+off)
        count = -(-(n_layers + off) // f) - -(-(lo + off) // f)
        return count - sum(1 for i in set(self.dense_layers)
                           if lo <= i < n_layers and (i + off) % f == 0)

    def expert_params(self, d_model: int) -> int:
        return FeedForward(self.d_expert, bias=self.expert_bias).params(d_model)

    def shared_params(self, d_model: int) -> int:
        """The always-on part: shared experts (or the one shared MLP) and its gate."""
        if self.d_shared is not None:
            shared = self.n_shared * FeedForward(self.d_shared, bias=self.expert_bias).params(d_model)
        else:
            shared = self.n_shared * self.expert_params(d_model)
        return shared + d_model * self.shared_gate

    def router_params(self, d_model: int) -> int:
        return self.n_experts * d_model + self.n_experts * self.router_bias

    def params(self, d_model: int) -> int:
        return (self.n_experts * self.expert_params(d_model) + self.shared_params(d_model)
                + self.router_params(d_model))

    def active_params(self, d_model: int, tokens: int = 1) -> float:
        """Expert weights one step touches for `tokens` tokens, uniform routing assumed:
        each expert is picked by a token with p = top_k / n_experts, so the expected number
        of distinct routed experts is n_experts * (1 - (1 - p)**tokens)."""
        p = self.top_k / self.n_experts
        routed = self.n_experts * (1 - (1 - p) ** tokens)
        return (routed * self.expert_params(d_model) + self.shared_params(d_model)
                + self.router_params(d_model))


NORMS = {"rmsnorm": 1, "layernorm": 2}  # parameters per channel: weight (+ bias)


@dataclass(frozen=True)
class ModelGeometry:
    """A transformer's shape, enough to count its parameters and size its cache exactly.

    `norms_per_layer` counts the norms inside a block (2 pre-norm, 4 for Gemma-2's
    sandwich, 1 for Falcon-7B's parallel block). `max_positions`/`token_types` are learned
    tables (GPT-2, BERT); rotary and ALiBi have no parameters. `window` is a sliding
    window on `window_layers` layers (None = all layers when a window is set); the
    others attend globally. `causal=False` is an encoder: no KV cache, no decoding.
    Two extras live inside the attention block and are counted in its parameters per
    layer, as `layer.self_attn.parameters()` counts them: `qk_norm`, an RMSNorm of D on
    the queries and one on the keys (Qwen3, Gemma-3), and `sinks`, one learned
    attention-sink logit per query head (gpt-oss). Neither changes the KV cache.
    """

    attention: Geometry
    n_layers: int
    vocab_size: int
    ffn: FeedForward
    moe: MixtureOfExperts | None = None
    tied_embeddings: bool = True
    lm_head: bool = True
    norm: str = "rmsnorm"
    norms_per_layer: int = 2
    final_norm: bool = True
    max_positions: int = 0
    token_types: int = 0
    embedding_norm: bool = False
    pooler: bool = False
    causal: bool = True
    window: int | None = None
    window_layers: int | None = None
    qk_norm: bool = False
    sinks: bool = False
    context_length: int | None = None
    name: str = "model"
    family: str = "custom"
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        check_fields(self, "n_layers", "vocab_size", minimum=1)
        check_fields(self, "norms_per_layer", "max_positions", "token_types", minimum=0)
        check_fields(self, "window", minimum=1, allow_none=True)
        check_fields(self, "window_layers", minimum=0, allow_none=True)
        check_fields(self, "context_length", minimum=1, allow_none=True)
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}; received {self.norm!r}")
        if self.window_layers is not None and self.window_layers > self.n_layers:
            raise ValueError(f"window_layers ({self.window_layers}) must be <= n_layers "
                             f"({self.n_layers})")

    @property
    def d_model(self) -> int:
        return self.attention.d_model

    @property
    def n_window_layers(self) -> int:
        if self.window is None:
            return 0
        return self.n_layers if self.window_layers is None else self.window_layers

    @property
    def n_global_layers(self) -> int:
        return self.n_layers - self.n_window_layers

    @property
    def n_moe_layers(self) -> int:
        if self.moe is None:
            return 0
        return self.moe.count_moe_layers(self.n_layers)


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters by part; `total` is their sum (what `model.parameters()` gives)."""

    embedding: int
    attention_per_layer: int
    attention: int
    ffn: int
    norms: int
    head: int
    pooler: int
    total: int
    active: int  # per token: MoE counts top_k + shared experts only

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def param_counts(model: ModelGeometry) -> ParamCounts:
    c, L = model.d_model, model.n_layers
    embedding = (model.vocab_size + model.max_positions + model.token_types) * c
    embedding += NORMS[model.norm] * c * model.embedding_norm
    a = model.attention
    attn_layer = a.params + 2 * a.head_dim * model.qk_norm + a.n_heads * model.sinks
    dense_layers = L - model.n_moe_layers
    ffn = dense_layers * model.ffn.params(c)
    active_ffn = ffn
    if model.moe is not None:
        ffn += model.n_moe_layers * model.moe.params(c)
        active_ffn += model.n_moe_layers * round(model.moe.active_params(c, tokens=1))
    norms = NORMS[model.norm] * c * (L * model.norms_per_layer + model.final_norm)
    head = model.vocab_size * c if model.lm_head and not model.tied_embeddings else 0
    pooler = (c * c + c) if model.pooler else 0
    total = embedding + L * attn_layer + ffn + norms + head + pooler
    active = total - ffn + active_ffn
    return ParamCounts(embedding, attn_layer, L * attn_layer, ffn, norms, head, pooler, total,
                       active)


def model_params(model: ModelGeometry) -> int:
    return param_counts(model).total


def _cached_tokens(model: ModelGeometry, context: int) -> int:
    """Token-layers the cache holds at `context`: windowed layers keep only the window."""
    w = model.window or 0
    return model.n_global_layers * context + model.n_window_layers * min(context, w)


def kv_bytes_per_token(model: ModelGeometry, dtype="bf16", *, decompressed: bool = False) -> int:
    """Cache bytes one more token adds, all layers (before any sliding window is full)."""
    if not model.causal:
        return 0
    return model.n_layers * kv_cache_bytes(model.attention, 1, 1, dtype,
                                           decompressed=decompressed)


def model_kv_cache_bytes(model: ModelGeometry, context: int, batch: int = 1, dtype="bf16", *,
                         decompressed: bool = False) -> int:
    """Whole-model cache for `batch` sequences at `context` tokens, window-aware.

    A layer with a sliding window W needs only min(context, W) tokens (a rolling
    buffer); global layers need all of them. Encoders (causal=False) cache nothing.
    """
    check_positive_int("context", context)
    check_positive_int("batch", batch)
    if not model.causal:
        return 0
    return kv_cache_bytes(model.attention, _cached_tokens(model, context), batch, dtype,
                          decompressed=decompressed)


@dataclass(frozen=True)
class AttentionFlops:
    """Attention FLOPs (2 per multiply-add) at a context length, summed over layers.

    prefill_total: the whole prompt of `context` tokens (causal, window-aware).
    decode_per_token: one new token with `context` tokens in the cache (itself included);
    None for encoders. For MLA decode uses the absorbed path that the latent cache
    implies; decode_decompressed_per_token is the naive path, for comparison.
    """

    context: int
    projections_per_token: int
    prefill_total: int
    decode_per_token: int | None
    decode_decompressed_per_token: int | None = None

    @property
    def prefill_per_token(self) -> float:
        return self.prefill_total / self.context

    def as_dict(self) -> dict:
        return {
            "context": self.context,
            "projections_per_token": self.projections_per_token,
            "prefill_total": self.prefill_total,
            "prefill_per_token": self.prefill_per_token,
            "decode_per_token": self.decode_per_token,
            "decode_decompressed_per_token": self.decode_decompressed_per_token,
        }


def _sum_keys(context: int, window: int | None, causal: bool) -> int:
    """Keys summed over the `context` queries of a prompt: sum_i min(i, W) when causal."""
    if not causal:
        return context * context
    if window is None or context <= window:
        return context * (context + 1) // 2
    return window * (window + 1) // 2 + (context - window) * window


def attention_flops(model: ModelGeometry, context: int) -> AttentionFlops:
    check_positive_int("context", context)
    a = model.attention
    proj = 2 * a.weights
    layers = [(model.n_global_layers, None), (model.n_window_layers, model.window)]
    is_mla = isinstance(a, LatentGeometry)
    prefill = model.n_layers * proj * context
    decode = decode_naive = 0
    for n, w in layers:
        if n == 0:
            continue
        # The prompt is processed decompressed (it is compute-bound); decoding reads the cache.
        prefill += n * a.score_flops(_sum_keys(context, w, model.causal), decompressed=True)
        keys = context if w is None else min(context, w)
        decode += n * (proj + a.score_flops(keys))
        decode_naive += n * (proj + a.score_flops(keys, decompressed=True))
    return AttentionFlops(
        context=context,
        projections_per_token=model.n_layers * proj,
        prefill_total=prefill,
        decode_per_token=decode if model.causal else None,
        decode_decompressed_per_token=decode_naive if (model.causal and is_mla) else None,
    )


def describe(model: ModelGeometry) -> str:
    """One line: 'GQA-8, 32 heads of 128, 8 KV heads, d_model 4096, 32 layers'."""
    a = model.attention
    if isinstance(a, LatentGeometry):
        head = (f"{a.n_heads} heads of {a.head_dim}+{a.rope_dim} (v {a.v_head_dim}), "
                f"kv_rank {a.kv_rank}" + (f", q_rank {a.q_rank}" if a.q_rank else ""))
    else:
        head = f"{a.n_heads} heads of {a.head_dim}, {a.n_kv_heads} KV head{'s' * (a.n_kv_heads > 1)}"
    text = f"{a.label}, {head}, d_model {a.d_model}, {model.n_layers} layers"
    if model.window is not None:
        text += f", window {model.window} on {model.n_window_layers}/{model.n_layers} layers"
    return text


__all__ = [
    "AttentionGeometry", "LatentGeometry", "Geometry", "FeedForward", "MixtureOfExperts",
    "ModelGeometry", "ParamCounts", "AttentionFlops", "attention_params", "kv_cache_bytes",
    "param_counts", "model_params", "kv_bytes_per_token", "model_kv_cache_bytes",
    "attention_flops", "describe",
]
