"""A transformers decoder's weights laid out for the edge graph: per-head projections, norms, MLPs.

The circuits tools run their own forward of the model's weights (`_edge_run`), in which
every receiver applies its norm and its projection to its own copy of the residual
stream; this module lays out what that forward needs. Llama-like and GPT-2 layouts, and
multihead's own `LabTransformer` (MHA, GQA, MQA, MLA; with or without MLPs); models with a
parallel residual, and OLMo 2, are refused by name.

Details: docs/heads-circuits-auto.md, "What the edge forward needs of a model, and the architectures".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from multihead.attention import Attention
from multihead.decoder import LabTransformer
from multihead.heads.edge_graph import Graph
from multihead.latent import LatentAttention

PARALLEL = {"gptj": "GPT-J", "phi": "Phi", "falcon": "Falcon", "cohere": "Cohere", "gpt_neox": "GPT-NeoX",
            "codegen": "CodeGen", "phi3": None}
REFUSED_POST_NORM = {"olmo2": "OLMo 2", "olmo3": "OLMo 3"}
GEMMA = {"gemma2", "gemma3", "gemma3_text"}
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "granite", "smollm3"}


@dataclass
class Block:
    """One decoder layer: its input norm, per-head projections (or, for latent attention, `project`), MLP norm
    and MLP (None in an attention-only layer)."""

    ln1: Callable
    wq: Tensor | None  # (H, D, C) (None: `project` computes the queries, keys and values)
    bq: Tensor | None  # (H, D)
    wk: Tensor | None  # (Hkv, D, C)
    bk: Tensor | None
    wv: Tensor | None  # (Hkv, Dv, C)
    bv: Tensor | None
    wo: Tensor  # (H, C, Dv): each head's slice of the output projection
    bo: Tensor | None  # (C,)
    q_norm: Callable | None
    k_norm: Callable | None
    scaling: float
    window: int | None
    ln2: Callable | None  # None with mlp: an attention-only layer
    mlp: Callable | None  # the MLP's output as the residual receives it (Gemma: after its post-feedforward norm)
    post_norm: PostNorm | None = None  # Gemma: the norm after the attention
    softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before the mask
    rope_type: str | None = None  # Gemma 3: the RoPE of this layer's type (local or global frequencies)
    rotate: Callable | None = None  # (q, k) (B, H|Hkv, T, D) -> rotated, where the layer owns its RoPE (multihead's)
    # latent attention (multihead's MLA): the normed copies of the q, k and v receivers (H, B, T, C) each -> q, k, v
    # (B, H, T, D + rope), (B, H, T, D + rope), (B, H, T, Dv); a key/value receiver per query head
    project: Callable | None = None

    @property
    def n_heads(self) -> int:
        return self.wo.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads if self.wk is None else self.wk.shape[0]


class PostNorm:
    """Gemma's norm after the attention, split over the heads: head h's share of the block's output is
    `(1 + w) * o_h / rms(sum_h' o_h')`, in float32 at least and cast back as Gemma's RMSNorm does, so the
    shares sum to what the norm returns (to rounding); the rms is that of this same run's sum."""

    def __init__(self, norm):
        self.weight, self.eps = norm.weight.detach(), float(norm.eps)

    def __call__(self, heads: Tensor) -> Tensor:
        """Each head's share `(H, B, T, C)` from each head's output through its slice of o_proj `(H, B, T, C)`."""
        dt = torch.promote_types(heads.dtype, torch.float32)
        total = heads.sum(0).to(dt)  # (B, T, C): what o_proj returns
        scale = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.to(dt))
        return (heads.to(dt) * scale).to(heads.dtype)


