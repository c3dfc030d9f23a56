"""Rotary position embeddings (Su et al., 2021, "RoFormer: Enhanced Transformer with
Rotary Position Embedding"), with the context-extension scalings models ship with.

Each pair of features of a query or key is rotated by an angle proportional to its
position, so that q_i . k_j depends on i - j only. Two pairings (half-split and
interleaved), never guessed; angles in float64; `RopeScaling` holds transformers' linear,
dynamic, llama3 and yarn scalings (Peng et al., 2023, "YaRN").

Details: docs/kernel.md, "RoPE: layouts, float64 angles and the scalings".
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from multihead.checks import check_positive_int, check_positive_number

__all__ = ["RopeScaling", "RotaryEmbedding", "apply_rotary"]

SCALINGS = ("linear", "dynamic", "llama3", "yarn")


def _at_least(name: str, value, minimum: float) -> float:
    value = check_positive_number(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}; received {value!r}")
    return value


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE is stretched past the training length (see the module docstring).

    Args:
        kind: "linear", "dynamic", "llama3" or "yarn".
        factor: the stretch (>= 1): new context length / original.
        original_max_positions: the training context length (llama3, yarn: required;
            dynamic: the length past which the base grows).
        low_freq_factor, high_freq_factor: llama3's ramp (Llama 3.1: 1 and 4).
        beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate:
            YaRN's ramp bounds (rotations), its attention factor (default
            0.1 ln(factor) + 1, or mscale's ratio to mscale_all_dim when both are given)
            and whether the ramp bounds are rounded to whole dims.
    """

    kind: str
    factor: float
    original_max_positions: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in SCALINGS:
            raise ValueError(f"RoPE scaling kind {self.kind!r} is not supported; valid: {', '.join(SCALINGS)}")
        object.__setattr__(self, "factor", _at_least("RoPE scaling factor", self.factor, 1.0))
        n = check_positive_int("original_max_positions", self.original_max_positions, allow_none=True)
        if n is None and self.kind in ("llama3", "yarn", "dynamic"):
            raise ValueError(f"RoPE scaling {self.kind!r} needs original_max_positions (the training context length)")
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            object.__setattr__(self, name, check_positive_number(name, getattr(self, name)))
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and value != 0:
                object.__setattr__(self, name, check_positive_number(name, value))
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"llama3 RoPE needs high_freq_factor ({self.high_freq_factor:g}) > low_freq_factor "
                             f"({self.low_freq_factor:g})")
        if not isinstance(self.truncate, bool):
            raise TypeError(f"truncate must be True or False; received {self.truncate!r}")

    @classmethod
    def from_hf(cls, params, max_position_embeddings: int | None = None) -> RopeScaling | None:
        """From transformers' `rope_parameters` (or the older `rope_scaling`) dict; None
        for plain RoPE. `max_position_embeddings` fills what transformers fills from the
        config (dynamic's original length, yarn's factor when it is null)."""
        if params is None:
            return None
        if not isinstance(params, dict):
            raise TypeError(f"rope parameters must be a dict; received {type(params).__name__}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            return None
        if kind not in SCALINGS:
            raise ValueError(f"rope_type {kind!r} is not supported; valid: 'default', {', '.join(map(repr, SCALINGS))}")
        original = params.get("original_max_position_embeddings")
        if kind == "dynamic" and original is None:
            original = max_position_embeddings
        factor = params.get("factor")
        if factor is None and kind == "yarn" and original and max_position_embeddings:
            factor = max_position_embeddings / original
        known = {f.name for f in fields(cls)}
        extra = {k: params[k] for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                                        "mscale_all_dim", "attention_factor", "truncate")
                 if k in known and params.get(k) is not None}
        return cls(kind, factor, original, **extra)

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What DeepSeek's softmax scale is multiplied by: mscale(factor, mscale_all_dim)^2
        under YaRN with mscale_all_dim (transformers' `yarn_apply_mscale`); 1 otherwise."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def inv_freq(self, dim: int, base: float, seq_len: int | None = None) -> Tensor:
        """Inverse frequencies `(dim/2,)` in float64 (on the CPU)."""
        exponent = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        plain = 1.0 / base ** exponent
        f = self.factor
        if self.kind == "linear":
            return plain / f
        if self.kind == "dynamic":
            n = self.original_max_positions
            seq_len = n if seq_len is None else max(int(seq_len), n)
            grown = base * ((f * seq_len / n) - (f - 1)) ** (dim / (dim - 2))
            return 1.0 / grown ** exponent
        if self.kind == "llama3":
            n = self.original_max_positions
            wavelen = 2 * math.pi / plain
            low_wl, high_wl = n / self.low_freq_factor, n / self.high_freq_factor
            scaled = torch.where(wavelen > low_wl, plain / f, plain)  # long waves: interpolated
            smooth = (n / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / f + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return torch.where(medium, smoothed, scaled)
        # yarn: each frequency between extrapolation (kept) and interpolation (/ factor)
        n = self.original_max_positions

        def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over n positions
            return dim * math.log(n / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
        return plain / f * (1 - keep) + plain * keep


class RotaryEmbedding(nn.Module):
    """Rotary embedding over the first `dim` features of each head.

    Args:
        dim: features rotated per head (even); the rest pass through (partial rotary,
            as in GPT-NeoX / Phi). Usually the head dim.
        base: the wavelength base theta (10000 in most models, 500000 in Llama 3).
        interleaved: GPT-J pairing (2f, 2f+1) instead of the half-split (f, f + dim/2).
        scaling: a `RopeScaling` (or a transformers `rope_parameters` dict) to stretch
            the context: linear, dynamic, llama3 or yarn. None: plain RoPE.

    The inverse frequencies stay float64 whatever dtype the module is cast to (float32
    on MPS, which has no float64).
    """

    def __init__(self, dim: int, base: float = 10000.0, *, interleaved: bool = False,
                 scaling: RopeScaling | dict | None = None):
        super().__init__()
        if check_positive_int("rotary dim", dim) % 2:
            raise ValueError(f"rotary dim must be an even int >= 2; received {dim!r}")
        if isinstance(base, bool) or not isinstance(base, numbers.Real):
            raise TypeError(f"rotary base must be a finite number > 1; received {base!r} ({type(base).__name__})")
        if not math.isfinite(base) or not base > 1:
            raise ValueError(f"rotary base must be a finite number > 1; received {base!r}")
        if isinstance(scaling, dict):
            scaling = RopeScaling.from_hf(scaling)
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"scaling must be None, a RopeScaling or a rope_parameters dict; "
                            f"received {type(scaling).__name__}")
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be True or False; received {interleaved!r}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scaling = scaling
        self._host_inv_freq = self._compute_inv_freq(None)
        self.register_buffer("inv_freq", self._host_inv_freq.clone(), persistent=False)  # (dim/2,) float64

    def _compute_inv_freq(self, seq_len: int | None) -> Tensor:
        if self.scaling is None:
            return 1.0 / self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        return self.scaling.inv_freq(self.dim, self.base, seq_len)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) would cast inv_freq too (to bfloat16: angles off by ~1 rad at
        # position 1e3); keep it float64 and let it follow the device only.
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        self.inv_freq = self._host_inv_freq.to(device, _angle_dtype(device))
        return self

    def extra_repr(self) -> str:
        extra = f", scaling={self.scaling.kind}(factor={self.scaling.factor:g})" if self.scaling else ""
        return f"dim={self.dim}, base={self.base:g}, interleaved={self.interleaved}{extra}"

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin `(N, dim/2)` for integer positions `(N,)`, computed in float64.

        Under "dynamic" scaling the base grows with the largest position given (as
        transformers does per forward; this reads that position back to the host).
        YaRN's attention factor multiplies both.
        """
        if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            got = f"dtype {positions.dtype}" if isinstance(positions, Tensor) else type(positions).__name__
            raise TypeError(f"positions must be an integer tensor; received {got}")
        dtype = _angle_dtype(positions.device)
        inv_freq = self.inv_freq
        if self.scaling is not None and self.scaling.kind == "dynamic" and positions.numel():
            seq_len = int(positions.max()) + 1
            if seq_len > self.scaling.original_max_positions:
                inv_freq = self._compute_inv_freq(seq_len)
        angles = positions.reshape(-1).to(dtype)[:, None] * inv_freq.to(positions.device, dtype)[None, :]
        cos, sin = angles.cos(), angles.sin()  # (N, dim/2)
        factor = self.scaling.cos_sin_factor if self.scaling is not None else 1.0
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos, sin

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """Rotate `x` `(B, H, T, D)` (D >= dim) whose first token sits at `offset`."""
        if not isinstance(x, Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"rotary input must be (B, H, T, D); received {got}")
        if x.shape[-1] < self.dim:
            raise ValueError(f"rotary dim {self.dim} exceeds the head dim {x.shape[-1]}")
        T = x.shape[2]
        positions = torch.arange(T, device=x.device) + offset
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin, interleaved=self.interleaved)


def _angle_dtype(device) -> torch.dtype:
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate the first 2 * cos.shape[-1] features of x `(..., T, D)` by the angles whose
    cos and sin are given, `(T, d/2)` or broadcastable to `(..., T, d/2)`.

    The rotation runs in x's dtype promoted to at least float32 (cos and sin are cast to
    it), and the result is cast back to x's dtype.
    """
    d = 2 * cos.shape[-1]
    acc = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos.to(acc), sin.to(acc)
    rot, rest = x[..., :d].to(acc), x[..., d:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]  # (..., T, d/2)
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    out = out.to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
