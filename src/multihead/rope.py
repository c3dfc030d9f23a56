"""Rotary position embeddings (Su et al., 2021, "RoFormer: Enhanced Transformer with
Rotary Position Embedding").

Each pair of features of a query or key is rotated by an angle proportional to its
position, so that q_i . k_j depends on i - j only. Two pairings are in use:

- half-split (Llama, GPT-NeoX, HF `rotate_half`): feature f pairs with f + d/2;
- interleaved (GPT-J, the original paper, Meta's reference Llama): 2f pairs with 2f + 1.

The same weights give different models under the two layouts, so the layout is a
choice, never a guess. `offset` is the position of the first token, which is how
decoding with a cache lines up with the full forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding(nn.Module):
    """Rotary embedding over the first `dim` features of each head.

    Args:
        dim: features rotated per head (even); the rest pass through (partial rotary,
            as in GPT-NeoX / Phi). Usually the head dim.
        base: the wavelength base theta (10000 in most models, 500000 in Llama 3).
        interleaved: GPT-J pairing (2f, 2f+1) instead of the half-split (f, f + dim/2).
    """

    def __init__(self, dim: int, base: float = 10000.0, *, interleaved: bool = False):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
            raise ValueError(f"rotary dim must be a positive even int; received {dim!r}")
        if not base > 1.0:
            raise ValueError(f"rotary base must be > 1; received {base!r}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = bool(interleaved)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # (dim/2,)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}, interleaved={self.interleaved}"

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin `(T, dim/2)` for integer positions `(T,)`, in float32."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # (T, dim/2)
        return angles.cos(), angles.sin()

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """Rotate `x` `(B, H, T, D)` (D >= dim) whose first token sits at `offset`."""
        if x.dim() != 4:
            raise ValueError(f"rotary input must be (B, H, T, D); received shape {tuple(x.shape)}")
        if x.shape[-1] < self.dim:
            raise ValueError(f"rotary dim {self.dim} exceeds the head dim {x.shape[-1]}")
        T = x.shape[2]
        positions = torch.arange(T, device=x.device) + offset
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin, interleaved=self.interleaved)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate the first 2 * cos.shape[-1] features of x `(..., T, D)` by angles (T, d/2)."""
    d = 2 * cos.shape[-1]
    rot, rest = x[..., :d].float(), x[..., d:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]  # (..., T, d/2)
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    out = out.to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