@dataclass
class EdgeModel:
    """What the edge forward reads of a model; `EdgeModel.of(model)` builds it."""

    kind: str
    blocks: list[Block]
    embed: Callable  # (ids (B, T), positions (T,)) -> (B, T, C)
    rotary: Callable | None  # (x, position_ids (1, T)) -> (cos, sin) (1, T, D)
    final_norm: Callable
    unembed: Tensor  # (V, C)
    unembed_bias: Tensor | None
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    max_positions: int | None = None  # GPT-2, multihead's decoder: the longest input (None: RoPE, any length)
    modules: list = field(default_factory=list)  # modules it calls besides the norms and MLPs (hooks allowed)

    @property
    def graph(self) -> Graph:
        b = self.blocks[0]
        return Graph(len(self.blocks), b.n_heads, b.n_kv_heads, mlp=b.mlp is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self.unembed.dtype

    @property
    def device(self) -> torch.device:
        return self.unembed.device

    @classmethod
    def of(cls, model) -> EdgeModel:
        """The layout of a transformers causal LM or a LabTransformer; ValueError naming what is refused and why."""
        try:
            import transformers
        except ImportError:  # pragma: no cover - transformers is a dependency of the head tools
            transformers = None
        # the edge forward reads the weights and calls the norms and MLPs, never the model's forward:
        # torch.compile(model) changes nothing it reads
        model = getattr(model, "_orig_mod", model)
        if isinstance(model, LabTransformer):
            em = _lab(model)
            _check_hooks(model, em)
            return em
        if transformers is None or not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"the edge graph is built for transformers decoder LMs (Llama, Mistral, Qwen2, Qwen3, "
                            f"Gemma 2 and 3, GPT-2) and multihead's LabTransformer; received {type(model).__name__}")
        cfg = model.config
        kind = getattr(cfg, "model_type", "")
        name = type(model).__name__
        if kind in PARALLEL or getattr(cfg, "use_parallel_residual", False) or getattr(cfg, "parallel_attn", False):
            raise ValueError(f"{name} ({kind}) runs attention and MLP in parallel on one input: the edge graph "
                             "(a head of layer l reaching that layer's MLP) does not exist there")
        if kind in REFUSED_POST_NORM:
            raise ValueError(f"{name} ({kind}) has no norm before its attention and normalizes its queries and keys "
                             "over all heads at once: its receivers have no per-head input, so the edge graph is not "
                             "defined there; supported post-norm models: Gemma 2 and 3")
        head = model.get_output_embeddings()
        if not isinstance(getattr(head, "weight", None), Tensor):
            raise TypeError(f"{name} has no LM head (get_output_embeddings() is {type(head).__name__}): the edge "
                            "graph ends at the logits; give the causal LM (e.g. LlamaForCausalLM, not LlamaModel "
                            "or a sequence classifier)")
        if kind in GEMMA:
            em = _gemma(model, kind)
        elif kind == "gpt2":
            em = _gpt2(model)
        elif kind in LLAMA_LIKE or _llama_layout(model):
            em = _llama(model, kind)
        else:
            raise ValueError(f"{name} ({kind!r}) has a layout the edge graph does not know; supported: Llama, "
                             "Mistral, Qwen2, Qwen3 (model.layers with self_attn.q/k/v/o_proj) and GPT-2")
        if not em.blocks:
            raise ValueError(f"{name} has no layers: the edge graph has no head to score")
        H, Hkv = em.blocks[0].n_heads, em.blocks[0].n_kv_heads
        if H % Hkv:
            raise ValueError(f"{name} has {H} query heads and {Hkv} key/value heads: the query heads must be a "
                             "multiple of the key/value heads (config.num_key_value_heads)")
        _check_hooks(model, em)
        return em


def _check_hooks(model, em: EdgeModel) -> None:
    """Refuse forward hooks on modules the edge forward never calls (the attention and its projections, the
    layers, the model itself): they would change the model's own output and not the edge tools'. The norms,
    MLPs, embeddings and rotary embeddings it calls keep theirs."""
    runs = [em.final_norm] + em.modules + [f for b in em.blocks for f in (b.ln1, b.ln2, b.mlp, b.q_norm, b.k_norm)]
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    runs += [getattr(inner, part, None) for part in ("embed_tokens", "rotary_emb", "wte", "wpe")]
    for layer in getattr(inner, "layers", None) or []:  # Gemma: its MLP sender is a lambda over these two
        runs += [getattr(layer, "mlp", None), getattr(layer, "post_feedforward_layernorm", None)]
    called = {id(m) for f in runs for m in _modules_of(f)}
    for name, m in model.named_modules():
        hooks = [h for d in (m._forward_hooks, m._forward_pre_hooks) for h in d.values() if not _records_only(h)]
        if id(m) not in called and hooks:
            raise ValueError(f"{type(model).__name__} has a forward hook on {name or 'the model'} "
                             f"({type(m).__name__}); the edge tools read that module's weights without calling it, "
                             "so the hook would change the model's output and not theirs: remove it first")


