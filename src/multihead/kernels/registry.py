"""The backend registry: every attention kernel is a plain function with one signature,
registered with what it can do; "auto" is resolved at call time in one visible function
(`resolve_backend`), and asking a backend for what it cannot do raises naming the
backends that can. `multihead.functional` re-exports the public names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.score_mods import ScoreMod

__all__ = ["BACKENDS", "Backend", "FEW_QUERIES", "available_backends", "check_backend_name", "get_backend",
           "register_backend", "resolve_backend"]

FEW_QUERIES = 8  # query rows up to which a score mod runs on "chunked" rather than "tiles"


@dataclass(frozen=True)
class Backend:
    """A registered kernel.

    `fn(q, k, v, mask, *, causal, scale, dropout_p, weight_heads) -> (out, weights)`
    receives validated inputs: `mask` is None or a 4-D tensor broadcastable to
    `(B, H, T, S)` (bool or q's float dtype), `weight_heads` is None or a tuple of head
    indices, and `weights` is None or `(B, len(weight_heads), T, S)`. A backend
    registered with `predicates=True` may also receive `mask` as a `masks.MaskMod`
    (others get it materialised); one with `score_mods` "additive" or "any" receives
    `score_mod=` (a `score_mods.ScoreMod` or None) as a keyword.
    """

    name: str
    fn: Callable[..., tuple[Tensor, Tensor | None]]
    weights: bool  # can return attention weights
    dropout: bool  # can apply dropout
    weights_with_dropout: bool  # weights and dropout in the same call
    doc: str = ""
    predicates: bool = False  # takes a MaskMod as is (no (T, S) materialisation)
    score_mods: str = "none"  # "none", "additive" (bias-only mods such as ALiBi) or "any"
    sinks: bool = False  # takes `sinks=` (one extra logit per row, with no value: GPT-OSS)


BACKENDS: dict[str, Backend] = {}


def register_backend(
    name: str,
    fn: Callable[..., tuple[Tensor, Tensor | None]],
    *,
    weights: bool,
    dropout: bool,
    weights_with_dropout: bool = False,
    doc: str = "",
    predicates: bool = False,
    score_mods: str = "none",
    sinks: bool = False,
) -> None:
    """Add a kernel to the registry (the signature is documented on `Backend`)."""
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a non-empty string other than 'auto'; received {name!r} "
                        f"({type(name).__name__})")
    if not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto'; received {name!r}")
    if score_mods not in ("none", "additive", "any"):
        raise ValueError(f"score_mods must be 'none', 'additive' or 'any'; received {score_mods!r}")
    BACKENDS[name] = Backend(name, fn, weights, dropout, weights_with_dropout, doc, predicates, score_mods, sinks)


def available_backends() -> dict[str, Backend]:
    """The registered backends by name."""
    return dict(BACKENDS)


def resolve_backend(*, want_weights: bool, dropout_p: float, score_mod: ScoreMod | Callable | None = None,
                    device: torch.device | str | None = None, queries: int | None = None,
                    shape: Sequence[int] | None = None, sinks: bool = False) -> str:
    """Resolve "auto" to a backend name, at call time.

    The fused kernel serves everything it can, predicate masks included (block-sparse);
    asking for weights does not make the output fall back to a slow path (weights come
    from a separate pass over the heads asked for). Weights *and* dropout together need
    the explicit "math" path, because the weights must describe the dropped-out
    probabilities' source. A score mod that is not a plain additive bias runs on the
    explicit tile path, whose backward recomputes tiles (O(N) memory); so does dropout
    on the CPU, where torch's fused kernel has no dropout and falls back to its own
    O(N^2) math path. A score mod holding tensors that require grad (a learned bias)
    runs where autograd sees it ("chunked", or "math" with dropout). A few `queries`
    (decoding: at most `FEW_QUERIES`) with a non-additive mod and no dropout go to
    "chunked": one small block of scores beats the tile loop's per-tile steps (measured
    2x at T = 1 over 1,100 keys). `shape` = (B, H, T, S), when known, is where a mod is
    probed for captured tensors that require grad (a mod the probe cannot run counts as
    one: the autograd backends are exact for any mod). Attention sinks run on "math", the
    one path whose softmax takes them. Never compiles.
    """
    if sinks or want_weights and dropout_p > 0:
        return "math"
    if isinstance(score_mod, ScoreMod) and torch.is_grad_enabled() \
            and score_mod.trainable(device, shape, None if shape is None else shape[3]) is not False:
        return "math" if dropout_p > 0 else "chunked"  # autograd trains what the mod captured
    if score_mod is not None and getattr(score_mod, "bias", None) is None:
        return "chunked" if queries is not None and queries <= FEW_QUERIES and dropout_p == 0 else "tiles"
    if dropout_p > 0 and device is not None and torch.device(device).type == "cpu":
        return "tiles"
    return "sdpa"


def check_backend_name(name: str) -> None:
    """Raise unless `name` is "auto" or a registered backend (the modules check at construction)."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; valid: 'auto', "
            + ", ".join(repr(n) for n in BACKENDS)
        )


def get_backend(name: str, *, want_weights: bool, dropout_p: float, score_mod: ScoreMod | None = None,
                sinks: bool = False) -> Backend:
    check_backend_name(name)
    impl = BACKENDS[name]
    needs = []
    if sinks and not impl.sinks:
        needs.append(("take attention sinks", lambda b: b.sinks))
    if score_mod is not None and impl.score_mods != "any":
        if score_mod.bias is None:
            needs.append((f"apply the score mod {score_mod.name} (not an additive bias)",
                          lambda b: b.score_mods == "any"))
        elif impl.score_mods == "none":
            needs.append((f"apply the score mod {score_mod.name}", lambda b: b.score_mods != "none"))
    if want_weights and not impl.weights:
        needs.append(("return attention weights", lambda b: b.weights))
    if dropout_p > 0 and not impl.dropout:
        needs.append(("apply dropout", lambda b: b.dropout))
    if want_weights and dropout_p > 0 and not impl.weights_with_dropout:
        needs.append(("return weights together with dropout", lambda b: b.weights_with_dropout))
    if needs:
        what, test = needs[-1]
        able = [n for n, b in BACKENDS.items() if test(b)]
        raise ValueError(
            f"backend {name!r} cannot {what}; backends that can: "
            + ", ".join(repr(n) for n in able)
        )
    return impl
