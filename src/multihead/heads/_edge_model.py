"""A transformers decoder's weights laid out for the edge graph: per-head projections, norms, MLPs.

The circuits tools run their own forward of the model's weights (`_edge_run`), in which
every receiver applies its norm and its projection to its own copy of the residual
stream. What that forward needs of a model is here: the embedding (with GPT-2's position
embedding), per layer its input norm, the per-head query/key/value projections `(H, D, C)`
with their biases, the per-head slices of the output projection `(H, C, Dv)`, the query
and key norms where the model has them (Qwen3), RoPE, the sliding window, the MLP's norm
and the MLP; then the final norm and the LM head. The norms and MLPs are the model's own
modules, called on the copies.

Architectures: Llama, Mistral, Qwen2, Qwen3 (and others laid out as Llama is: `model.layers[i]`
with `self_attn.{q,k,v,o}_proj`, `input_layernorm`, `post_attention_layernorm`, `mlp`) and
GPT-2 (fused `c_attn`, biases, learned positions). Models whose attention and MLP read one
input in parallel (GPT-J, GPT-NeoX with its parallel residual, Phi, Falcon, Cohere) have no
such graph and are refused by name, and so are those with a norm after the attention
(Gemma 2 and 3: the norm of the heads' sum is not a sum of per-head outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from multihead.heads.edge_graph import Graph

PARALLEL = {"gptj": "GPT-J", "phi": "Phi", "falcon": "Falcon", "cohere": "Cohere", "gpt_neox": "GPT-NeoX",
            "codegen": "CodeGen", "phi3": None}
POST_NORM = {"gemma2", "gemma3", "gemma3_text", "olmo2"}
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "granite", "smollm3"}


@dataclass
class Block:
    """One decoder layer: its input norm, per-head projections, MLP norm and MLP."""

    ln1: Callable
    wq: Tensor  # (H, D, C)
    bq: Tensor | None  # (H, D)
    wk: Tensor  # (Hkv, D, C)
    bk: Tensor | None
    wv: Tensor  # (Hkv, Dv, C)
    bv: Tensor | None
    wo: Tensor  # (H, C, Dv): each head's slice of the output projection
    bo: Tensor | None  # (C,)
    q_norm: Callable | None
    k_norm: Callable | None
    scaling: float
    window: int | None
    ln2: Callable
    mlp: Callable


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

    @property
    def graph(self) -> Graph:
        b = self.blocks[0]
        return Graph(len(self.blocks), b.wq.shape[0], b.wk.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.unembed.dtype

    @property
    def device(self) -> torch.device:
        return self.unembed.device

    @classmethod
    def of(cls, model) -> EdgeModel:
        """The layout of a transformers causal LM; ValueError naming what is refused and why."""
        try:
            import transformers
        except ImportError:  # pragma: no cover - transformers is a dependency of the head tools
            transformers = None
        if transformers is None or not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"the edge graph is built for transformers decoder LMs (Llama, Mistral, Qwen2, Qwen3, "
                            f"GPT-2); received {type(model).__name__} (multihead's own decoders are not supported "
                            "yet: their layers have no separate per-head output to send)")
        cfg = model.config
        kind = getattr(cfg, "model_type", "")
        name = type(model).__name__
        if kind in PARALLEL or getattr(cfg, "use_parallel_residual", False) or getattr(cfg, "parallel_attn", False):
            raise ValueError(f"{name} ({kind}) runs attention and MLP in parallel on one input: the edge graph "
                             "(a head of layer l reaching that layer's MLP) does not exist there")
        if kind in POST_NORM:
            raise ValueError(f"{name} ({kind}) normalizes the sum of its heads after the attention: a head's output is "
                             "not a term of the residual stream, so the edge graph cannot be exact there")
        if kind == "gpt2":
            return _gpt2(model)
        if kind in LLAMA_LIKE or _llama_layout(model):
            return _llama(model, kind)
        raise ValueError(f"{name} ({kind!r}) has a layout the edge graph does not know; supported: Llama, Mistral, "
                         "Qwen2, Qwen3 (model.layers with self_attn.q/k/v/o_proj) and GPT-2")


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
    for layer in inner.layers:
        a = layer.self_attn
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
    emb = inner.embed_tokens
    head = model.get_output_embeddings()
    return EdgeModel(kind, blocks, lambda ids, pos: emb(ids), inner.rotary_emb, inner.norm, head.weight.detach(),
                     None if getattr(head, "bias", None) is None else head.bias.detach())


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
                     None if getattr(head, "bias", None) is None else head.bias.detach())
