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
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from multihead.heads._engine import Engine, Handler, Layer, batch_size, check_model, logits_of, parents_of
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


def _blocks(model: nn.Module, layers: list[Layer]) -> dict[int, nn.Module]:
    """Where each layer's variants join the batch. Layers of every stack but the last
    (an encoder-decoder's encoder) join at the model's input: what sits between two stacks
    (the decoder's masks built from the encoder's batch and the inputs') is no block's."""
    parents = parents_of(model)
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


class _FromCache:
    """Block pre-hooks of a chunk when the corrupted run's block inputs are cached: blocks
    below the first patched layer run on one row (their output is replaced), the first
    patched block starts from the cached input repeated once per variant, later patched
    blocks append their cached input for their variants. No corrupted row is recomputed."""

    def __init__(self, B: int, per_block: dict[int, int], cache: dict[int, tuple]):
        self.B, self.per_block, self.cache = B, per_block, cache
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
            merged = {**kwargs, **ckw}  # what the forward adds (the intervention) stays
            return (tuple(_grow(a, B, self.rows, B) for a in cargs),
                    {k: _grow(v, B, self.rows, B) for k, v in merged.items()})
        rows, new = self.rows, self.rows + n * B
        self.rows = new
        if n == 0:
            return tuple(_grow(a, rows, rows, B) for a in args), {k: _grow(v, rows, rows, B) for k, v in kwargs.items()}
        cargs, ckw = self.cache[id(block)]
        return (tuple(_append(a, c, rows, n, B) for a, c in zip(args, cargs)),
                {k: _append(v, ckw.get(k), rows, n, B) for k, v in kwargs.items()})


class _ScanHandler(Handler):
    """Writes the clean head into each variant's rows at its layer."""

    def __init__(self, what: str, clean: Recording, B: int, positions: list[int] | None):
        self.what = what
        self.clean = clean
        self.B = B
        self.positions = positions
        self.rows: dict[int, tuple[int, list[int]]] = {}  # layer -> (first row, heads of its variants)

    def _write(self, lay: Layer, t: Tensor, v: Tensor | None = None) -> Tensor:
        entry = self.rows.get(lay.index)
        if entry is None:
            return t
        start, hs = entry
        B, pos = self.B, self.positions
        t = t.clone()
        src = self.clean[self.what, lay.index]
        for i, h in enumerate(hs):
            r = slice(start + i * B, start + (i + 1) * B)
            if self.what == "pattern":
                kv = h // (lay.H // v.shape[2])
                new = src[:, h].to(v.dtype) @ v[r, :, kv]  # (B, T, S) @ (B, S, Dv)
            else:
                new = src[:, :, h]
            if pos is None:
                t[r, :, h] = new.to(t.dtype)
            else:
                t[r, pos, h] = new[:, pos].to(t.dtype)
        return t

    def k(self, lay, k):
        return self._write(lay, k) if self.what == "k" else k

    def v(self, lay, v):
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
    rec = record(model, clean, what=(what,))
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
    blocks = _blocks(model, layers)
    block_list = list({id(b): b for b in blocks.values()}.values())
    no_cache = _takes_use_cache(model)
    out = torch.full((len(layers), max(n_heads)), math.nan)
    last_stack = {i for i, b in blocks.items() if b is not model}
    cache: dict[int, tuple] = {}
    if last_stack:  # the corrupted run once, keeping what each block of the last stack is handed
        def keep(block, args, kwargs):
            cache[id(block)] = (args, dict(kwargs))
        handles = [b.register_forward_pre_hook(keep, with_kwargs=True) for b in block_list if b is not model]
        try:
            with torch.no_grad():
                _call(model, corrupted, no_cache)
        finally:
            for h in handles:
                h.remove()
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
        handler = _ScanHandler(what, rec, B, pos)
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
        grower = _FromCache(B, per_block, cache) if cached else _Grower(B, per_block)
        hooked = [b for b in block_list if b is not model] if cached else block_list
        handles = [b.register_forward_pre_hook(grower.hook, with_kwargs=True) for b in hooked]
        handles.append(model.register_forward_pre_hook(lambda m, a, g=grower: g.begin()))
        try:
            with Engine(model, handler).installed(), torch.no_grad():
                logits = logits_of(_call(model, corrupted, no_cache))
        finally:
            for h in handles:
                h.remove()
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
