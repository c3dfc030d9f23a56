"""`patch_scan` (activation patching of every head, exactly, in few batched forwards) and
`attribution_scan` (its first-order approximation: Nanda 2023, "Attribution patching").

How a scan stays exact and cheap. A variant (one head patched) differs from the
corrupted run only from its layer on. The corrupted run is made once, keeping what each
block (each layer's element of the model's `nn.ModuleList`) is handed. A scan forward then
carries a few variants: the blocks below the first of them run on one row (their output
is replaced), each variant's block starts from the cached input, one copy of the B
corrupted rows per variant (a forward pre-hook puts them there, and repeats the per-batch
tensors the model hands each block: masks, rotary angles), and at the patched layer a
handler writes the clean head into the variant's rows (z, k, v, or z = clean pattern @ v).
So each variant costs the layers from its own upward and nothing below; the kernels stay
the fused ones; no (T, S) tensor exists unless `what="pattern"` (the clean pattern
itself). Row r of a variant is a copy of corrupted row r % B. An encoder-decoder's
encoder layers are different: the decoder builds its masks from the encoder's output
between the two stacks, so their variants join at the model's input instead.

A block is the element of a `nn.ModuleList` that holds the attention module (the
model itself when there is none). The cache holds one B-row input per block.

Causal models skip the shared prefix. When clean and corrupted agree on their first p
positions, a causal model's two runs agree there at every layer, and so does every
variant: a variant's blocks then run on positions [p, T) only, their attention reading
the corrupted run's cached keys and values for [0, p) (bottom-right causal, as a KV
cache), and the last block's output gets the corrupted prefix back before the model's
head. Taken only for a transformers decoder whose every block holds an attention layer
on multihead's function, whose attention modules say `is_causal`, whose block inputs
are all of a known kind (hidden states, 4-D masks, position ids / embeddings / cache
positions), and whose two runs are checked equal (every layer's z, to float rounding)
on the prefix; otherwise the full positions run. An IOI-style pair (one token changed
in the middle) halves the work above each patched layer.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from multihead.heads._engine import (
    KEYWORD,
    WEIGHTS_KEYWORD,
    Engine,
    Handler,
    Layer,
    batch_size,
    check_model,
    is_hf,
    logits_of,
    multihead_modules,
    parents_of,
)
from multihead.heads._interventions import check_positions
from multihead.heads._record import Recording, check_what, record
from multihead.masks import MaskMod

SCANS = ("z", "k", "v", "pattern", "latent")
# The default bound on a scan forward's rows (variants x B): bigger batches cost more per row
# here, and memory grows with them (GPT-2-shaped, B 4, T 256: 202 MiB peak at 16 rows, 408 at 32).
ROWS_PER_RUN = 16


def block_of(model: nn.Module, module: nn.Module, parents: dict[int, nn.Module]) -> nn.Module:
    """The block (an item of a ModuleList) that holds attention `module`; the model if none does."""
    x = next((m for m in model.modules() if getattr(m, "mla", None) is module), module)  # a patched DeepSeek layer
    while id(x) in parents:
        p = parents[id(x)]
        if isinstance(p, nn.ModuleList):
            return x
        x = p
    return model


def _grow(x, rows: int, new_rows: int, B: int):
    """x as the grown batch sees it: rows [0, rows) kept, copies of [0, B) appended; a
    per-batch tensor (B rows) repeated; anything else (broadcast dims, 1-D) unchanged."""
    if isinstance(x, Tensor):
        if x.dim() < 2 or new_rows == rows == B:
            return x
        if x.shape[0] == rows:
            extra = (new_rows - rows) // B
            return x if extra == 0 else torch.cat([x, x[:B].repeat(extra, *([1] * (x.dim() - 1)))])
        if x.shape[0] == B:
            return x.repeat(new_rows // B, *([1] * (x.dim() - 1)))
        return x
    if isinstance(x, MaskMod) and new_rows > B:
        fn = x.fn
        return MaskMod(lambda b, h, q, k: fn(b % B, h, q, k), x.name, top_left=x.top_left, relative=x.relative)
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_grow(t, rows, new_rows, B) for t in x)
    if isinstance(x, list):
        return [_grow(t, rows, new_rows, B) for t in x]
    return x


def _blocks(model: nn.Module, layers: list[Layer], parents: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """Where each layer's variants join the batch. Layers of every stack but the last
    (an encoder-decoder's encoder) join at the model's input: what sits between two stacks
    (the decoder's masks built from the encoder's batch and the inputs') is no block's."""
    blocks = {lay.index: block_of(model, lay.module, parents) for lay in layers}
    stacks = [parents.get(id(b)) for b in blocks.values()]
    last = stacks[-1]
    return {i: (b if stack is last else model) for (i, b), stack in zip(blocks.items(), stacks)}


class _Grower:
    """Block pre-hooks that add the variants of their layers to the batch."""

    def __init__(self, B: int, per_block: dict[int, int]):
        self.B = B
        self.per_block = per_block  # id(block) -> variants joining there
        self.rows = B

    def begin(self):
        self.rows = self.B

    def hook(self, block, args, kwargs):
        n = self.per_block.get(id(block), 0)
        if self.rows == self.B and n == 0:
            return None
        new_rows = self.rows + n * self.B
        args = tuple(_grow(a, self.rows, new_rows, self.B) for a in args)
        kwargs = {k: _grow(v, self.rows, new_rows, self.B) for k, v in kwargs.items()}
        self.rows = new_rows
        return args, kwargs


def _shrink(x, B: int):
    """A block below every patched layer runs on one row: its result is never used."""
    if isinstance(x, Tensor):
        return x[:1] if x.dim() >= 2 and x.shape[0] == B else x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_shrink(t, B) for t in x)
    if isinstance(x, list):
        return [_shrink(t, B) for t in x]
    return x


def _append(x, cached, rows: int, n: int, B: int):
    """x (the variants so far, `rows` rows) with n copies of the corrupted run's own value appended."""
    if isinstance(x, Tensor) and isinstance(cached, Tensor) and x.dim() >= 2:
        if x.shape[0] == rows:
            c = cached if cached.shape[0] == B else cached.expand(B, *cached.shape[1:])
            return torch.cat([x, c.repeat(n, *([1] * (c.dim() - 1)))])
        return _grow(x, rows, rows + n * B, B)
    if isinstance(x, tuple) and isinstance(cached, tuple) and not hasattr(x, "_fields") and len(x) == len(cached):
        return tuple(_append(a, c, rows, n, B) for a, c in zip(x, cached))
    if isinstance(x, list) and isinstance(cached, list) and len(x) == len(cached):
        return [_append(a, c, rows, n, B) for a, c in zip(x, cached)]
    return _grow(x, rows, rows + n * B, B)


class _NoCut(Exception):
    """A block input of a kind the prefix skip does not know how to cut."""


def _cut(x, key, T: int, p: int):
    """Positions [p, T) of one block input; `key` is its keyword or its place among the
    positional arguments. Raises _NoCut for a T-long input of an unknown kind."""
    if isinstance(x, Tensor):
        if x.dim() == 0 or T not in x.shape:
            return x
        if key in (0, "hidden_states") and x.dim() == 3:
            return x[:, p:] if x.shape[1] == T else x
        if x.dim() == 4 and x.shape[-2] == T and x.shape[-1] == T:  # a mask (B, 1|H, T, S): its query rows
            return x[..., p:, :]
        if isinstance(key, str) and key.startswith("position_embeddings") and x.dim() >= 2 and x.shape[-2] == T:
            return x[..., p:, :]  # rotary angles as one (complex) tensor (B|1, T, D)
        if key == "position_ids" and x.shape[-1] == T:
            return x[..., p:]
        if key == "cache_position" and x.dim() == 1:
            return x[p:]
        raise _NoCut(key)
    if isinstance(x, MaskMod):  # built for T == S, where both readings of q_idx agree; the last queries
        return MaskMod(x.fn, x.name, relative=x.relative) if x.top_left else x  # read bottom-right
    if isinstance(x, (tuple, list)) and isinstance(key, str) and key.startswith("position_embeddings"):
        return type(x)(t[..., p:, :] if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[-2] == T else t
                       for t in x)  # rotary (cos, sin), each (B|1, T, D)
    if isinstance(x, (tuple, list, dict)):
        items = x.values() if isinstance(x, dict) else x
        if any(isinstance(t, Tensor) for t in items):
            raise _NoCut(key)
    return x


def _cut_all(args, kwargs, cut: tuple[int, int] | None):
    if cut is None:
        return args, kwargs
    T, p = cut
    return (tuple(_cut(a, i, T, p) for i, a in enumerate(args)),
            {k: _cut(v, k, T, p) for k, v in kwargs.items()})


def _cut_cache(cache: dict[int, tuple], cut: tuple[int, int]) -> dict[int, tuple] | None:
    """Every block's cached input on positions [p, T); None when one cannot be cut."""
    try:
        return {i: _cut_all(args, kwargs, cut) for i, (args, kwargs) in cache.items()}
    except _NoCut:
        return None


def _shared_prefix(clean, corrupted) -> tuple[int, int]:
    """(p, T): how many leading positions every input of the two runs shares, and the
    inputs' length; (0, 0) when that cannot be read off the inputs."""
    if isinstance(clean, Tensor) and isinstance(corrupted, Tensor):
        pairs = [(clean, corrupted)]
    elif hasattr(clean, "keys") and hasattr(corrupted, "keys") and set(clean.keys()) == set(corrupted.keys()):
        pairs = [(clean[k], corrupted[k]) for k in clean.keys()]
    else:
        return 0, 0
    T, p = None, None
    for a, b in pairs:
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            if isinstance(a, Tensor) or isinstance(b, Tensor) or a is not b and a != b:
                return 0, 0
            continue
        if a.dim() < 2 or a.shape != b.shape or (T is not None and a.shape[1] != T):
            return 0, 0
        T = a.shape[1]
        differ = (a != b).reshape(a.shape[0], T, -1).any(dim=2).any(dim=0)
        first = int(differ.nonzero()[0, 0]) if bool(differ.any()) else T
        p = first if p is None else min(p, first)
    return (0, 0) if T is None else (p, T)


def _causal_stack(model: nn.Module, layers: list[Layer], blocks: dict[int, nn.Module],
                  parents: dict[int, nn.Module]) -> nn.ModuleList | None:
    """The ModuleList of blocks when the prefix skip may apply (a transformers decoder, every
    block an attention layer on multihead's function that says it is causal), else None."""
    if not is_hf(model) or multihead_modules(model) or getattr(model.config, "is_encoder_decoder", False):
        return None
    if any(getattr(lay.module, "is_causal", False) is not True for lay in layers):
        return None
    stacks = {id(parents.get(id(b))) for b in blocks.values()}
    stack = parents.get(id(next(iter(blocks.values()))))
    if len(stacks) != 1 or not isinstance(stack, nn.ModuleList):
        return None
    held = {id(b) for b in blocks.values()}
    return stack if all(id(b) in held for b in stack) else None


_SKIP_PREFIX = True  # tests turn it off to compare the two paths


def _first(out) -> Tensor:
    return out if isinstance(out, Tensor) else out[0]


def _unskip(out, head: Tensor, B: int):
    """A block's output on positions [p, T) of its rows, with the corrupted run's [0, p) put back."""
    x = _first(out)
    full = torch.cat([head.repeat(x.shape[0] // B, *([1] * (x.dim() - 1))), x], dim=1)
    return full if isinstance(out, Tensor) else (full, *out[1:])


def _prefix_holds(rec: Recording, prefix: _Prefix, layers: list[Layer], cache: dict[int, tuple], T: int,
                  p: int, B: int) -> bool:
    """Whether the prefix skip is exact here: both runs' heads agree on the shared prefix at
    every layer (what a causal model does; to float rounding: a mixture of experts batches
    each expert's tokens, so its sums differ in the last bits), and no mask lets the prefix
    see a later key."""
    for lay in layers:
        got = prefix.data.get(("z", lay.index))
        if got is None or ("k", lay.index) not in prefix.data:
            return False
        want = rec["z", lay.index][:, :p]
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6 * (1 + float(want.abs().max()))):
            return False
    return not any(_sees_ahead(x, T, p, B) for args, kwargs in cache.values() for x in (*args, *kwargs.values()))


def _sees_ahead(x, T: int, p: int, B: int) -> bool:
    """Whether a mask lets a query of the prefix [0, p) see a key of [p, T) (a bidirectional
    span, a prefix-LM): then the prefix is not the corrupted run's in a variant."""
    if isinstance(x, Tensor) and x.dim() == 4 and x.shape[-2] == T and x.shape[-1] == T:
        corner = x[..., :p, p:]
        return bool(corner.any()) if corner.dtype == torch.bool else \
            bool((corner > torch.finfo(corner.dtype).min / 2).any())
    if isinstance(x, MaskMod):
        b = torch.arange(B)[:, None, None, None]  # (head 0: masks here do not vary by head)
        q = torch.arange(p)[None, None, :, None]
        kv = torch.arange(p, T)[None, None, None, :]
        return bool(torch.as_tensor(x(b, torch.zeros_like(b), q, kv)).any())
    return False


class _Prefix(Handler):
    """The corrupted run's keys, values and heads' outputs on the shared prefix."""

    def __init__(self, p: int):
        self.p = p
        self.data: dict[tuple[str, int], Tensor] = {}

    def k(self, lay, k):
        self.data["k", lay.index] = k[:, :self.p].clone()
        return k

    def v(self, lay, v):
        self.data["v", lay.index] = v[:, :self.p].clone()
        return v

    def z(self, lay, z, v):
        self.data["z", lay.index] = z[:, :self.p].clone()
        return z


class _FromCache:
    """Block pre-hooks of a chunk when the corrupted run's block inputs are cached: blocks
    below the first patched layer run on one row (their output is replaced), the first
    patched block starts from the cached input repeated once per variant, later patched
    blocks append their cached input for their variants. No corrupted row is recomputed.
    With `cut`, the cache holds the inputs on [p, T) already; what the forward hands the
    blocks is cut here."""

    def __init__(self, B: int, per_block: dict[int, int], cache: dict[int, tuple], cut: tuple[int, int] | None = None):
        self.B, self.per_block, self.cache = B, per_block, cache
        self.cut = cut  # (T, p): variants run on positions [p, T) (the shared prefix skipped)
        self.rows = 0

    def begin(self):
        self.rows = 0

    def hook(self, block, args, kwargs):
        n, B = self.per_block.get(id(block), 0), self.B
        if self.rows == 0:
            if n == 0:
                return tuple(_shrink(a, B) for a in args), {k: _shrink(v, B) for k, v in kwargs.items()}
            cargs, ckw = self.cache[id(block)]
            self.rows = n * B
            merged = {**_cut_all((), kwargs, self.cut)[1], **ckw}  # what the forward adds (the intervention) stays
            return (tuple(_grow(a, B, self.rows, B) for a in cargs),
                    {k: _grow(v, B, self.rows, B) for k, v in merged.items()})
        args, kwargs = _cut_all(args, kwargs, self.cut)
        rows, new = self.rows, self.rows + n * B
        self.rows = new
        if n == 0:
            return tuple(_grow(a, rows, rows, B) for a in args), {k: _grow(v, rows, rows, B) for k, v in kwargs.items()}
        cargs, ckw = self.cache[id(block)]
        return (tuple(_append(a, c, rows, n, B) for a, c in zip(args, cargs)),
                {k: _append(v, ckw.get(k), rows, n, B) for k, v in kwargs.items()})


class _ScanHandler(Handler):
    """Writes the clean head into each variant's rows at its layer."""

    def __init__(self, what: str, clean: Recording, B: int, positions: list[int] | None,
                 prefix: dict | None = None, cut: tuple[int, int] | None = None):
        self.what = what
        self.clean = clean
        self.B = B
        self.positions = positions
        self.prefix = prefix  # the corrupted run's ("k"|"v", layer) on [0, p) (the prefix skip)
        self.cut = cut  # (T, p)
        self.rows: dict[int, tuple[int, list[int]]] = {}  # layer -> (first row, heads of its variants)

    def _skipped(self, t: Tensor) -> int:
        """p when `t` (positions on dim 1) holds only positions [p, T), else 0."""
        return self.cut[1] if self.cut is not None and t.shape[1] == self.cut[0] - self.cut[1] else 0

    def _extend(self, what: str, lay: Layer, t: Tensor) -> Tensor:
        """Keys/values of positions [p, T) with the corrupted run's [0, p) put in front."""
        if not self._skipped(t):
            return t
        head = self.prefix[what, lay.index]
        return torch.cat([head.repeat(t.shape[0] // self.B, 1, 1, 1).to(t.dtype), t], dim=1)

    def _write(self, lay: Layer, t: Tensor, v: Tensor | None = None) -> Tensor:
        entry = self.rows.get(lay.index)
        if entry is None:
            return t
        start, hs = entry
        B, pos = self.B, self.positions
        off = self._skipped(t)  # z on positions [off, T): the shared prefix is the corrupted run's already
        if pos is not None and off:
            T = self.cut[0]
            pos = [q % T - off for q in pos if q % T >= off]
            if not pos:
                return t
        t = t.clone()
        src = self.clean[self.what, lay.index]
        for i, h in enumerate(hs):
            r = slice(start + i * B, start + (i + 1) * B)
            if self.what == "pattern":
                kv = h // (lay.H // v.shape[2])
                new = src[:, h, off:].to(v.dtype) @ v[r, :, kv]  # (B, T, S) @ (B, S, Dv)
            else:
                new = src[:, off:, h]
            if pos is None:
                t[r, :, h] = new.to(t.dtype)
            else:
                t[r, pos, h] = new[:, pos].to(t.dtype)
        return t

    def k(self, lay, k):
        k = self._extend("k", lay, k)
        return self._write(lay, k) if self.what == "k" else k

    def v(self, lay, v):
        v = self._extend("v", lay, v)
        return self._write(lay, v) if self.what == "v" else v

    def latent(self, lay, c):
        return self._write(lay, c) if self.what == "latent" else c

    def z(self, lay, z, v):
        if self.what == "z":
            return self._write(lay, z)
        if self.what == "pattern":
            return self._write(lay, z, v)
        return z

    def wants_kv(self, lay):
        return self.what != "z"


def _forward(model, corrupted, no_cache: bool, handler: Handler, grower, hooked: list, last: nn.Module | None,
             tail: list, B: int) -> Tensor:
    """One scan forward: `grower` lays out the rows, `handler` patches them; with the prefix
    skip, `last` (the last block) gets the corrupted prefix `tail[0]` back on its output."""
    handles = [b.register_forward_pre_hook(grower.hook, with_kwargs=True) for b in hooked]
    if last is not None:
        handles.append(last.register_forward_hook(lambda m, a, out: _unskip(out, tail[0], B)))
    handles.append(model.register_forward_pre_hook(lambda m, a: grower.begin()))
    try:
        with Engine(model, handler).installed(), torch.no_grad():
            return logits_of(_call(model, corrupted, no_cache))
    finally:
        for h in handles:
            h.remove()


def _call(model: nn.Module, inputs, no_cache: bool):
    if isinstance(inputs, Tensor):
        return model(inputs, use_cache=False) if no_cache else model(inputs)
    kw = {k: inputs[k] for k in inputs.keys()}
    if no_cache:
        kw.setdefault("use_cache", False)
    return model(**kw)


def _takes_use_cache(model: nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _scalar(value, where: str) -> float:
    t = torch.as_tensor(value)
    if t.numel() != 1:
        raise ValueError(f"metric must return a scalar tensor; {where} it returned shape {tuple(t.shape)}")
    return float(t.detach().float().reshape(()))


def patch_scan(model, clean, corrupted, metric: Callable[[Tensor], Tensor], what: str = "z", positions=None, *,
               variants_per_run: int | None = None) -> Tensor:
    """The metric of the corrupted run with each head patched from the clean run, one at a time.

    Args:
        model: a transformers model on attn_implementation="multihead", or a module built
            from multihead's Attention/LatentAttention.
        clean, corrupted: inputs of the same shape (a tensor of input_ids or a mapping of
            keyword arguments).
        metric: logits of one run (the output's `.logits`, or the output when it is a
            tensor; `(B, ...)` of that run's B rows) -> a scalar tensor.
        what: "z" (heads' outputs), "k", "v" (per KV head: MQA/GQA scan Hkv heads; MLA
            modules per head through the up-projection), "pattern" (z = clean pattern @
            this run's values) or, for MLA modules, "latent" (the shared latent, one column).
        positions: None for all, or the positions to patch.
        variants_per_run: how many patched copies of the batch one forward carries
            (default: 16 // B, at least 1).

    Returns `(layers, heads)` float32 (NaN where a layer has fewer heads than the widest).
    Equal to TransformerLens' `get_act_patch_attn_head_out_all_pos` (and its k/v/pattern
    siblings) on the same weights.
    """
    check_model(model)
    check_what(what, SCANS)
    if not callable(metric):
        raise TypeError(f"metric must be callable(logits) -> scalar tensor; received {type(metric).__name__}")
    pos = check_positions(positions)
    B = batch_size(corrupted)
    if batch_size(clean) != B:
        raise ValueError(f"clean and corrupted inputs must have the same batch size; received {batch_size(clean)} "
                         f"and {B}")
    p0, T = _shared_prefix(clean, corrupted)
    if pos is not None and T and any(not -T <= q < T for q in pos):
        raise ValueError(f"positions must lie in [-{T}, {T}) for inputs of {T} positions; received {positions!r}")
    skip = _SKIP_PREFIX and 0 < p0 < T and is_hf(model)
    rec = record(model, clean, what=(what, "z") if skip and what != "z" else (what,))
    layers = rec.layers
    if what == "latent" and not any(lay.kind == "latent" for lay in layers):
        raise ValueError("what='latent' patches MLA latents (multihead LatentAttention, or a DeepSeek model after "
                         "multihead.interop.hf.patch); this model has none")
    n_heads = [lay.Hkv if what in ("k", "v") else int(lay.kind == "latent") if what == "latent" else lay.H
               for lay in layers]
    # head by head, layer by layer within: a run carries head h of consecutive layers, so
    # each block adds B rows and no block runs for nothing (measured on 2 CPU cores: one
    # layer's 8 heads per run, 32 rows, was ~25% slower per row than 4-row runs)
    variants = sorted(((lay.index, h) for lay, n in zip(layers, n_heads) for h in range(n)),
                      key=lambda v: (v[1], v[0]))
    per_run = max(1, ROWS_PER_RUN // B) if variants_per_run is None else int(variants_per_run)
    if per_run < 1:
        raise ValueError(f"variants_per_run must be >= 1; received {variants_per_run!r}")
    parents = parents_of(model)
    blocks = _blocks(model, layers, parents)
    stack = _causal_stack(model, layers, blocks, parents) if skip and what != "latent" else None
    block_list = list({id(b): b for b in blocks.values()}.values())
    no_cache = _takes_use_cache(model)
    last_stack = {i for i, b in blocks.items() if b is not model}
    cache: dict[int, tuple] = {}
    cut_cache: dict[int, tuple] | None = None  # the same on positions [p0, T) (the prefix skip)
    prefix = _Prefix(p0)
    tail: list = []  # the last block's output on the prefix (the prefix skip)
    corrupted_logits: list = []
    if last_stack:  # the corrupted run once, keeping what each block of the last stack is handed
        def keep(block, args, kwargs):
            cache[id(block)] = (args, {k: v for k, v in kwargs.items() if k not in (KEYWORD, WEIGHTS_KEYWORD)})
        handles = [b.register_forward_pre_hook(keep, with_kwargs=True) for b in block_list if b is not model]
        if stack is not None:
            handles.append(stack[-1].register_forward_hook(lambda m, a, out: tail.append(_first(out)[:, :p0].clone())))
        try:
            with torch.no_grad(), Engine(model, prefix).installed() if stack is not None else nullcontext():
                corrupted_logits.append(logits_of(_call(model, corrupted, no_cache)))
        finally:
            for h in handles:
                h.remove()
        if stack is not None:
            cut_cache = _cut_cache(cache, (T, p0))
            if cut_cache is None or not _prefix_holds(rec, prefix, layers, cache, T, p0, B):
                stack = None
    cut = (T, p0) if stack is not None else None
    if cut is not None:  # the corrupted run again through the skip, nothing patched: it must give its logits
        grower = _FromCache(B, {id(stack[0]): 1}, cut_cache, cut)
        again = _forward(model, corrupted, no_cache, _ScanHandler(what, rec, B, None, prefix.data, cut), grower,
                         [b for b in block_list if b is not model], stack[-1], tail, B)
        if again.shape != corrupted_logits[0].shape or not torch.allclose(
                again, corrupted_logits[0], rtol=1e-5, atol=1e-5 * (1 + float(corrupted_logits[0].abs().max()))):
            cut = None  # a block input the cut does not read right: the full positions run
    # chunks of at most per_run variants, never mixing layers that join at the model's input
    chunks: list[list[tuple[int, int]]] = []
    for v in variants:
        if chunks and len(chunks[-1]) < per_run and (chunks[-1][0][0] in last_stack) == (v[0] in last_stack):
            chunks[-1].append(v)
        else:
            chunks.append([v])
    out = torch.full((len(layers), max(n_heads)), math.nan)
    for chunk in chunks:
        cached = chunk[0][0] in last_stack
        handler = _ScanHandler(what, rec, B, pos, prefix.data if cut else None, cut)
        per_block: dict[int, int] = {}
        first_row = 0 if cached else B
        start = first_row
        order: list[tuple[int, int]] = []
        # rows are laid out block by block, in the order the blocks run
        for blk in block_list:
            mine = [(layer, h) for layer, h in chunk if blocks[layer] is blk]
            if not mine:
                continue
            per_block[id(blk)] = len(mine)
            for layer in sorted({layer for layer, _ in mine}):
                hs = [h for lay_i, h in mine if lay_i == layer]
                handler.rows[layer] = (first_row, hs)
                order += [(layer, h) for h in hs]
                first_row += len(hs) * B
        grower = _FromCache(B, per_block, cut_cache if cut else cache, cut) if cached else _Grower(B, per_block)
        hooked = [b for b in block_list if b is not model] if cached else block_list
        logits = _forward(model, corrupted, no_cache, handler, grower, hooked, stack[-1] if cut else None, tail, B)
        if logits.shape[0] != first_row:
            raise RuntimeError(f"the scan's batch did not come out whole ({logits.shape[0]} rows, expected "
                               f"{first_row}): {type(model).__name__} reshapes its batch between blocks")
        for i, (layer, h) in enumerate(order):
            r = slice(start + i * B, start + (i + 1) * B)
            out[layer, h] = _scalar(metric(logits[r]), f"for layer {layer} head {h}")
    return out


class _Attribution(Handler):
    """Adds a zero leaf to each activation so its gradient can be read."""

    def __init__(self, what: str):
        self.what = what
        self.leaves: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def _leaf(self, lay, t):
        d = torch.zeros_like(t, requires_grad=True)
        self.leaves[lay.index] = d
        self.values[lay.index] = t.detach()
        return t + d

    def k(self, lay, k):
        return self._leaf(lay, k) if self.what == "k" else k

    def v(self, lay, v):
        return self._leaf(lay, v) if self.what == "v" else v

    def z(self, lay, z, v):
        return self._leaf(lay, z) if self.what == "z" else z


def attribution_scan(model, clean, corrupted, metric: Callable[[Tensor], Tensor], what: str = "z") -> Tensor:
    """Attribution patching: `patch_scan`'s table to first order, every head at once.

    metric(corrupted) + sum over batch, positions and head dims of (a_clean - a_corr) *
    d metric / d a, at the corrupted run (two forwards, one backward). An
    approximation: exact only where the metric is linear in the head's activation (far
    from it for heads whose patch changes the output a lot); use `patch_scan` for the
    exact table. what: "z", "k" or "v". Returns `(layers, heads)`, like `patch_scan`.
    """
    check_model(model)
    check_what(what, ("z", "k", "v"))
    rec = record(model, clean, what=(what,))
    handler = _Attribution(what)
    with Engine(model, handler).installed(), torch.enable_grad():
        m = metric(logits_of(_call(model, corrupted, _takes_use_cache(model))))
        base = _scalar(m, "on the corrupted run")
        leaves = [handler.leaves[lay.index] for lay in rec.layers]
        grads = torch.autograd.grad(m, leaves, allow_unused=True)
    n = [leaf.shape[2] for leaf in leaves]
    out = torch.full((len(leaves), max(n)), math.nan)
    for lay, g in zip(rec.layers, grads):
        delta = rec[what, lay.index] - handler.values[lay.index]  # (B, T|S, heads, Dh)
        contrib = torch.zeros(delta.shape[2]) if g is None else (delta * g).sum(dim=(0, 1, 3))
        out[lay.index, :delta.shape[2]] = base + contrib.float()
    return out
