"""nn.MultiheadAttention <-> multihead.Attention, with exactly the same weights.

torch packs q/k/v into one `in_proj_weight` (when kdim == vdim == embed_dim) and keeps
the output projection in `out_proj`; `Attention` holds four `nn.Linear`. Options that
have no equivalent are refused with the reason, never dropped silently. (Its inverted
masks are converted in `multihead.masks.from_key_padding_mask` / `from_torch_attn_mask`.)
"""

from __future__ import annotations

import torch
from torch import nn

from multihead.attention import Attention

__all__ = ["from_torch", "to_torch"]


def from_torch(mha: nn.MultiheadAttention, *, causal: bool = False, backend: str = "auto",
               cls: type[Attention] = Attention) -> Attention:
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


def to_torch(attn: Attention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """An `nn.MultiheadAttention` with exactly these weights (MHA only, D = C / H, no RoPE)."""
    if not isinstance(attn, Attention):
        raise TypeError(f"to_torch takes a multihead.Attention; received {type(attn).__name__}")
    reasons = []
    if attn.n_kv_heads != attn.n_heads:
        reasons.append(f"n_kv_heads ({attn.n_kv_heads}) != n_heads ({attn.n_heads}): "
                       "nn.MultiheadAttention has no grouped heads")
    if attn.head_dim * attn.n_heads != attn.d_model:
        reasons.append(f"head_dim * n_heads ({attn.head_dim * attn.n_heads}) != d_model "
                       f"({attn.d_model}): nn.MultiheadAttention needs head_dim = d_model / n_heads")
    if attn.rope is not None:
        reasons.append("rotary embeddings have no nn.MultiheadAttention equivalent")
    has_bias = [lin.bias is not None for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
    if any(has_bias) and not all(has_bias):
        reasons.append("biases on some projections only (nn.MultiheadAttention: all or none)")
    if reasons:
        raise ValueError("cannot convert to nn.MultiheadAttention: " + "; ".join(reasons))
    w = attn.q_proj.weight
    mha = nn.MultiheadAttention(
        attn.d_model, attn.n_heads, dropout=attn.dropout, bias=all(has_bias),
        kdim=attn.context_dim, vdim=attn.context_dim, batch_first=batch_first,
        device=w.device, dtype=w.dtype,
    )
    with torch.no_grad():
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        else:
            mha.q_proj_weight.copy_(attn.q_proj.weight)
            mha.k_proj_weight.copy_(attn.k_proj.weight)
            mha.v_proj_weight.copy_(attn.v_proj.weight)
        mha.out_proj.weight.copy_(attn.o_proj.weight)
        if all(has_bias):
            mha.in_proj_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
            mha.out_proj.bias.copy_(attn.o_proj.bias)
    return mha
