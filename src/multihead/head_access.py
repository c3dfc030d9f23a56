"""What the head tools (`multihead.heads`, `multihead.inspect`) need of an attention module.

An attention module the tools understand has a method `head_access()` returning a
`HeadAccess`: its head counts and widths and the submodules whose outputs (or, for the
output projection, input) hold the per-head tensors. The tools hook those submodules and
nothing else, so a new attention variant is understood once it implements this method
(docs/development.md, "A new attention variant"). `Attention` and `LatentAttention`
implement it; a transformers model on attn_implementation="multihead" is reached through
its attention function instead (`multihead.heads.engine`'s adapter), which hands the tools
the same per-head tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import nn


@dataclass(frozen=True)
class HeadAccess:
    """One attention module's heads, as the tools see them.

    kind: "attention" (per-head keys and values from `k` and `v`) or "latent" (MLA: one
    shared latent from `latent`, per-head keys and values through the up-projection `kv`).
    H, Hkv: query heads and key/value heads (Hkv = H for MLA: per head through `kv`).
    D, Dv: key and value head widths.
    q: its output `(B, T, H * Dq)` is the queries, head-major (Dq = D, or D + rope for MLA).
    k, v: outputs `(B, S, Hkv * D)` and `(B, S, Hkv * Dv)`: the keys and values (before RoPE).
    kv: MLA's up-projection, output `(B, S, H * (D + Dv))`, each head's [k_h ; v_h].
    latent: MLA's down-projection, output `(B, S, R + rope)`: the latent; None where the
        module's owner computes it elsewhere (the tools then refuse the module).
    o: its input `(B, T, H * Dv)` is the heads' outputs z, head-major.
    """

    kind: str
    H: int
    Hkv: int
    D: int
    Dv: int
    q: nn.Module
    o: nn.Module
    k: nn.Module | None = None
    v: nn.Module | None = None
    kv: nn.Module | None = None
    latent: nn.Module | None = None


@runtime_checkable
class HasHeads(Protocol):
    """An attention module the head tools understand."""

    def head_access(self) -> HeadAccess: ...


def has_heads(module) -> bool:
    """Whether `module` implements the protocol (read off its class: cheap in a walk of every module)."""
    return isinstance(module, nn.Module) and callable(getattr(type(module), "head_access", None))
