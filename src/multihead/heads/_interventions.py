"""`ablate` and `patch`: context managers that rewrite chosen heads in every forward run
inside them, and leave the model exactly as it was when they end (also on exceptions)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from contextlib import contextmanager

from torch import Tensor

from multihead.checks import is_int
from multihead.heads._record import Recording, check_what
from multihead.heads.engine import Engine, Handler, Layer, check_model

HOWS = ("zero", "mean", "resample")


def check_heads(heads, name: str = "heads") -> list[tuple[int, int]]:
    """[(layer, head), ...] from pairs; one pair alone (a 2-tuple, or a 1-D tensor/array of two
    ints) is a list of one; a `(N, 2)` tensor/array is N pairs; a clear error for anything else."""
    if isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(i, int) for i in heads):
        heads = [heads]
    if hasattr(heads, "tolist") and hasattr(heads, "shape"):  # a tensor or a NumPy array
        shape = tuple(heads.shape)
        if shape not in ((2,),) and not (len(shape) == 2 and shape[1] == 2):
            raise ValueError(f"{name} as a tensor must be one (layer, head) pair of shape (2,) or pairs of shape "
                             f"(N, 2); received shape {shape}")
        heads = [heads.tolist()] if len(shape) == 1 else heads.tolist()
    if not isinstance(heads, Iterable) or isinstance(heads, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of (layer, head) pairs; received {heads!r}")
    out = []
    for p in heads:
        if hasattr(p, "tolist"):
            p = tuple(p.tolist())
        ok = isinstance(p, (tuple, list)) and len(p) == 2 and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p)
        if not ok:
            raise ValueError(f"{name} must be (layer, head) pairs of non-negative ints; received {p!r} in {heads!r}")
        out.append((int(p[0]), int(p[1])))
    return out


def check_positions(positions) -> list[int] | None:
    if positions is None:
        return None
    if isinstance(positions, int) and not isinstance(positions, bool):
        return [positions]
    if isinstance(positions, Tensor):
        positions = positions.tolist()
    if not isinstance(positions, Iterable) or not all(is_int(p) for p in positions):
        raise TypeError(f"positions must be None (all), an int or a sequence of ints; received {positions!r}")
    return [operator.index(p) for p in positions]


class _Edits(Handler):
    """Per (what, layer): a list of (head, value function) writing that head's slice."""

    def __init__(self):
        self.edits: dict[tuple[str, int], list] = {}
        self.seen: set[int] = set()
        self.check = None  # callable(layer) raising for heads out of range

    def add(self, what: str, layer: int, head: int, value, positions: list[int] | None) -> None:
        self.edits.setdefault((what, layer), []).append((head, value, positions))

    def _apply(self, what: str, lay: Layer, t: Tensor, extra=None) -> Tensor:
        self.seen.add(lay.index)
        items = self.edits.get((what, lay.index))
        if not items:
            return t
        if self.check is not None:
            self.check(what, lay)
        t = t.clone()
        for head, value, positions in items:
            new = value(lay, t, head, extra)  # (B, T|S, Dh)
            if positions is None:
                t[:, :, head] = new
            else:
                _check_pos(positions, t.shape[1])
                t[:, positions, head] = new[:, positions] if new.dim() == 3 and new.shape[1] == t.shape[1] \
                    else new
        return t

    def k(self, lay, k):
        return self._apply("k", lay, k)

    def v(self, lay, v):
        return self._apply("v", lay, v)

    def latent(self, lay, c):
        return self._apply("latent", lay, c)

    def z(self, lay, z, v):
        z = self._apply("z", lay, z)
        return self._apply("pattern", lay, z, v)

    def wants_kv(self, lay):
        return any(w in ("k", "v", "pattern", "latent") for w, _ in self.edits)


def _check_pos(positions: list[int], n: int) -> None:
    bad = [p for p in positions if not -n <= p < n]
    if bad:
        raise ValueError(f"positions {bad} out of range for a sequence of {n}")


def _range_check(heads_by_what: dict[str, list[tuple[int, int]]]):
    def check(what: str, lay: Layer) -> None:
        n = lay.Hkv if what in ("k", "v") else 1 if what == "latent" else lay.H
        bad = [h for layer, h in heads_by_what.get(what, ()) if layer == lay.index and h >= n]
        if bad:
            kind = "key/value heads" if what in ("k", "v") else "query heads"
            raise ValueError(f"head(s) {bad} out of range in layer {lay.index}, which has {n} {kind} (0..{n - 1})")
    return check


@contextmanager
def _installed(model, handler: _Edits, heads: list[tuple[int, int]]):
    engine = Engine(model, handler)
    with engine.installed():
        yield
    # the layers met by forwards inside: a layer asked for that never ran is a user mistake
    n = len(engine.layers)
    if n:
        bad = sorted({layer for layer, _ in heads if layer >= n})
        if bad:
            raise ValueError(f"layer(s) {bad} out of range: this model has {n} attention layers (0..{n - 1})")


