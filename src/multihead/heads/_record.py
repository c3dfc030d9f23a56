"""`record`: per-head activations of one run, and the `Recording` that holds them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from multihead.checks import is_int
from multihead.heads.engine import Engine, Handler, Layer, batch_size, check_model, logits_of, padding_of, run

WHATS = ("z", "result", "k", "v", "pattern", "latent")


def check_what(what, valid: Sequence[str] = WHATS) -> str:
    if not isinstance(what, str):
        raise TypeError(f"what must be one of {', '.join(map(repr, valid))}; received {what!r} ({type(what).__name__})")
    if what not in valid:
        raise ValueError(f"what must be one of {', '.join(map(repr, valid))}; received {what!r}")
    return what


class Recording:
    """Per-head activations of one run, by `(what, layer)`.

    `rec["z", 3]` `(B, T, H, Dv)`; `rec["result", 3]` `(B, T, H, C)` (each head's share
    of the attention output, after the output projection, without its bias); `rec["k", 3]`
    `(B, S, Hkv, D)`; `rec["v", 3]` `(B, S, Hkv, Dv)`; `rec["pattern", 3]` `(B, H, T, S)`.
    `layers` lists every attention layer of the model as the run met it (`Layer`: index,
    module, H, Hkv, D, Dv), `logits` the run's logits, `padding` the `(B, T)` real-token
    mask of the inputs (None when they carry none).
    """

    def __init__(self, data: dict, layers: list[Layer], logits: Tensor | None, padding: Tensor | None,
                 batch: int):
        self.data = data
        self.layers = layers
        self.logits = logits
        self.padding = padding
        self.batch = batch

    def __getitem__(self, key) -> Tensor:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise KeyError(f"index a Recording by (what, layer), e.g. rec['z', 0]; received {key!r}")
        if key not in self.data:
            have = sorted({w for w, _ in self.data})
            raise KeyError(f"{key!r} was not recorded; this recording holds {have} for layers "
                           f"{sorted({i for _, i in self.data})}")
        return self.data[key]

    def __contains__(self, key) -> bool:
        return key in self.data

    def keys(self):
        return self.data.keys()

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        whats = sorted({w for w, _ in self.data})
        return f"Recording({whats}, layers={len(self.layers)}, batch={self.batch})"


class _Recorder(Handler):
    def __init__(self, what: set[str], layers: set[int] | None):
        self.what = what
        self.layers = layers
        self.data: dict = {}

    def _on(self, lay: Layer) -> bool:
        return self.layers is None or lay.index in self.layers

    def k(self, lay, k):
        if "k" in self.what and self._on(lay):
            self.data["k", lay.index] = k.detach().clone()
        return k

    def v(self, lay, v):
        if "v" in self.what and self._on(lay):
            self.data["v", lay.index] = v.detach().clone()
        return v

    def latent(self, lay, c):
        if "latent" in self.what and self._on(lay):
            self.data["latent", lay.index] = c.detach().clone()
        return c

    def z(self, lay, z, v):
        if self.what & {"z", "result"} and self._on(lay):
            self.data["z", lay.index] = z.detach().clone()
        return z

    def wants_weights(self, lay):
        return "pattern" in self.what and self._on(lay)

    def wants_kv(self, lay):
        return bool(self.what & {"k", "v"}) and self._on(lay)

    def weights(self, lay, w):
        self.data["pattern", lay.index] = w.detach().clone()


def _as_set(what) -> set[str]:
    items = (what,) if isinstance(what, str) else tuple(what)
    if not items:
        raise ValueError(f"what must name at least one of {', '.join(WHATS)}; received {what!r}")
    for w in items:
        check_what(w)
    return set(items)


def check_layers(layers, n: int | None = None) -> set[int] | None:
    if layers is None:
        return None
    items = [layers] if isinstance(layers, int) else list(layers) if isinstance(layers, Iterable) else None
    if items is None or not all(is_int(i) for i in items):
        raise TypeError(f"layers must be None, an int or a sequence of ints; received {layers!r}")
    if n is not None:
        bad = [i for i in items if not 0 <= i < n]
        if bad:
            raise ValueError(f"layer(s) {bad} out of range: this model has {n} attention layers (0..{n - 1})")
    return set(items)


def record(model, inputs, what=("z",), layers=None) -> Recording:
    """Run `model` on `inputs` once and keep the per-head activations asked for.

    Args:
        model: a transformers model on attn_implementation="multihead", or a module built
            from multihead's Attention/LatentAttention.
        inputs: what the model's forward takes: a tensor (input_ids) or a mapping of
            keyword arguments (a tokenizer's BatchEncoding).
        what: any of "z" (heads' outputs before the output projection), "result" (each
            head's contribution after it), "k", "v" (per KV head), "pattern" (attention
            weights; the only one that makes a (T, S) tensor, and only for `layers`),
            "latent" (MLA modules: kv_a_proj's output `(B, S, 1, R + rope_dim)`).
        layers: None for every layer, or the layer indices to keep.

    Returns a `Recording`.
    """
    check_model(model)
    whats = _as_set(what)
    wanted = check_layers(layers)
    rec = _Recorder(whats, wanted)
    engine = Engine(model, rec)
    with engine.installed(), torch.no_grad():
        out = run(model, inputs)
    found = engine.ordered()
    if not found:
        raise ValueError(f"no attention layer of {type(model).__name__} ran through multihead in this forward")
    check_layers(layers, len(found))
    if "result" in whats:
        for lay in found:
            if ("z", lay.index) in rec.data:
                rec.data["result", lay.index] = head_results(model, lay, rec.data["z", lay.index])
        if "z" not in whats:
            for key in [k for k in rec.data if k[0] == "z"]:
                del rec.data[key]
    return Recording(rec.data, found, logits_of(out).detach(), padding_of(inputs), batch_size(inputs))


def out_projection(model, lay: Layer) -> Tensor:
    """The output projection's weight `(C, H * Dv)` of a layer (what turns z into the output)."""
    m = lay.module
    if lay.kind != "hf":
        return m.head_access().o.weight
    from multihead.heads._hf import hf_out_projection

    return hf_out_projection(model, m)


def head_results(model, lay: Layer, z: Tensor) -> Tensor:
    """Each head's share of the attention output `(B, T, H, C)` from z `(B, T, H, Dv)`."""
    W = out_projection(model, lay)  # (C, H * Dv)
    C = W.shape[0]
    W = W.detach().view(C, lay.H, -1).to(z.dtype)  # (C, H, Dv)
    return torch.einsum("bthd,chd->bthc", z, W)
