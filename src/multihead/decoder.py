"""The small transformers the lab's experiments train, built from multihead's own modules.
They live below the tools, with their checkpoint format (`multihead.checkpoint`), because
three tools use them: lab trains and saves them, inspect and heads open them.

One decoder-only model covers them all: token + learned position embeddings, `n_layers`
pre-norm blocks (attention, then an MLP unless `mlp=False`, which gives the
attention-only models of Elhage et al., 2021, "A Mathematical Framework for Transformer
Circuits"), a final norm and an unembedding. The attention of each block is a
`multihead.Attention` (MHA, GQA or MQA by `n_kv_heads`) or a `multihead.LatentAttention`
(MLA by `kv_rank`), always causal. Positions are learned absolute embeddings by default
(they keep the lab's MHA -> MLA conversion exact at full rank); `positions="rope"` rotates
queries and keys instead (the induction experiment uses it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import torch
from torch import Tensor, nn

from multihead.checks import check_positive_int, divisibility_error, variant_name

__all__ = ["LabConfig", "LabTransformer"]

_ATTENTION = ("mha", "mla")
_NORMS = ("rms", "layer", "none")
_POSITIONS = ("learned", "rope")


@dataclass(frozen=True)
class LabConfig:
    """The architecture of a lab model (what a checkpoint's config.json records).

    Args:
        vocab_size, max_len: tokens and positions.
        d_model, n_layers, n_heads: C, blocks, H.
        n_kv_heads: Hkv for "mha" attention (None: H, i.e. MHA; 1: MQA; else GQA).
        head_dim: D (None: d_model // n_heads, filled in). A head dim apart from
            d_model / n_heads lets a small model keep a large model's heads (`lab induction`
            scaled from a plan's geometry).
        attention: "mha" (multihead.Attention) or "mla" (multihead.LatentAttention).
        kv_rank, rope_dim: MLA's latent rank R and decoupled RoPE dims.
        mlp: a 4x GELU MLP after each attention; False gives an attention-only model.
        norm: "rms", "layer" or "none".
        bias: biases on the attention projections.
        positions: "learned" (absolute embeddings) or "rope" (rotary, in attention).
        latent_norm: MLA's RMSNorm on the latent (False in layers made by
            `multihead.convert.to_mla`, whose latent is a linear map of x).
    """

    vocab_size: int
    max_len: int
    d_model: int = 64
    n_layers: int = 1
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    attention: str = "mha"
    kv_rank: int | None = None
    rope_dim: int = 0
    mlp: bool = True
    mlp_ratio: int = 4
    norm: str = "rms"
    bias: bool = False
    latent_norm: bool = True
    positions: str = "learned"

    def __post_init__(self):
        for name in ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            check_positive_int(name, getattr(self, name))
        if self.attention not in _ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(_ATTENTION)}; received {self.attention!r}")
        if self.norm not in _NORMS:
            raise ValueError(f"norm must be one of {', '.join(_NORMS)}; received {self.norm!r}")
        if self.positions not in _POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(_POSITIONS)}; received {self.positions!r}")
        if self.positions == "rope" and self.attention == "mla":
            raise ValueError("positions='rope' is for attention='mha'; MLA carries RoPE in rope_dim")
        if self.attention == "mla" and self.kv_rank is None:
            raise ValueError("attention='mla' needs kv_rank")
        if self.head_dim is None:
            error = divisibility_error("d_model", self.d_model, "n_heads", self.n_heads)
            if error is not None:
                raise ValueError(f"{error}; or give head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)  # an input left out, not derived
        else:
            check_positive_int("head_dim", self.head_dim)

    @property
    def kind(self) -> str:
        """MHA, GQA, MQA or MLA."""
        if self.attention == "mla":
            return "MLA"
        hkv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        return variant_name(self.n_heads, hkv)

    @property
    def cache_values_per_token(self) -> int:
        """Values cached per token per layer: 2 * Hkv * D, or R + rope_dim for MLA."""
        if self.attention == "mla":
            return self.kv_rank + self.rope_dim
        hkv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        return 2 * hkv * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LabConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown lab model fields {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**d)


def _norm(kind: str, d: int) -> nn.Module:
    if kind == "rms":
        return nn.RMSNorm(d)
    if kind == "layer":
        return nn.LayerNorm(d)
    return nn.Identity()


def make_attention(cfg: LabConfig) -> nn.Module:
    """The causal attention layer of one block."""
    if cfg.attention == "mla":
        from multihead import LatentAttention

        return LatentAttention(cfg.d_model, cfg.n_heads, cfg.kv_rank, head_dim=cfg.head_dim, rope_dim=cfg.rope_dim,
                               causal=True, bias=cfg.bias, latent_norm=cfg.latent_norm)
    from multihead import Attention

    return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.bias, causal=True,
                     rope=cfg.positions == "rope")


class Block(nn.Module):
    def __init__(self, cfg: LabConfig):
        super().__init__()
        self.norm1 = _norm(cfg.norm, cfg.d_model)
        self.attn = make_attention(cfg)
        if cfg.mlp:
            self.norm2 = _norm(cfg.norm, cfg.d_model)
            self.mlp = nn.Sequential(
                nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
                nn.GELU(),
                nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
            )
        else:
            self.norm2 = self.mlp = None

    def forward(self, x: Tensor, return_weights: bool | Sequence[int] = False):
        h = self.norm1(x)
        weights = None
        if return_weights is not False:
            h, weights = self.attn(h, return_weights=return_weights)  # weights (B, h, T, T)
        else:
            h = self.attn(h)
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x, weights


class LabTransformer(nn.Module):
    """A decoder-only transformer of `LabConfig`; forward(idx (B, T)) -> logits (B, T, V)."""

    def __init__(self, cfg: LabConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = _norm(cfg.norm, cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: Tensor, *, return_weights: bool = False,
                layers: Sequence[int] | None = None, heads: Sequence[int] | None = None):
        """Logits `(B, T, V)`; with return_weights also a dict layer -> weights `(B, h, T, T)`
        for the `layers` (default all) and `heads` (default all) asked."""
        B, T = idx.shape
        if T > self.cfg.max_len:
            raise ValueError(f"sequence of {T} tokens exceeds this model's max_len {self.cfg.max_len}")
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))[None]
        want = set(range(self.cfg.n_layers) if layers is None else layers) if return_weights else set()
        head_sel = True if heads is None else list(heads)
        weights = {}
        for i, block in enumerate(self.blocks):
            x, w = block(x, head_sel if i in want else False)
            if w is not None:
                weights[i] = w
        logits = self.lm_head(self.norm_f(x))  # (B, T, V)
        return (logits, weights) if return_weights else logits

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
