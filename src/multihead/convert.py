"""Conversions of trained attention layers between head layouts.

- `from_torch` / `to_torch`: nn.MultiheadAttention <-> `Attention`, exact (they live in
  `multihead.interop.torch`, re-exported here so that every conversion has one address).
- `to_gqa`: MHA (or GQA) -> GQA with fewer key/value heads by mean-pooling the K and V
  projection heads of each group (Ainslie et al., 2023, "GQA: Training Generalized
  Multi-Query Transformer Models from Multi-Head Checkpoints"). Approximate; meant to
  be followed by a little uptraining, as in the paper.
- `to_mla`: MHA (or GQA) -> `LatentAttention` by a truncated SVD of the stacked key and
  value projections [W_k ; W_v]: the right factor becomes the shared down-projection
  to a rank-R latent, the left factor the per-head up-projections. Exact at full rank;
  `MLAReport` gives the relative reconstruction error at every rank.

All return ordinary multihead modules (with their own caches) and leave the input
layer untouched.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from multihead.attention import Attention
from multihead.interop.torch import from_torch, to_torch
from multihead.latent import LatentAttention

__all__ = ["MLAReport", "from_torch", "mla_report", "to_gqa", "to_mla", "to_torch"]


def _check_attention(fn: str, attn) -> None:
    if not isinstance(attn, Attention):
        raise TypeError(f"{fn} takes a multihead.Attention; received {type(attn).__name__}"
                        + (" (use multihead.convert.from_torch first)"
                           if isinstance(attn, nn.MultiheadAttention) else ""))


def _has_bias(attn: Attention) -> bool:
    return attn.k_proj.bias is not None


# ------------------------------------------------------------------------ GQA


def to_gqa(attn: Attention, n_kv_heads: int) -> Attention:
    """A copy of `attn` with `n_kv_heads` key/value heads, each the mean of its group's.

    Query head h reads key/value head h // G, so the new key/value head j is the mean
    of the old heads j*m .. (j+1)*m - 1, m = attn.n_kv_heads / n_kv_heads (weights and
    biases alike). Queries, output, RoPE, causality and the rest are copied unchanged;
    with n_kv_heads == attn.n_kv_heads the result is identical to `attn`.

    Raises:
        ValueError: n_kv_heads does not divide attn.n_kv_heads.
    """
    _check_attention("to_gqa", attn)
    old = attn.n_kv_heads
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1 or old % n_kv_heads:
        valid = [d for d in range(1, old + 1) if old % d == 0]
        raise ValueError(f"n_kv_heads must divide the layer's {old} key/value heads; received {n_kv_heads!r}; "
                         f"valid: {', '.join(map(str, valid))}")
    m = old // n_kv_heads
    D, Cin = attn.head_dim, attn.context_dim
    w = attn.q_proj.weight
    new = Attention(attn.d_model, attn.n_heads, n_kv_heads, head_dim=D, context_dim=Cin, bias=_has_bias(attn),
                    dropout=attn.dropout, causal=attn.causal, rope=copy.deepcopy(attn.rope), backend=attn.backend)
    new = new.to(device=w.device, dtype=w.dtype).train(attn.training)
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(new, name).load_state_dict(getattr(attn, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(attn, name), getattr(new, name)
            dst.weight.copy_(src.weight.view(n_kv_heads, m, D, Cin).mean(1).reshape(-1, Cin))  # (Hkv*D, Cin)
            if src.bias is not None:
                dst.bias.copy_(src.bias.view(n_kv_heads, m, D).mean(1).reshape(-1))
    return new


# ------------------------------------------------------------------------ MLA


@dataclass(frozen=True)
class MLAReport:
    """The spectrum of a layer's stacked key/value map, and the error of each rank.

    `singular_values` (descending, float64) are those of M = [W_k | 0 ; W_v | b_v]
    (the bias column only when the layer has biases), the map `to_mla` factors.
    """

    kv_rank: int
    singular_values: tuple[float, ...]

    @property
    def max_rank(self) -> int:
        """min(rows, columns) of M: the rank at which the factorisation is exact."""
        return len(self.singular_values)

    @property
    def errors(self) -> tuple[float, ...]:
        """Relative reconstruction error ||M - M_r||_F / ||M||_F for r = 0 .. max_rank."""
        sq = [s * s for s in self.singular_values]
        total = sum(sq)
        tails = [math.fsum(sq[r:]) for r in range(len(sq) + 1)]
        return tuple(math.sqrt(t / total) if total > 0 else 0.0 for t in tails)

    @property
    def error(self) -> float:
        """Relative reconstruction error at `kv_rank`."""
        return self.errors[self.kv_rank]

    def __str__(self) -> str:
        rows = ["rank  rel. error"]
        for r, e in enumerate(self.errors):
            if r and (r & (r - 1) == 0 or r in (self.kv_rank, self.max_rank)):  # powers of two, chosen, max
                mark = "  <- kv_rank" if r == self.kv_rank else ""
                rows.append(f"{r:>4}  {e:.3e}{mark}")
        return "\n".join(rows)


def _kv_matrix(attn: Attention) -> torch.Tensor:
    """M = [W_k | 0 ; W_v | b_v] in float64, `(2 * Hkv * D, C [+ 1])`.

    The key bias is left out on purpose: it adds q_i . b_k to every score of query i,
    the same for every key, and softmax is invariant to that (exactly, weights too).
    The value bias rides along as the coefficient of a constant input feature 1, so it
    becomes the down-projection's bias and passes through the latent like the rest.
    """
    wk = attn.k_proj.weight.detach().double()  # (Hkv*D, C)
    wv = attn.v_proj.weight.detach().double()
    m = torch.cat([wk, wv], dim=0)  # (2*Hkv*D, C)
    if _has_bias(attn):
        col = torch.cat([torch.zeros_like(attn.k_proj.bias, dtype=torch.float64),
                         attn.v_proj.bias.detach().double()])[:, None]  # (2*Hkv*D, 1)
        m = torch.cat([m, col], dim=1)
    return m


def _check_mla_source(fn: str, attn) -> None:
    _check_attention(fn, attn)
    if attn.rope is not None:
        raise ValueError(
            f"{fn}: the layer has rotary embeddings (rope={attn.rope.extra_repr()}); only layers without RoPE "
            "convert exactly. RoPE rotates each key by its position after W_k, and that rotation does not "
            "commute with a shared latent's up-projection, so it cannot be absorbed; MLA's decoupled RoPE "
            "key is a different model that needs training (MHA2MLA, Ji et al., 2025). valid: rope=None"
        )
    if attn.context_dim != attn.d_model:
        raise ValueError(f"{fn}: context_dim ({attn.context_dim}) != d_model ({attn.d_model}): a cross-attention "
                         "layer has no LatentAttention equivalent (MLA is self-attention); "
                         "valid: context_dim == d_model")


def mla_report(attn: Attention, kv_rank: int | None = None) -> MLAReport:
    """The singular values of `attn`'s stacked K/V map and the error at every rank.

    For a rank sweep without building modules; kv_rank (default max_rank) only chooses
    which error `report.error` names.
    """
    _check_mla_source("mla_report", attn)
    s = torch.linalg.svdvals(_kv_matrix(attn))
    report = MLAReport(len(s), tuple(s.tolist()))
    if kv_rank is None:
        return report
    _check_rank(kv_rank, report.max_rank, attn)
    return MLAReport(kv_rank, report.singular_values)


def _check_rank(kv_rank, max_rank: int, attn: Attention) -> None:
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 1 <= kv_rank <= max_rank:
        rows, cols = 2 * attn.n_kv_heads * attn.head_dim, attn.d_model + _has_bias(attn)
        raise ValueError(
            f"kv_rank must be an int in 1..{max_rank}, the rank of the stacked [W_k ; W_v] "
            f"(min({rows} rows, {cols} columns)); received {kv_rank!r}"
        )


def to_mla(attn: Attention, kv_rank: int, *, return_report: bool = False
           ) -> LatentAttention | tuple[LatentAttention, MLAReport]:
    """Factor an MHA/GQA layer's keys and values through a shared rank-`kv_rank` latent.

    With M = [W_k ; W_v] `(2 * Hkv * D, C)` and its SVD U S V^T truncated to R = kv_rank:
    the down-projection `kv_a_proj` is S_R^(1/2) V_R^T `(R, C)` and the up-projection
    `kv_b_proj` holds U_R S_R^(1/2), each query head taking the rows of its key/value
    head (a GQA layer's heads are repeated per group, which is exact). Queries, output
    projection and causality are copied. The result has no latent norm
    (`latent_norm=False`: an RMSNorm would make the latent a nonlinear function of x)
    and rope_dim = 0. At R = max_rank its outputs equal the original's up to rounding;
    below, `MLAReport.errors` says how much of the K/V map is lost at each rank.

    Biases (Attention's default) are handled exactly: the query and output biases are
    copied (`bias=True`); the key bias is dropped, since it adds the same q_i . b_k to
    every score of query i and softmax ignores such a shift; the value bias becomes the
    down-projection's bias (M gains the column [0 ; b_v]), so it passes through the
    latent like the weights.

    Refused, with the reason: layers with RoPE (the rotation sits between W_k and the
    scores and cannot be absorbed into a shared latent), cross-attention layers
    (context_dim != d_model). Dropout is not carried over (LatentAttention has none).

    Returns:
        the `LatentAttention`, or `(module, MLAReport)` with `return_report=True`.
    """
    _check_mla_source("to_mla", attn)
    m = _kv_matrix(attn)  # (2*Hkv*D, C [+1])
    max_rank = min(m.shape)
    _check_rank(kv_rank, max_rank, attn)
    U, S, Vh = torch.linalg.svd(m, full_matrices=False)  # (rows, k), (k,), (k, cols)
    R = kv_rank
    root = S[:R].sqrt()
    down = root[:, None] * Vh[:R]  # (R, C [+1])
    up = U[:, :R] * root[None, :]  # (2*Hkv*D, R)

    H, Hkv, D, C = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.d_model
    G = H // Hkv
    up_k, up_v = up.view(2, Hkv, D, R).unbind(0)  # (Hkv, D, R) each
    up_kv = torch.cat([up_k, up_v], dim=1).repeat_interleave(G, dim=0)  # (H, 2D, R): query head h uses h // G

    bias = _has_bias(attn)
    w = attn.q_proj.weight
    mla = LatentAttention(C, H, R, head_dim=D, v_head_dim=D, rope_dim=0, causal=attn.causal,
                          backend=attn.backend, latent_norm=False, bias=bias)
    mla = mla.to(device=w.device, dtype=w.dtype).train(attn.training)
    with torch.no_grad():
        mla.q_proj.load_state_dict(attn.q_proj.state_dict())
        mla.o_proj.load_state_dict(attn.o_proj.state_dict())
        mla.kv_a_proj.weight.copy_(down[:, :C])
        if bias:
            mla.kv_a_proj.bias.copy_(down[:, C])
        mla.kv_b_proj.weight.copy_(up_kv.reshape(H * 2 * D, R))
    if not return_report:
        return mla
    return mla, MLAReport(R, tuple(S.tolist()))