def _records_only(hook) -> bool:
    """transformers' own output-capturing hook (installed on the decoder layers and attention
    modules the first time a forward asks for hidden states or attentions): it records what
    it is asked for and never changes an output."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def _modules_of(f) -> list:
    """The modules a callable runs: a module and its submodules (a lambda over a module: none known)."""
    return list(f.modules()) if isinstance(f, nn.Module) else []


def _llama_layout(model) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return False
    a = getattr(layers[0], "self_attn", None)
    return all(isinstance(getattr(a, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and \
        hasattr(layers[0], "input_layernorm") and hasattr(layers[0], "post_attention_layernorm")


def _heads(lin: nn.Linear, n: int) -> tuple[Tensor, Tensor | None]:
    """nn.Linear (n*D, C) -> weight (n, D, C), bias (n, D)."""
    w = lin.weight.detach()
    b = None if lin.bias is None else lin.bias.detach().view(n, -1)
    return w.view(n, -1, w.shape[-1]), b


def _out_heads(w_out_in: Tensor, n: int) -> Tensor:
    """(C, H*Dv) -> (H, C, Dv)."""
    C = w_out_in.shape[0]
    return w_out_in.view(C, n, -1).permute(1, 0, 2)


def _llama(model, kind: str) -> EdgeModel:
    cfg, inner = model.config, model.model
    blocks = []
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn
        if not all(isinstance(getattr(a, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError(f"{type(model).__name__}: layer {i}'s attention ({type(a).__name__}) has no q_proj, "
                             "k_proj, v_proj and o_proj Linear layers (a convert.to_mla model's latent attention has "
                             "none): the edge graph's receivers are each head's query, key and value inputs; valid: "
                             "a model with them, e.g. the model before to_mla")
        H, Hkv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        wq, bq = _heads(a.q_proj, H)
        wk, bk = _heads(a.k_proj, Hkv)
        wv, bv = _heads(a.v_proj, Hkv)
        wo = _out_heads(a.o_proj.weight.detach(), H)
        bo = None if a.o_proj.bias is None else a.o_proj.bias.detach()
        # Mistral's window is the config's, for every layer; Qwen2 sets it per layer type on the module
        window = cfg.sliding_window if kind == "mistral" else getattr(a, "sliding_window", None)
        blocks.append(Block(layer.input_layernorm, wq, bq, wk, bk, wv, bv, wo, bo, getattr(a, "q_norm", None),
                            getattr(a, "k_norm", None), float(getattr(a, "scaling", wq.shape[1] ** -0.5)),
                            int(window) if window else None, layer.post_attention_layernorm, layer.mlp))
    emb, rotary = inner.embed_tokens, inner.rotary_emb
    head = model.get_output_embeddings()
    return EdgeModel(kind, blocks, lambda ids, pos: emb(ids), lambda x, p, t: rotary(x, p), inner.norm,
                     head.weight.detach(), None if getattr(head, "bias", None) is None else head.bias.detach())


def _gemma(model, kind: str) -> EdgeModel:
    """Gemma 2 / 3: the Llama layout with a norm after the attention and after the MLP, the embedding scaled
    by sqrt(C) in its module ("input" is the scaled embedding), Gemma 2's softcaps, Gemma 3's RoPE per layer type."""
    cfg = model.config
    name = type(model).__name__
    inner = getattr(model, "model", None)
    if not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise ValueError(f"{name} ({kind}) is not a causal LM with model.layers (for Gemma 3 with vision, load "
                         "Gemma3ForCausalLM on its text weights)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{name} has use_bidirectional_attention=True: its queries read later positions, so a head "
                         "of layer l would send to positions before it; the edge forward is causal only")
    base = _llama(model, kind)
    blocks = []
    for layer, block in zip(inner.layers, base.blocks):
        a = layer.self_attn
        if a.o_proj.bias is not None:
            raise ValueError(f"{name} has attention_bias=True: the output projection's bias sits inside the norm after "
                             "the attention, so it is no constant of the residual stream; the edge graph refuses it")
        mlp, post = layer.mlp, layer.post_feedforward_layernorm
        block.ln2, block.mlp = layer.pre_feedforward_layernorm, (lambda x, mlp=mlp, post=post: post(mlp(x)))
        block.post_norm = PostNorm(layer.post_attention_layernorm)
        # Gemma 3's attention hands no softcap to its kernel (the config's value is unused); Gemma 2's does
        block.softcap = getattr(a, "attn_logit_softcapping", None) if kind == "gemma2" else None
        block.rope_type = getattr(a, "layer_type", None) if kind != "gemma2" else None
        blocks.append(block)
    rotary = inner.rotary_emb
    rope = (lambda x, p, t: rotary(x, p)) if kind == "gemma2" else (lambda x, p, t: rotary(x, p, t))
    return EdgeModel(kind, blocks, base.embed, rope, inner.norm, base.unembed, base.unembed_bias,
                     getattr(cfg, "final_logit_softcapping", None))


def _gpt2(model) -> EdgeModel:
    cfg, tr = model.config, model.transformer
    H = cfg.n_head
    if getattr(cfg, "reorder_and_upcast_attn", False):
        raise ValueError("GPT-2 with reorder_and_upcast_attn=True computes its scores in float32 apart; the edge "
                         "forward does not reproduce it")
    blocks = []
    for i, layer in enumerate(tr.h):
        a = layer.attn
        w = a.c_attn.weight.detach().t()  # Conv1D stores (in, out): (3C, C) as (out, in)
        b = a.c_attn.bias.detach()
        C = w.shape[1]
        wq, wk, wv = (w[j * C:(j + 1) * C].reshape(H, -1, C) for j in range(3))
        bq, bk, bv = (b[j * C:(j + 1) * C].reshape(H, -1) for j in range(3))
        wo = _out_heads(a.c_proj.weight.detach().t(), H)
        D = wq.shape[1]
        scaling = (D ** -0.5 if cfg.scale_attn_weights else 1.0) / (
            float(i + 1) if cfg.scale_attn_by_inverse_layer_idx else 1.0)
        blocks.append(Block(layer.ln_1, wq, bq, wk, bk, wv, bv, wo, a.c_proj.bias.detach(), None, None, scaling,
                            None, layer.ln_2, layer.mlp))
    head = model.get_output_embeddings()

    def embed(ids, pos):  # the token and the learned position embedding: one sender, "input"
        return tr.wte(ids) + tr.wpe(pos)[None]
    return EdgeModel("gpt2", blocks, embed, None, tr.ln_f, head.weight.detach(),
                     None if getattr(head, "bias", None) is None else head.bias.detach(),
                     max_positions=tr.wpe.num_embeddings)


def _lab(model: LabTransformer) -> EdgeModel:
    """multihead's own decoder: token (+ learned position) embedding, pre-norm blocks of a multihead
    `Attention` or `LatentAttention` and an MLP (none in an attention-only model), the final norm and the
    LM head. Each layer's RoPE is its module's own, applied to the heads' queries and keys as its forward
    does."""
    blocks, modules = [], [model.tok_emb, model.pos_emb]
    for i, layer in enumerate(model.blocks):
        a = layer.attn
        if isinstance(a, LatentAttention):
            if not a.causal:
                raise ValueError(f"LabTransformer layer {i}'s latent attention is not causal: the edge forward "
                                 "runs causal self-attention only")
            blocks.append(_latent_block(a, layer))
            modules += [getattr(a, "q_a_proj", None), getattr(a, "q_a_norm", None), a.kv_a_proj, a.kv_a_norm, a.rope]
            continue
        if not isinstance(a, Attention):
            raise ValueError(f"LabTransformer layer {i}'s attention is {type(a).__name__}; the edge graph knows "
                             "multihead's Attention (MHA, GQA, MQA) and LatentAttention (MLA)")
        if not a.causal or a.alibi or a.context_dim != a.d_model:
            why = "is not causal" if not a.causal else "adds ALiBi" if a.alibi else "is cross-attention"
            raise ValueError(f"LabTransformer layer {i}'s attention {why}: the edge forward runs causal "
                             "self-attention with RoPE, a sliding window or a softcap only")
        D = a.head_dim
        H, Hkv = a.o_proj.in_features // D, a.k_proj.out_features // D  # a pruned module's narrowed counts
        wq, bq = _heads(a.q_proj, H)
        wk, bk = _heads(a.k_proj, Hkv)
        wv, bv = _heads(a.v_proj, Hkv)
        wo = _out_heads(a.o_proj.weight.detach(), H)
        bo = None if a.o_proj.bias is None else a.o_proj.bias.detach()
        rotate = None if a.rope is None else (lambda q, k, rope=a.rope: (rope(q), rope(k)))
        modules.append(a.rope)
        blocks.append(Block(layer.norm1, wq, bq, wk, bk, wv, bv, wo, bo, None, None, D ** -0.5, a.sliding_window,
                            layer.norm2, layer.mlp, softcap=a.softcap, rotate=rotate))
    tok, pos = model.tok_emb, model.pos_emb

    def embed(ids, positions):  # the token and (learned positions) the position embedding: one sender, "input"
        return tok(ids) if pos is None else tok(ids) + pos(positions)[None]
    head = model.lm_head
    return EdgeModel("lab", blocks, embed, None, model.norm_f, head.weight.detach(),
                     None if head.bias is None else head.bias.detach(), max_positions=model.cfg.max_len,
                     modules=[m for m in modules if m is not None])  # the modules it calls: hooks allowed


def _latent_block(a: LatentAttention, layer) -> Block:
    """Latent attention (MLA): each query head's query, key and value receivers, a key/value receiver per
    head (every head's key and value come from one shared latent, which each of them computes from its own
    copy of the residual: patching an edge into head h's key changes head h's key only). A query receiver
    runs the query projection (through MLA's query latent where it has one) and takes its head's slice; a key
    receiver computes the latent and the decoupled RoPE key from its copy and takes its head's key from the
    up-projection, a value receiver the latent and its head's value."""
    H, D, Dv, R, r = a.n_heads, a.head_dim, a.v_head_dim, a.kv_rank, a.rope_dim
    if a.q_rank is None:
        wq = a.q_proj.weight.detach().view(H, D + r, -1)  # (H, D + rope, C)
        bq = None if a.q_proj.bias is None else a.q_proj.bias.detach().view(H, D + r)
    else:
        wq, bq = a.q_b_proj.weight.detach().view(H, D + r, -1), None  # (H, D + rope, q_rank), no bias
    w_kv = a.kv_b_proj.weight.detach().view(H, D + Dv, R)
    w_uk, w_uv = w_kv[:, :D], w_kv[:, D:]  # (H, D, R), (H, Dv, R)

    def project(nq: Tensor, nk: Tensor, nv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        xq = nq if a.q_rank is None else a.q_a_norm(a.q_a_proj(nq))  # (H, B, T, C | q_rank)
        q = torch.einsum("hbtc,hdc->bhtd", xq, wq)  # (B, H, T, D + rope)
        if bq is not None:
            q = q + bq[None, :, None]
        c_k, k_pe = a.kv_a_proj(nk).split([R, r], dim=-1)  # (H, B, T, R), (H, B, T, rope)
        k = torch.einsum("hbtr,hdr->bhtd", a.kv_a_norm(c_k), w_uk)  # (B, H, T, D)
        c_v = a.kv_a_proj(nv)[..., :R]  # (H, B, T, R)
        v = torch.einsum("hbtr,hdr->bhtd", a.kv_a_norm(c_v), w_uv)  # (B, H, T, Dv)
        q_nope, q_pe = q.split([D, r], dim=-1)
        if a.rope is not None:  # the layer's own RoPE, as its forward applies it (one RoPE key per receiver)
            q_pe, k_pe = a.rope(q_pe), a.rope(k_pe.transpose(0, 1))  # (B, H, T, rope)
        else:
            k_pe = k_pe.transpose(0, 1)
        return torch.cat([q_nope, q_pe], dim=-1), torch.cat([k, k_pe], dim=-1), v

    wo = _out_heads(a.o_proj.weight.detach(), H)
    bo = None if a.o_proj.bias is None else a.o_proj.bias.detach()
    return Block(layer.norm1, None, None, None, None, None, None, wo, bo, None, None, a.scale, a.sliding_window,
                 layer.norm2, layer.mlp, softcap=a.softcap, project=project)