def _same_shape(name: str, ref: Tensor, t: Tensor, lay: Layer) -> None:
    if ref.dim() == t.dim() and ref.shape[2] != t.shape[2]:
        raise ValueError(f"{name} of layer {lay.index} has {ref.shape[2]} heads (shape {tuple(ref.shape)}) but this "
                         f"model's layer {lay.index} has {t.shape[2]} (shape {tuple(t.shape)}): record it from this "
                         "model, or one with the same heads")
    if ref.shape != t.shape:
        raise ValueError(f"{name} of layer {lay.index} has shape {tuple(ref.shape)} but this run's is "
                         f"{tuple(t.shape)}: batch and positions must match (record the same-shaped inputs)")


def _same_heads(name: str, ref: Tensor, lay: Layer, t: Tensor) -> None:
    """A mean `(H, Dv)` of the reference against this layer's z `(B, T, H, Dv)`."""
    if ref.shape != (t.shape[2], t.shape[3]):
        raise ValueError(f"{name} of layer {lay.index} is over {ref.shape[0]} heads of width {ref.shape[1]} but this "
                         f"model's layer {lay.index} has {t.shape[2]} of width {t.shape[3]}: record the reference "
                         "from this model, or one with the same heads")


@contextmanager
def ablate(model, heads, how: str = "zero", reference: Recording | None = None):
    """Knock out query heads in every forward inside the context.

    Args:
        model: a transformers model on attn_implementation="multihead", or a module
            built from multihead's Attention/LatentAttention.
        heads: (layer, head) pairs of query heads.
        how: "zero" (the head's output z is 0), "mean" (z is the mean of `reference`'s z
            of that head over batch and positions, padding excluded) or "resample" (z is
            taken from `reference`, a recording of other inputs of the same shape).
        reference: a `Recording` with "z" of those layers (for "mean" and "resample").

    Nesting and exceptions restore the model exactly: no weight is touched, every hook
    goes when the context ends.
    """
    check_model(model)
    pairs = check_heads(heads)
    if how not in HOWS:
        raise ValueError(f"how must be one of {', '.join(map(repr, HOWS))}; received {how!r}")
    if how == "zero":
        if reference is not None:
            raise ValueError("how='zero' takes no reference; pass how='mean' or 'resample' to use one")
    elif not isinstance(reference, Recording):
        raise TypeError(f"how={how!r} needs reference=, a Recording with 'z' of the ablated layers "
                        f"(multihead.heads.record(model, other_inputs)); received {type(reference).__name__}")
    handler = _Edits()
    handler.check = _range_check({"z": pairs})
    means: dict[int, Tensor] = {}
    for layer, head in pairs:
        if how == "zero":
            def value(lay, t, h, _):
                return t.new_zeros(())
        elif how == "mean":
            if layer not in means:
                z = reference["z", layer]  # (B, T, H, Dv)
                keep = reference.padding
                if keep is not None and keep.shape == z.shape[:2]:
                    means[layer] = z[keep].mean(0)  # (H, Dv): over the real tokens
                else:
                    means[layer] = z.flatten(0, 1).mean(0)

            def value(lay, t, h, _, m=means[layer]):
                _same_heads("the reference's mean z", m, lay, t)
                return m[h].to(t.dtype)
        else:
            ref = reference["z", layer]

            def value(lay, t, h, _, ref=ref):
                _same_shape("reference z", ref, t, lay)
                return ref[:, :, h].to(t.dtype)
        handler.add("z", layer, head, value, None)
    with _installed(model, handler, pairs):
        yield model


@contextmanager
def patch(model, recording: Recording, heads, positions=None, what: str = "z"):
    """Write a recording's values of chosen heads into every forward inside the context.

    Args:
        recording: a `Recording` (from `record`) holding `what` of the heads' layers.
        heads: (layer, head) pairs: query heads for "z" and "pattern", key/value heads
            for "k" and "v".
        positions: None for all, or the positions to patch (query positions for "z" and
            "pattern", key positions for "k" and "v").
        what: "z", "k", "v", or "pattern" (the head's output becomes the recorded
            pattern times this run's values: z_h = pattern_h @ v_kv(h)).
    """
    check_model(model)
    check_what(what, ("z", "k", "v", "pattern", "latent"))
    if not isinstance(recording, Recording):
        raise TypeError(f"recording must be a multihead.heads.Recording (from record()); "
                        f"received {type(recording).__name__}")
    pairs = check_heads(heads)
    pos = check_positions(positions)
    handler = _Edits()
    handler.check = _range_check({what: pairs})
    for layer, head in pairs:
        src = recording[what, layer]
        if what == "pattern":
            def value(lay, z, h, v, p=src):
                if v is None:
                    raise ValueError(f"layer {lay.index}: no values seen in this forward to apply a pattern to")
                if p.shape[0] != z.shape[0] or p.shape[1] != lay.H or p.shape[2] != z.shape[1] or \
                        p.shape[3] != v.shape[1]:
                    raise ValueError(f"recorded pattern of layer {lay.index} is {tuple(p.shape)}; this run needs "
                                     f"({z.shape[0]}, {lay.H}, {z.shape[1]}, {v.shape[1]})")
                kv = h // (lay.H // v.shape[2])
                return (p[:, h].to(v.dtype) @ v[:, :, kv]).to(z.dtype)  # (B, T, S) @ (B, S, Dv)
        else:
            def value(lay, t, h, _, ref=src):
                _same_shape(f"recorded {what}", ref, t, lay)
                return ref[:, :, h].to(t.dtype)
        handler.add(what, layer, head, value, pos)
    with _installed(model, handler, pairs):
        yield model

