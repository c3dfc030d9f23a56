"""What the data-aware conversions read from a transformers model on calibration tokens.

`to_mla(..., calibration=...)` and `to_gqa(..., calibration=...)` (multihead.convert) run
the original model once over the calibration ids and, for every Llama-family attention
layer, keep its inputs and a few statistics of its queries, keys and attention:

The statistics (`q2`, `k2`, `phasor`, `value_scale`) and why each is read.
transformers is never imported here: the model's own modules are read.

Details: docs/mla.md, "What calibration reads from each layer".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from multihead.kernels.common import fold_scores, softmax

__all__ = ["CALIBRATION_WINDOW", "LayerStats", "calibration_ids", "layer_stats", "turn_pairs"]

CALIBRATION_WINDOW = 256  # tokens per calibration window made from text: the attention statistics need context


@dataclass(frozen=True)
class LayerStats:
    """One attention layer on the calibration tokens (module docstring)."""

    x: Tensor  # (N, C) the layer's inputs, in the model's dtype
    q2: Tensor  # (H, D) float64
    k2: Tensor  # (Hkv, D) float64
    phasor: Tensor  # (H, D/2) complex128
    value_scale: Tensor  # (H,) float64


def calibration_ids(calibration, tokenizer=None, *, fn: str = "to_mla", vocab: int | None = None) -> Tensor:
    """Token ids `(B, T)` from ids `(T,)` / `(B, T)` or from text (a str, read with
    `tokenizer`, in windows of CALIBRATION_WINDOW tokens; a shorter text is one window).
    With `vocab` (the model's embedding rows) every id must lie in [0, vocab): an id outside
    would index past the embedding."""
    if isinstance(calibration, str):
        if tokenizer is None or not callable(tokenizer):
            raise TypeError(f"{fn}: calibration text needs the model's tokenizer to become token ids; received "
                            f"tokenizer={type(tokenizer).__name__ if tokenizer is not None else None}; valid: "
                            "tokenizer=the model's tokenizer, or calibration=token ids (B, T)")
        ids = _tokenized(tokenizer(calibration), fn)
        if ids.numel() < 2:
            raise ValueError(f"{fn}: the calibration text gives {ids.numel()} token(s); valid: a text of at least "
                             "2 tokens (a few thousand convert well)")
        _check_id_range(ids, vocab, fn)
        n = CALIBRATION_WINDOW
        return ids[None] if len(ids) < n else ids[: len(ids) // n * n].view(-1, n)
    if not isinstance(calibration, Tensor) or calibration.dtype != torch.long:
        raise TypeError("calibration must be a non-empty LongTensor of token ids (T,) or (B, T), or text (a str); "
                        "received " + (f"a {calibration.dtype} tensor of shape {tuple(calibration.shape)}"
                                       if isinstance(calibration, Tensor) else type(calibration).__name__))
    if calibration.dim() not in (1, 2) or calibration.shape[-1] < 2:
        # one position has no distance to attend over: the attention statistics need two
        raise ValueError(f"{fn}: calibration must be token ids (T,) or (B, T) with T >= 2; received shape "
                         f"{tuple(calibration.shape)}")
    _check_id_range(calibration, vocab, fn)
    return calibration[None] if calibration.dim() == 1 else calibration


def _tokenized(out, fn: str) -> Tensor:
    """The ids `(T,)` a tokenizer returned for one text: its `input_ids`, integers, one row."""
    if not hasattr(out, "keys") or "input_ids" not in out.keys():
        raise TypeError(f"{fn}: the tokenizer returned {type(out).__name__}; valid: a mapping with input_ids, as a "
                        "transformers tokenizer returns")
    ids = out["input_ids"]
    ids = ids.detach().cpu() if isinstance(ids, Tensor) else torch.tensor(ids)
    if ids.numel() == 0:  # no token: torch.tensor([]) is float32, and the caller names the count
        return ids.long().reshape(0)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{fn}: the tokenizer returned input_ids of {ids.dtype}; valid: integer token ids")
    if ids.dim() == 2 and ids.shape[0] == 1:  # a batch of the one text
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"{fn}: the tokenizer returned input_ids of shape {tuple(ids.shape)} for one text; valid: "
                         "one row of ids")
    return ids.long()


def _check_id_range(ids: Tensor, vocab: int | None, fn: str) -> None:
    if vocab is None:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{fn}: calibration holds token id {bad}, outside the model's vocabulary; valid: ids in "
                         f"[0, {vocab - 1}]")


def turn_pairs(w: Tensor, a: Tensor) -> Tensor:
    """Rows `(H, D, ...)` of queries with every rotary pair f (features f and f + D/2 in
    transformers' half-split layout, the complex number q_f + i q_{f + D/2}) multiplied by
    conj(a[h, f]) (`a` `(H, D/2)` complex): then q' . k = Re(conj(q) a k), the score
    of q against the key k turned and scaled by a. RoPE turns every pair by a complex
    phase, which commutes with this: the product holds at every position."""
    half = w.shape[1] // 2
    shape = (*a.shape, *([1] * (w.dim() - 2)))
    ar, ai = a.real.reshape(shape).to(w.dtype), a.imag.reshape(shape).to(w.dtype)
    x1, x2 = w[:, :half], w[:, half:]
    return torch.cat([ar * x1 + ai * x2, ar * x2 - ai * x1], dim=1)


def _sizes(attn: nn.Module) -> tuple[int, int, int]:
    D = attn.head_dim
    return attn.q_proj.out_features // D, attn.k_proj.out_features // D, D


def _rotate(t: Tensor, angles: Tensor) -> Tensor:
    """transformers' half-split RoPE of `t` `(B, n, T, D)` at `angles` `(T, D/2)`."""
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # (T, D)
    half = t.shape[-1] // 2
    turned = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos + turned * sin


def _distance_weights(p: Tensor) -> Tensor:
    """(B, H, T, T) attention weights -> (H, T): the mean weight per query at each distance i - j."""
    T = p.shape[-1]
    return torch.stack([torch.diagonal(p, offset=-d, dim1=-2, dim2=-1).sum(-1) for d in range(T)], -1
                       ).sum(0) / (p.shape[0] * T)  # (H, T)


def _one_layer(attn: nn.Module, x: Tensor, inv_freq: Tensor, window: int | None) -> LayerStats:
    """x `(B, T, C)`: the layer's inputs on the calibration windows."""
    H, Hkv, D = _sizes(attn)
    B, T, C = x.shape
    q = attn.q_proj(x).view(B, T, H, D)
    k = attn.k_proj(x).view(B, T, Hkv, D)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.double().transpose(1, 2), k.double().transpose(1, 2)  # (B, H, T, D), (B, Hkv, T, D)
    v = attn.v_proj(x).double()  # (B, T, Hkv*Dv)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None]  # (T, D/2)
    scores = fold_scores(_rotate(q, angles), _rotate(k, angles), float(getattr(attn, "scaling", D ** -0.5)))
    i = torch.arange(T)
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    p = softmax(scores, allowed)  # (B, H, T, T), float64
    w = _distance_weights(p)  # (H, T)
    turn = torch.exp(-1j * torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None])  # (T, D/2)
    phasor = w.to(torch.complex128) @ turn  # (H, D/2)
    Dv = v.shape[-1] // Hkv
    v = v.view(-1, Hkv, Dv)
    cov = torch.einsum("nja,njb->jab", v - v.mean(0), v - v.mean(0)) / len(v)  # (Hkv, Dv, Dv)
    wo = attn.o_proj.weight.detach().double().view(C, H, Dv).transpose(0, 1)  # (H, C, Dv)
    cov_h = cov.repeat_interleave(H // Hkv, dim=0)  # (H, Dv, Dv)
    value_scale = torch.einsum("hca,hab,hcb->h", wo, cov_h, wo)
    return LayerStats(x.reshape(-1, C).detach(), q.square().mean((0, 2)), k.square().mean((0, 2)), phasor,
                      value_scale)


def layer_stats(model: nn.Module, layers: list[tuple[str, nn.Module]], ids: Tensor) -> dict[str, LayerStats]:
    """Each layer's `LayerStats` when `model` reads `ids` `(B, T)` (one forward pass)."""
    from multihead.interop.hf.layers import layer_inputs, sliding_window_of

    # a layer called twice (shared weights) keeps its last call's input, as one forward's statistics
    inputs = layer_inputs(model, [m for _, m in layers], ids)
    seen = {name: xs[-1] for (name, _), xs in zip(layers, inputs)}
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    out = {}
    with torch.no_grad():
        for name, m in layers:
            D = m.head_dim
            f = (inv_freq.detach().double().cpu() if inv_freq is not None and inv_freq.numel() == D // 2 else
                 1.0 / float(getattr(m.config, "rope_theta", None) or 10000.0)
                 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
            out[name] = _one_layer(m, seen[name], f.to(seen[name].device), sliding_window_of(m))
    return out
