"""What `multihead.convert` and `multihead.interop.hf.gqa` share: the GQA inits, the
pooling of key/value heads, the relative K/V reconstruction error, and the report of a
conversion (re-exported by `multihead.convert`, their public home)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GQA_INITS", "ConversionReport", "LayerConversion", "grouped_kv_error", "pool_kv_heads", "relative_error",
           "stacked_kv"]

GQA_INITS = ("mean", "first", "random", "aligned")  # aligned: transformers models, from calibration


@dataclass(frozen=True)
class LayerConversion:
    """One converted layer: its qualified name in the model ("" for a lone layer) and the
    relative reconstruction error ||M - M'||_F / ||M||_F of its stacked K/V map
    M = [W_k | 0 ; W_v | b_v] (the key bias left out: softmax ignores it). For GQA, M' is
    the new K/V heads repeated over their groups (0 when nothing was merged); for MLA the
    rank-R product of the factors."""

    name: str
    error: float
    data_error: float | None = None  # the same on the layer's K/V features over calibration tokens, where given
    rope_pairs: tuple[tuple[int, ...], ...] | None = None  # MLA: each KV head's pairs kept rotary (0: the fastest)


@dataclass(frozen=True)
class ConversionReport:
    """What a conversion did to every attention layer of a model."""

    target: str  # "GQA-2", "MQA", "MLA-16"
    init: str  # "mean", "first", "random" (GQA) or "svd" (MLA)
    layers: tuple[LayerConversion, ...]

    @property
    def errors(self) -> tuple[float, ...]:
        return tuple(layer.error for layer in self.layers)

    @property
    def max_error(self) -> float:
        return max(self.errors, default=0.0)

    def __str__(self) -> str:
        data = any(layer.data_error is not None for layer in self.layers)
        rows = [f"{self.target} ({self.init}): {len(self.layers)} attention layer(s)",
                "layer  rel. K/V error" + ("  on calibration tokens" if data else "")]
        rows += [f"{layer.name or '(layer)'}  {layer.error:.3e}"
                 + (f"  {layer.data_error:.3e}" if layer.data_error is not None else "") for layer in self.layers]
        return "\n".join(rows)


def relative_error(old: torch.Tensor, new: torch.Tensor) -> float:
    norm = old.norm()
    return float((old - new).norm() / norm) if norm > 0 else float((new - old).norm())


def pool_kv_heads(t: torch.Tensor, n_kv_heads: int, head_dim: int, *, init: str = "mean",
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A K or V projection's weight `(Hkv * D, C)` or bias `(Hkv * D,)` with each group of
    m = Hkv / n_kv_heads consecutive heads made one, as `to_gqa`'s `init` says ("random"
    draws weights from N(0, std of `t`) and gives zero biases)."""
    m = t.shape[0] // (n_kv_heads * head_dim)
    assert m * n_kv_heads * head_dim == t.shape[0], (t.shape, n_kv_heads, head_dim)
    grouped = t.detach().view(n_kv_heads, m, head_dim, *t.shape[1:])  # (Hkv, m, D, ...)
    if init == "mean":
        return grouped.mean(1).reshape(-1, *t.shape[1:])
    if init == "first":
        return grouped[:, 0].reshape(-1, *t.shape[1:])
    if t.dim() == 1:
        return torch.zeros_like(t[: n_kv_heads * head_dim])
    std = float(t.detach().float().std()) if t.numel() > 1 else 0.0
    fresh = torch.randn((n_kv_heads * head_dim, *t.shape[1:]), generator=generator, dtype=torch.float32)
    return (fresh * std).to(device=t.device, dtype=t.dtype)


def grouped_kv_error(old: tuple, new: tuple, head_dim: int) -> float:
    """||M - M'||_F / ||M||_F for M = [W_k | 0 ; W_v | b_v] of (W_k, W_v, b_v or None)
    `old` and M' that of `new` with each of its K/V heads repeated over its group."""
    a, b = stacked_kv(*old), stacked_kv(*new)
    n_old, n_new = old[0].shape[0] // head_dim, new[0].shape[0] // head_dim
    b = b.view(2, n_new, 1, head_dim, -1).expand(2, n_new, n_old // n_new, head_dim, -1).reshape(a.shape)
    return relative_error(a, b)


def stacked_kv(wk: torch.Tensor, wv: torch.Tensor, bv: torch.Tensor | None,
               bk: torch.Tensor | None = None) -> torch.Tensor:
    """M = [W_k | b_k ; W_v | b_v] in float64, `(rows_k + rows_v, C [+ 1])`: the bias column
    only when a bias is given (a missing one is a block of zeros in it)."""
    m = torch.cat([wk.detach().double(), wv.detach().double()])  # (2*Hkv*D, C)
    if bv is not None or bk is not None:
        def part(b, rows):
            return torch.zeros(rows, dtype=torch.float64, device=wk.device) if b is None else b.detach().double()
        col = torch.cat([part(bk, wk.shape[0]), part(bv, wv.shape[0])])
        m = torch.cat([m, col[:, None]], dim=1)  # (2*Hkv*D, C + 1)
    return m
