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
in the middle) halves the work above each patched layer. The decision and its reason
come back through `patch_scan(..., info={})`: the keyword names the skip knows are in
`_cut`, the model checks in `_causal_stack`, the run checks in `_Scan.decide_prefix`.

The patched layer's attention is not run for its variants (`_Shortcut`): for what="z"
and "pattern" a variant differs from the corrupted run at its own layer only in one head's
z, and the attention output is linear in z, so its rows there are the corrupted run's
attention output plus the head's change through its columns of the output projection.
What is left per variant is that block's MLP and the blocks above. Checked on the
corrupted run (output = z @ W_o.T + a constant, layer by layer) and by a self-check
forward; declined with the reason otherwise (k, v and latent patches change the attention
itself and keep running it).

The last block runs at the read position (`multihead.heads._top`). With nothing shared,
every position of every block between the patched layer and the last differs, and the
last block's attention needs keys and values at every position; but a metric that reads
one position per row, the last (an `AtPositions`, rows rolled to end there by `_align`),
reads nothing of the last block but its output there. So the variants' last block runs
its output projection and MLP at T - 1 only (over half of a GPT-2 block's work), and its
attention kernel the query at T - 1 alone. Checked on the corrupted run (its output and
logits at T - 1 from the trimmed block) and declined with the reason otherwise (a plain
metric, one reading several positions or another one, a block without an `mlp` or with
several attention layers), in `info["last_block_reason"]`.

Each call holds its own state (`_Scan`) and its hooks act only in its own thread, so two
threads may scan one model at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from multihead.heads._align import aligned, unchecked
from multihead.heads._in_place import in_place_activations
from multihead.heads._inputs import (
    call,
    check_inputs,
    check_metric,
    check_variants_per_run,
    scalar,
    takes_use_cache,
    with_keywords,
)
from multihead.heads._interventions import check_positions
from multihead.heads._ranks import Ranks, check_group, fingerprint, pack, unpack
from multihead.heads._record import Recording, check_what, out_projection, record
from multihead.heads._top import LastBlock, last_block
from multihead.heads.engine import (
    KEYWORD,
    WEIGHTS_KEYWORD,
    Engine,
    Handler,
    Hooks,
    Layer,
    check_grad_mode,
    check_model,
    forward_takes,
    is_hf,
    logits_of,
    multihead_modules,
    parents_of,
)
from multihead.heads.metrics import AtPositions
from multihead.heads.progress import Progress, check_progress
from multihead.masks import MaskMod

SCANS = ("z", "k", "v", "pattern", "latent")
# The default bound on a scan forward's rows (variants x B): bigger batches cost more per row
# here, and memory grows with them (GPT-2-shaped, B 4, T 256: 202 MiB peak at 16 rows, 408 at 32).
ROWS_PER_RUN = 16
# ... unless its rows are short: then up to this many row-positions, for a forward of a few
# positions a row is mostly per-call overhead and small matrix products (SmolLM2 on 8 IOI
# pairs, 10 positions a row after the prefix skip: 25 variants a forward take 0.62 of the
# CPU time of 2 a forward).
POSITIONS_PER_RUN = 2048
# The automatic bound on one scan forward's memory (its logits and activations; what the
# scan holds for the whole call, the clean and corrupted runs' per-layer tensors, is apart)
MEMORY_PER_RUN = 1 << 30


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


def one_row(x, B: int):
    """A block below every patched layer runs on one row: its result is never used."""
    if isinstance(x, Tensor):
        return x[:1] if x.dim() >= 2 and x.shape[0] == B else x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(one_row(t, B) for t in x)
    if isinstance(x, list):
        return [one_row(t, B) for t in x]
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


def _cut_cache(cache: dict[int, tuple], cut: tuple[int, int]) -> tuple[dict[int, tuple] | None, str]:
    """(every block's cached input on positions [p, T), ""), or (None, why one cannot be cut)."""
    try:
        return {i: _cut_all(args, kwargs, cut) for i, (args, kwargs) in cache.items()}, ""
    except _NoCut as err:
        where = err.args[0]
        name = f"keyword {where!r}" if isinstance(where, str) else f"positional argument {where}"
        return None, (f"a block takes {name}, which holds the T positions and is of no kind the skip knows how to "
                      "cut (hidden_states, a 4-D mask, position_ids, position_embeddings, cache_position)")


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
                  parents: dict[int, nn.Module]) -> tuple[nn.ModuleList | None, str]:
    """(the ModuleList of blocks, "") when the prefix skip may apply (a transformers decoder,
    every block an attention layer on multihead's function that says it is causal), else
    (None, the reason)."""
    if not is_hf(model):
        return None, "not a transformers model (the skip reads transformers' block inputs)"
    if multihead_modules(model):
        return None, "its attention runs in multihead modules (a patched DeepSeek), whose keys the skip does not read"
    if getattr(model.config, "is_encoder_decoder", False):
        return None, "an encoder-decoder (its encoder sees every position)"
    not_causal = [lay.index for lay in layers if getattr(lay.module, "is_causal", False) is not True]
    if not_causal:
        return None, f"attention layer {not_causal[0]} does not say is_causal=True"
    stacks = {id(parents.get(id(b))) for b in blocks.values()}
    stack = parents.get(id(next(iter(blocks.values()))))
    held = {id(b) for b in blocks.values()}
    if len(stacks) != 1 or not isinstance(stack, nn.ModuleList) or not all(id(b) in held for b in stack):
        return None, "its attention layers are not the blocks of one nn.ModuleList"
    return stack, ""


_SKIP_PREFIX = True  # tests turn it off to compare the two paths
_SHORTCUT = True  # the same for the shortcut (`_Shortcut`)
_LAST_BLOCK = True  # ... and for the last block at the read position (`multihead.heads._top`)


def first_output(out) -> Tensor:
    """A block's or model's first output: the hidden states (a tensor, or the head of a tuple)."""
    return out if isinstance(out, Tensor) else out[0]


def _unskip(out, head: Tensor, B: int):
    """A block's output on positions [p, T) of its rows, with the corrupted run's [0, p) put back."""
    x = first_output(out)
    full = torch.cat([head.repeat(x.shape[0] // B, *([1] * (x.dim() - 1))), x], dim=1)
    return full if isinstance(out, Tensor) else (full, *out[1:])


def _prefix_mismatch(rec: Recording, prefix: PrefixRecorder, layers: list[Layer], cache: dict[int, tuple], T: int,
                     p: int, B: int) -> str:
    """Why the prefix skip would not be exact here ("" when it is): both runs' heads must agree
    on the shared prefix at every layer (what a causal model does; to float rounding: a mixture
    of experts batches each expert's tokens, so its sums differ in the last bits), and no mask
    may let the prefix see a later key."""
    for lay in layers:
        got = prefix.data.get(("z", lay.index))
        if got is None or ("k", lay.index) not in prefix.data:
            return f"attention layer {lay.index} handed no keys or outputs to the skip's recorder"
        want = rec["z", lay.index][:, :p]
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6 * (1 + float(want.abs().max()))):
            return (f"the two runs' heads differ on the shared prefix at layer {lay.index} (max "
                    f"{float((got - want).abs().max()):.2e}): the model is not causal there")
    if any(_sees_ahead(x, T, p, B) for args, kwargs in cache.values() for x in (*args, *kwargs.values())):
        return "a mask lets a query of the shared prefix see a later key"
    return ""


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


class PrefixRecorder(Handler):
    """The corrupted run's keys and values (and, with `z=True`, heads' outputs) on the
    shared prefix [0, p): what the prefix skip reads in place of running those positions
    (here and in `path_patching`)."""

    def __init__(self, p: int, z: bool = True):
        self.p = p
        self.keep_z = z
        self.data: dict[tuple[str, int], Tensor] = {}

    def k(self, lay, k):
        self.data["k", lay.index] = k[:, :self.p].clone()
        return k

    def v(self, lay, v):
        self.data["v", lay.index] = v[:, :self.p].clone()
        return v

    def z(self, lay, z, v):
        if self.keep_z:
            self.data["z", lay.index] = z[:, :self.p].clone()
        return z


class _CorruptedRun(PrefixRecorder):
    """The corrupted run's recorder: the prefix (when `p`), and for the shortcut every
    layer's z and the value a variant writes there (the clean z, or for what="pattern" the
    clean pattern times this run's values, which are the variant's at its own layer)."""

    def __init__(self, p: int, prefix: bool, shortcut: set[int], what: str, clean: Recording):
        super().__init__(p)
        self.prefix, self.shortcut, self.what, self.clean = prefix, shortcut, what, clean
        self.z_of: dict[int, Tensor] = {}  # layer -> corrupted z (B, T, H, Dv)
        self.src: dict[int, Tensor] = {}  # layer -> what the variants write (B, T, H, Dv)

    def k(self, lay, k):
        return super().k(lay, k) if self.prefix else k

    def v(self, lay, v):
        return super().v(lay, v) if self.prefix else v

    def z(self, lay, z, v):
        if self.prefix:
            super().z(lay, z, v)
        if lay.index in self.shortcut:
            self.z_of[lay.index] = z.detach()
            if self.what == "pattern":
                pat = self.clean["pattern", lay.index].to(v.dtype)  # (B, H, T, S)
                vv = v.transpose(1, 2).repeat_interleave(lay.H // v.shape[2], dim=1)  # (B, H, S, Dv)
                self.src[lay.index] = (pat @ vv).transpose(1, 2).to(z.dtype)
            else:
                self.src[lay.index] = self.clean["z", lay.index]
        return z

    def wants_kv(self, lay):
        return self.prefix or self.what == "pattern"


def _rows(x, rows: int, keep: int):
    """x with the batch of `rows` rows cut to its first `keep`; other things unchanged."""
    if isinstance(x, Tensor):
        return x[:keep] if x.dim() >= 2 and x.shape[0] == rows else x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_rows(t, rows, keep) for t in x)
    if isinstance(x, list):
        return [_rows(t, rows, keep) for t in x]
    return x


class _Shortcut:
    """The patched layer's attention, not run. A variant of head h at layer l enters l with
    the corrupted run's input, so there it differs from that run only in head h's z; the
    attention module's output is its output projection of z plus a constant (checked on
    the corrupted run, `check`), so the variant's attention output is the corrupted run's
    plus (written z - corrupted z) through head h's columns of the projection. The module
    then runs on the other rows only (on one row when there are none: its output is
    dropped), and the rows of the variants joining there get that sum.

    Taken for what="z" and "pattern" (k, v and latent patches change the attention
    itself), on layers whose variants join at their own block, one attention layer to a
    block; declined (with the reason) where the check or the scan's self-check fails."""

    def __init__(self):
        self.layers: set[int] = set()  # the layers it is taken on
        self.early = ""  # why it was declined before the corrupted run (its memory), or ""
        self.out: dict[int, Tensor] = {}  # layer -> the corrupted run's attention output (B, T, C)
        self.W: dict[int, Tensor] = {}  # layer -> the output projection's weight (C, H * Dv)
        self.z: dict[int, Tensor] = {}
        self.src: dict[int, Tensor] = {}

    def check(self, model, layers: list[Layer]) -> str:
        """Keep the layers whose attention output is z @ W.T + a constant; "" or why none is."""
        why = ""
        for lay in layers:
            if lay.index not in self.layers:
                continue
            z, out = self.z.get(lay.index), self.out.get(lay.index)
            try:
                W = out_projection(model, lay).detach()
            except (ValueError, TypeError, AttributeError) as err:
                W, why = None, f"layer {lay.index}: {err}"
            if W is not None and (z is None or out is None or W.shape != (out.shape[-1], z.shape[2] * z.shape[3])):
                W, why = None, (f"layer {lay.index}'s attention output is not its output projection's "
                                f"({type(lay.module).__name__})")
            if W is not None:
                rest = out - z.flatten(2) @ W.t().to(z.dtype)  # a constant (the bias) when out = o_proj(z)
                scale = 1 + float(out.abs().max())
                if not torch.allclose(rest, rest[:1, :1].expand_as(rest), rtol=1e-5, atol=1e-5 * scale):
                    W, why = None, (f"layer {lay.index}'s attention output is not its output projection of the "
                                    f"heads' z ({type(lay.module).__name__} does more after it)")
            if W is None:
                self.layers.discard(lay.index)
            else:
                self.W[lay.index] = W.to(z.dtype)
        return "" if self.layers else why or "no layer it applies to"

    def hooks(self, joining: dict[int, tuple[Layer, list[int]]], B: int, positions: list[int] | None,
              cut: tuple[int, int] | None, zero: bool = False, last: int | None = None) -> list:
        """(module, pre, post) forward hooks for the layers in `joining` (layer -> (Layer, the
        heads of the variants joining at its block)): they cut the module's batch and append
        the variants' rows. `zero`: the variants write the corrupted z (the self-check).
        `last`: the layer whose block runs its output projection at the last position only
        (`multihead.heads._top`): its variants' rows are built there only."""
        out = []
        for index, (lay, hs) in joining.items():
            state = {}
            T = self.out[index].shape[1]
            off = T - 1 if index == last else 0 if cut is None else cut[1]
            kept = None if positions is None else [q % T - off for q in positions if q % T >= off]

            def pre(mod, args, kwargs, n=len(hs), state=state):  # noqa: B008 (bound per layer)
                x = args[0] if args else kwargs["hidden_states"]
                rows = x.shape[0]
                keep = rows - n * B
                state["keep"] = keep
                return (tuple(_rows(a, rows, keep or 1) for a in args),
                        {k: _rows(v, rows, keep or 1) for k, v in kwargs.items()})

            def post(mod, args, result, index=index, lay=lay, hs=hs, state=state, off=off, kept=kept):
                y = first_output(result)
                base = self.out[index][:, off:].to(y.dtype)
                parts = [y[:state["keep"]]]
                for h in hs:
                    if zero:
                        parts.append(base)
                        continue
                    sl = slice(h * lay.Dv, (h + 1) * lay.Dv)
                    d = (self.src[index][:, off:, h] - self.z[index][:, off:, h]).to(y.dtype)  # (B, T', Dv)
                    if kept is not None:
                        keep_pos = torch.zeros(d.shape[1], dtype=torch.bool)
                        keep_pos[kept] = True
                        d = d * keep_pos[None, :, None].to(d.device)
                    parts.append(base + d @ self.W[index][:, sl].t())
                full = torch.cat(parts)
                return full if isinstance(result, Tensor) else (full, *result[1:])
            out.append((lay.module, pre, post))
        return out


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
                return tuple(one_row(a, B) for a in args), {k: one_row(v, B) for k, v in kwargs.items()}
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
        n = t.shape[0]  # a multiple of B, or one row (a module the shortcut runs for nothing)
        head = head[:n] if n < self.B else head.repeat(n // self.B, 1, 1, 1)
        return torch.cat([head.to(t.dtype), t], dim=1)

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
             tail: list, B: int, extra: list = (), final: list | None = None, keep: dict | None = None) -> Tensor:
    """One scan forward: `grower` lays out the rows, `handler` patches them; with the prefix
    skip, `last` (the last block) gets the corrupted prefix `tail[0]` back on its output;
    `extra`: (module, pre, post) hooks (the shortcut's); `final`: a list to which the
    output of the last block of the blocks hooked is appended (the self-checks'); `keep`:
    keywords for the model's call ({"logits_to_keep": positions} for an `AtPositions` metric)."""
    hooks = Hooks()
    try:
        for b in hooked:
            hooks.pre(b, grower.hook, with_kwargs=True)
        for module, pre, post in extra:
            hooks.pre(module, pre, with_kwargs=True)
            if post is not None:
                hooks.post(module, post)
        if last is not None:
            hooks.post(last, lambda m, a, out: _unskip(out, tail[0], B))
        if final is not None:
            hooks.post(hooked[-1], lambda m, a, out: final.append(first_output(out)))
        hooks.pre(model, lambda m, a: grower.begin())
        with Engine(model, handler).installed(), torch.no_grad(), in_place_activations(model):
            return logits_of(call(model, corrupted, no_cache, **(keep or {})))
    finally:
        hooks.remove()


def _check_scan(model, clean, corrupted, metric, what: str, positions, variants_per_run) -> tuple:
    """Every check of patch_scan's arguments before the first forward: (positions, B, variants per run)."""
    check_model(model)
    check_what(what, SCANS)
    check_metric(metric)
    pos = check_positions(positions)
    B = check_inputs(model, clean, corrupted, metric)
    return pos, B, check_variants_per_run(variants_per_run)


def check_memory(max_memory) -> int | None:
    """max_memory: None (the automatic budget) or a number of bytes >= 1 (an int, or a float such as 2e9)."""
    if max_memory is None:
        return None
    if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)) or not math.isfinite(max_memory) \
            or max_memory < 1:
        raise ValueError(f"max_memory must be None (automatic: {MEMORY_PER_RUN / 2**30:.0f} GiB) or a number of "
                         f"bytes >= 1 (e.g. 2e9); received {max_memory!r}")
    return int(max_memory)


def bytes_per_row(vocab: int, itemsize: int, blocks: list[nn.Module], width: int, positions: int,
                  logit_positions: int | None = None) -> int:
    """About what one row (one copy of one input) adds to a scan forward's peak: its logits
    twice (the model's and a metric's working copy, e.g. a log-softmax; at `logit_positions`
    positions when only those are computed, else at all) and a block's activations, about
    two floats per position for every parameter of a block over the model's width (the
    projections' and the MLP's outputs, the residual and its copies)."""
    per_block = sum(p.numel() for b in blocks[:1] for p in b.parameters())
    act = 2 * per_block // max(1, width) + 4 * width
    head = positions if logit_positions is None else logit_positions
    return itemsize * (positions * act + head * 2 * vocab)


def model_width(model: nn.Module, default: int) -> int:
    """The model's hidden width: its input embeddings' columns, else `default`."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = getattr(get() if callable(get) else None, "weight", None)
    except NotImplementedError:
        emb = None
    return emb.shape[1] if isinstance(emb, Tensor) and emb.dim() == 2 else default


def variants_per_forward(per_row: int, B: int, max_memory: int | None, positions: int = 0) -> tuple[int, int]:
    """(variants per forward, the budget in bytes): as many as `max_memory` (or the
    automatic budget) holds, at least one, and without a budget given at most ROWS_PER_RUN
    rows (bigger batches cost more per row), or POSITIONS_PER_RUN row-positions when rows
    of `positions` positions are short enough for more."""
    budget = MEMORY_PER_RUN if max_memory is None else max_memory
    n = max(1, budget // max(1, per_row * B))
    rows = max(ROWS_PER_RUN, POSITIONS_PER_RUN // positions if positions > 0 else 0)
    return (min(n, max(1, rows // B)) if max_memory is None else n), budget


def _check_positions_fit(pos: list[int] | None, positions, rec: Recording, what: str) -> None:
    """Positions must exist in every layer (an encoder-decoder's decoder is shorter than its encoder)."""
    if pos is None:
        return
    for lay in rec.layers:
        t = rec[what, lay.index]
        n = t.shape[2] if what == "pattern" else t.shape[1]  # query positions of the pattern; else dim 1
        bad = [q for q in pos if not -n <= q < n]
        if bad:
            shortest = min(rec[what, la.index].shape[2 if what == "pattern" else 1] for la in rec.layers)
            raise ValueError(f"positions {bad} out of range at layer {lay.index} ({type(lay.module).__name__}), whose "
                             f"{what} has {n} positions; valid: positions in [-{shortest}, {shortest}) (every layer "
                             f"has them); received {positions!r}")


def _n_heads(lay: Layer, what: str) -> int:
    """Columns of a layer in the table: key/value heads for k/v, one latent, else query heads."""
    return lay.Hkv if what in ("k", "v") else int(lay.kind == "latent") if what == "latent" else lay.H


def _variant_order(layers: list[Layer], what: str) -> list[tuple[int, int]]:
    # head by head, layer by layer within: a run carries head h of consecutive layers, so
    # each block adds B rows and no block runs for nothing (measured on 2 CPU cores: one
    # layer's 8 heads per run, 32 rows, was ~25% slower per row than 4-row runs)
    return sorted(((lay.index, h) for lay in layers for h in range(_n_heads(lay, what))), key=lambda v: (v[1], v[0]))


def _even(n: int, per_run: int) -> int:
    """At most `per_run` variants a forward, in forwards of about one size and a multiple of
    4 of them (when there are more than one): so that 2 or 4 ranks (`group=`) get equal
    shares, and one process makes the same forwards (the tables stay bitwise one)."""
    forwards = -(-n // max(1, per_run))
    if forwards > 1:
        forwards = -(-forwards // 4) * 4
    return max(1, -(-n // forwards))


def _chunks(variants: list[tuple[int, int]], per_run: int, last_stack: set[int]) -> list[list[tuple[int, int]]]:
    """Chunks of at most per_run variants, never mixing layers that join at the model's input."""
    chunks: list[list[tuple[int, int]]] = []
    for v in variants:
        if chunks and len(chunks[-1]) < per_run and (chunks[-1][0][0] in last_stack) == (v[0] in last_stack):
            chunks[-1].append(v)
        else:
            chunks.append([v])
    return chunks


class _Scan:
    """What one patch_scan call holds: the model's blocks, the corrupted run's cached block
    inputs and, with the prefix skip, its prefix. Made per call (two threads may scan one
    model at once: the hooks act only in their own thread)."""

    def __init__(self, model, corrupted, rec: Recording, what: str, B: int):
        self.model, self.corrupted, self.rec, self.what, self.B = model, corrupted, rec, what, B
        self.layers = rec.layers
        parents = parents_of(model)
        self.parents = parents
        self.blocks = _blocks(model, self.layers, parents)  # layer -> where its variants join
        self.block_list = list({id(b): b for b in self.blocks.values()}.values())
        self.inner = [b for b in self.block_list if b is not model]
        self.last_stack = {i for i, b in self.blocks.items() if b is not model}
        self.no_cache = takes_use_cache(model)
        self.cache: dict[int, tuple] = {}  # id(block) -> the corrupted run's (args, kwargs) there
        self.logits: Tensor | None = None  # the corrupted run's (dropped once the metric has read it)
        self.final: Tensor | None = None  # its last block's output, what the self-checks compare
        self.last_logits: Tensor | None = None  # its logits at T - 1 (B, vocab): the last block's check
        self.vocab, self.itemsize = 0, 4
        self.lean: dict = {}  # {"logits_to_keep": 1} for the recording runs when their logits would be big
        self.keep: dict = {}  # {"logits_to_keep": positions} for the scan forwards of an AtPositions metric
        self.T = 0  # the inputs' positions (0 when they cannot be read off them)
        # the prefix skip: the stack of blocks, the cut (T, p), the cache on [p, T), the
        # corrupted run's keys/values/z and last block's output on [0, p)
        self.stack: nn.ModuleList | None = None
        self.cut: tuple[int, int] | None = None
        self.cut_cache: dict[int, tuple] | None = None
        self.prefix = PrefixRecorder(0)
        self.tail: list = []
        # the shortcut: the layers it may take (what="z"/"pattern", variants joining at their
        # own block, one attention layer to it) until the corrupted run's checks decide
        self.shortcut = _Shortcut()
        per_block: dict[int, int] = {}
        for i in self.last_stack:
            per_block[id(self.blocks[i])] = per_block.get(id(self.blocks[i]), 0) + 1
        if _SHORTCUT and what in ("z", "pattern"):
            self.shortcut.layers = {i for i in self.last_stack if per_block[id(self.blocks[i])] == 1}
        # the last block at the read position only (`multihead.heads._top`), once checked
        self.top: LastBlock | None = None
        self.top_reason = "not decided"

    def run_corrupted(self, p: int) -> None:
        """The corrupted run once, keeping what each block of the last stack is handed (and,
        when `self.stack` is set, the prefix [0, p) of every layer and of the last block)."""
        if not self.last_stack:
            return
        cache, tail, short = self.cache, self.tail, self.shortcut
        self.prefix = _CorruptedRun(p, self.stack is not None, short.layers, self.what, self.rec)

        def keep(block, args, kwargs):
            cache[id(block)] = (args, {k: v for k, v in kwargs.items() if k not in (KEYWORD, WEIGHTS_KEYWORD)})
        hooks = Hooks()
        try:
            for b in self.inner:
                hooks.pre(b, keep, with_kwargs=True)
            if self.stack is not None:
                hooks.post(self.stack[-1], lambda m, a, out: tail.append(first_output(out)[:, :p].clone()))
            hooks.post(self.inner[-1], lambda m, a, out: setattr(self, "final", first_output(out)))
            for lay in self.layers:
                if lay.index in short.layers:
                    hooks.post(lay.module, lambda m, a, out, i=lay.index: short.out.__setitem__(i, first_output(out)))
            recording = self.stack is not None or short.layers
            recorder = Engine(self.model, self.prefix).installed() if recording else nullcontext()
            with torch.no_grad(), recorder:
                self.logits = logits_of(call(self.model, self.corrupted, self.no_cache, **self.lean))
        finally:
            hooks.remove()
        short.z, short.src = self.prefix.z_of, self.prefix.src
        if isinstance(self.logits, Tensor) and self.logits.dim() == 3:
            self.last_logits = self.logits[:, -1].detach().clone()

    def decide_prefix(self, p: int, T: int) -> str:
        """After the corrupted run: take the skip (set `cut`, return "") or say why not."""
        cut_cache, why = _cut_cache(self.cache, (T, p))
        if cut_cache is None:
            return why
        why = _prefix_mismatch(self.rec, self.prefix, self.layers, self.cache, T, p, self.B)
        if why:
            return why
        self.cut, self.cut_cache = (T, p), cut_cache
        why = self.self_check()
        if why:
            self.cut = self.cut_cache = None
        return why

    def decide_shortcut(self, budget: int) -> str:
        """After the corrupted run (and the prefix decision): first the last block's trim
        (`decide_last_block`, which the shortcut's self-check then runs through), then keep
        the shortcut's layers that pass its check, then run its self-check; "" when it is
        taken, else why not. What it holds (each layer's attention output and z, (B, T, C)
        each) must stay within a quarter of the forwards' memory budget: at length on a deep
        model it would hold much (0.6 GB for SmolLM2 at 4,096 positions) to save little (one
        block's attention of the 15 blocks a variant runs on average there)."""
        self.top_reason = self.decide_last_block()
        short = self.shortcut
        if short.early:
            return short.early
        if not short.layers:
            return f"not for what={self.what!r}" if self.what not in ("z", "pattern") else "no layer it applies to"
        held = sum(t.numel() * t.element_size() for d in (short.out, short.z) for t in d.values())
        if self.what == "pattern":
            held += sum(t.numel() * t.element_size() for t in short.src.values())
        if held > budget // 4:
            short.layers, short.z, short.src, short.out = set(), {}, {}, {}
            return (f"it would hold {held / 2**20:,.0f} MiB (each layer's attention output and z), over a quarter "
                    f"of the memory budget ({budget / 2**20:,.0f} MiB)")
        why = short.check(self.model, self.layers)
        if not why:
            why = self.shortcut_check()
        if why:
            short.layers, short.z, short.src, short.out = set(), {}, {}, {}
        return why

    def shortcut_check(self) -> str:
        """Variants of the shortcut's last two layers writing the corrupted run's own z: every
        one must give the corrupted run's logits (a module input the cut of its batch does not
        read right, an output it does not rebuild right, fails here)."""
        chunk = [(i, 0) for i in sorted(self.shortcut.layers)[-2:]]
        final: list = []
        try:
            _, start, order = self.chunk_logits(chunk, None, zero=True, final=final)
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            return f"the corrupted run through the shortcut failed: {type(err).__name__}: {err}"
        at = slice(-1, None) if self.top is not None else slice(None)  # the trimmed last block: T - 1 is right
        want, B = self.final[:, at], self.B
        for i in range(len(order)):
            got = final[-1][start + i * B:start + (i + 1) * B, at]
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5,
                                                             atol=1e-5 * (1 + float(want.abs().max()))):
                return (f"the corrupted run through the shortcut at layer {order[i][0]} does not give its own logits "
                        f"(a module input whose batch the shortcut does not cut right)")
        return ""

    def decide_last_block(self) -> str:
        """After the corrupted run and the prefix decision: take the trim of the last block
        (`multihead.heads._top`: its output projection and MLP at the read position only, and
        its attention kernel for that query only where the check passes with it) when the
        metric and the block allow it and its check passes; "" when all of it is taken, else
        why not (or why the kernel still runs every query)."""
        self.top = None
        if not _LAST_BLOCK:
            return "turned off"
        if not self.inner:
            return "the attention layers are in no block of a stack"
        block = self.inner[-1]
        top, why = last_block(self.model, block, [lay for lay in self.layers if self.blocks[lay.index] is block],
                              self.parents, self.metric, self.T)
        if top is None:
            return why
        self.top = top
        why = self.last_block_check()
        if top.queries and why:
            top.queries = False
            again = self.last_block_check()
            if not again:
                return f"taken, but its attention kernel runs every query (with the last query alone: {why})"
            why = again
        if why:
            self.top = None
        return why

    def last_block_check(self) -> str:
        """The corrupted run from the cached input of its last block, that block trimmed and
        nothing patched (through the prefix skip when it is taken): its output and logits at
        T - 1 must be the corrupted run's own, to float rounding."""
        B, block, final = self.B, self.top.block, []
        grower = _FromCache(B, {id(block): 1}, self.cut_cache if self.cut else self.cache, self.cut)
        handler = _ScanHandler(self.what, self.rec, B, None, self.prefix.data if self.cut else None, self.cut)
        try:
            logits = _forward(self.model, self.corrupted, self.no_cache, handler, grower, self.inner,
                              self.stack[-1] if self.cut else None, self.tail, B, self.top.hooks(), final,
                              {**self.keep, **self.top.keywords()})
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            return f"the corrupted run through the trimmed last block failed: {type(err).__name__}: {err}"
        for name, got, want in (("output", final[-1][:, -1], self.final[:, -1]),
                                ("logits", logits[:, -1] if logits.dim() == 3 else logits, self.last_logits)):
            if want is None or got.shape != want.shape:
                return f"the trimmed last block's {name} cannot be compared with the corrupted run's at T - 1"
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + float(want.abs().max()))):
                return (f"the trimmed last block's {name} at T - 1 differs from the corrupted run's by "
                        f"{float((got - want).abs().max()):.2e} ({type(block).__name__} mixes positions after its "
                        "attention, or something after it does)")
        return ""

    def self_check(self) -> str:
        """The corrupted run again through the skip, nothing patched: it must give its own logits
        (compared before the model's head: its last block's output)."""
        B, want, final = self.B, self.final, []
        grower = _FromCache(B, {id(self.stack[0]): 1}, self.cut_cache, self.cut)
        handler = _ScanHandler(self.what, self.rec, B, None, self.prefix.data, self.cut)
        _forward(self.model, self.corrupted, self.no_cache, handler, grower, self.inner, self.stack[-1],
                 self.tail, B, final=final)
        again = final[-1]
        if again.shape != want.shape:
            return f"the corrupted run through the skip gave logits of shape {tuple(again.shape)}, not its own"
        if not torch.allclose(again, want, rtol=1e-5, atol=1e-5 * (1 + float(want.abs().max()))):
            return (f"the corrupted run through the skip differs from its own logits by "
                    f"{float((again - want).abs().max()):.2e}: a block input the cut does not read right")
        return ""

    def run_chunk(self, chunk: list[tuple[int, int]], pos: list[int] | None, metric) -> list[tuple[tuple, float]]:
        """One forward carrying the variants of `chunk`: [((layer, head), metric), ...]."""
        logits, start, order = self.chunk_logits(chunk, pos)
        B = self.B
        rows = [logits[start + i * B:start + (i + 1) * B] for i in range(len(order))]
        return [((layer, h), scalar(self.read(metric, r), f"for layer {layer} head {h}"))
                for (layer, h), r in zip(order, rows)]

    def read(self, metric, logits: Tensor):
        """The metric of one variant's logits (those of the kept positions with `self.keep`)."""
        return read_metric(metric, logits, self.keep, self.T)

    def chunk_logits(self, chunk: list[tuple[int, int]], pos: list[int] | None, zero: bool = False,
                     final: list | None = None) -> tuple[Tensor, int, list[tuple[int, int]]]:
        """The forward of `chunk`: (logits, the first variant's row, the variants in row order)."""
        B, cut = self.B, self.cut
        cached = chunk[0][0] in self.last_stack
        handler = _ScanHandler(self.what, self.rec, B, pos, self.prefix.data if cut else None, cut)
        per_block: dict[int, int] = {}
        first_row = 0 if cached else B
        start = first_row
        order: list[tuple[int, int]] = []
        joining: dict[int, tuple[Layer, list[int]]] = {}  # the shortcut's layers: their variants' heads
        for blk in self.block_list:  # rows are laid out block by block, in the order the blocks run
            mine = [(layer, h) for layer, h in chunk if self.blocks[layer] is blk]
            if not mine:
                continue
            per_block[id(blk)] = len(mine)
            for layer in sorted({layer for layer, _ in mine}):
                hs = [h for lay_i, h in mine if lay_i == layer]
                if cached and layer in self.shortcut.layers:
                    joining[layer] = (self.layers[layer], hs)
                else:
                    handler.rows[layer] = (first_row, hs)
                order += [(layer, h) for h in hs]
                first_row += len(hs) * B
        if cached:
            grower = _FromCache(B, per_block, self.cut_cache if cut else self.cache, cut)
        else:
            grower = _Grower(B, per_block)
        hooked = self.inner if cached else self.block_list
        top = self.top
        extra = self.shortcut.hooks(joining, B, pos, cut, zero, top.layer.index if top else None) if joining else []
        if top is not None:
            extra += top.hooks()
        keep = self.keep if top is None else {**self.keep, **top.keywords()}
        logits = _forward(self.model, self.corrupted, self.no_cache, handler, grower, hooked,
                          self.stack[-1] if cut else None, self.tail, B, extra, final, keep)
        if logits.shape[0] != first_row:
            raise RuntimeError(f"the scan's batch did not come out whole ({logits.shape[0]} rows, expected "
                               f"{first_row}): {type(self.model).__name__} reshapes its batch between blocks")
        return logits, start, order

    def cost(self, chunk: list[tuple[int, int]], head: float) -> float:
        """A chunk's forward in block-rows (B rows through one block): each variant runs the
        blocks from its own upward, then the model's head (`head` blocks' worth per row)."""
        where = {id(b): j for j, b in enumerate(self.block_list)}
        n = len(self.block_list)
        frac = 1.0 if self.cut is None else (self.cut[0] - self.cut[1]) / self.cut[0]
        return sum((n - where[id(self.blocks[layer])]) * frac + head for layer, _ in chunk)


def _static_refusal(model, clean, corrupted, what: str) -> tuple[int, int, str]:
    """(p, T, why not) of the prefix skip before any forward; "" when it may be tried."""
    p, T = _shared_prefix(clean, corrupted)
    if not _SKIP_PREFIX:
        return p, T, "the prefix skip is turned off"
    if T == 0:
        return p, T, "the inputs' positions cannot be read off them (no (B, T) tensors of one length)"
    if p == 0:
        return p, T, "clean and corrupted differ at position 0: no shared prefix"
    if p == T:
        return p, T, "clean and corrupted are equal"
    if not is_hf(model):
        return p, T, "not a transformers model (the skip reads transformers' block inputs)"
    if what == "latent":
        return p, T, "what='latent' (MLA modules run every position)"
    return p, T, ""


def head_cost(model: nn.Module, blocks: list[nn.Module]) -> float:
    """The output head's cost per position in blocks: its weight's size over a block's
    parameters (both are matrix products over the same positions). 0 when unknown."""
    get = getattr(model, "get_output_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    per_block = sum(p.numel() for b in blocks for p in b.parameters()) / max(1, len(blocks))
    return float(weight.numel()) / per_block if isinstance(weight, Tensor) and per_block else 0.0


@dataclass(frozen=True)
class _Prepared:
    """patch_scan's checked arguments and the inputs it runs (`aligned`'s), before any forward
    of its own: what each of its setup steps reads."""

    pos: list[int] | None
    B: int
    per_run: int | None  # variants_per_run as given
    budget: int | None  # max_memory as given (None: automatic)
    memory: int  # the bytes a forward may take (the budget, or MEMORY_PER_RUN)
    clean: object
    corrupted: object
    metric: Callable
    align_why: str
    p0: int  # the positions clean and corrupted share at the start
    T: int
    why: str  # why the prefix skip is declined before any forward ("" when it may be tried)
    lean: dict  # keywords of the recording runs ({"logits_to_keep": 1} or {})
    whats: tuple  # what the clean recording keeps
    align_check: Callable | None = None  # `_align.unchecked`'s check, not yet run (None: none, or run)


def patch_scan(model, clean, corrupted, metric: Callable[[Tensor], Tensor], what: str = "z", positions=None, *,
               variants_per_run: int | None = None, max_memory: int | None = None, progress=None,
               info: dict | None = None, group=None) -> Tensor:
    """The metric of the corrupted run with each head patched from the clean run, one at a time.

    Args:
        model: a transformers model on attn_implementation="multihead", or a module built
            from multihead's Attention/LatentAttention.
        clean, corrupted: inputs of the same shape (a tensor of input_ids or a mapping of
            keyword arguments; no labels, use_cache or past_key_values).
        metric: logits of one run (the output's `.logits`, or the output when it is a
            tensor; `(B, ...)` of that run's B rows) -> a scalar tensor (or a number). An
            `AtPositions` metric (one position per row, e.g. `tasks.ioi(...).metric`) on a
            transformers model has the model's head computed at those positions only
            (SmolLM2 on 8 IOI pairs: half the scan's work); the table is the same.
        what: "z" (heads' outputs), "k", "v" (per KV head: MQA/GQA scan Hkv heads; MLA
            modules per head through the up-projection), "pattern" (z = clean pattern @
            this run's values) or, for MLA modules, "latent" (the shared latent, one column).
        positions: None for all, or the positions to patch (each must exist in every layer).
        variants_per_run: how many patched copies of the batch one forward carries
            (default: as many as `max_memory` holds, at most 16 // B, at least 1).
        max_memory: the bytes one forward may take (its logits and activations, estimated
            by `bytes_per_row`): None for 1 GiB. At length this sets the batch: SmolLM2 at
            4,096 positions takes about 1.8 GB a row (its logits alone 0.8 GB), so one variant
            a forward. What the call holds throughout is apart: the clean run's z and the
            corrupted run's block inputs, attention outputs and z, each (B, T, C) a layer.
        progress: None/False (silent), True (heads done, rate and ETA on stderr, only when it
            is a terminal; the first line says the variants per forward and the memory
            figure) or a callable(done, total, eta_s) (`multihead.heads.progress`). With
            `group`, each rank counts its own forwards.
        info: a dict to fill with how the scan ran (the table is the same either way):
            `{"prefix": p, "skipped": bool, "reason": str}`: p the positions clean and
            corrupted share at the start, `skipped` whether the variants ran on [p, T) only
            (the prefix skip, module docstring), `reason` why it was declined ("" when taken);
            for an `AtPositions` metric also `aligned`, whether each row was rolled to end where
            the metric reads it (p is then of the rolled rows: `multihead.heads._align`), and
            `aligned_reason` why not where it could matter ("" otherwise), and `last_block`,
            whether the variants' last block ran its output projection and MLP at the read
            position only (a metric reading only the last position: `multihead.heads._top`;
            never for a plain metric), and `last_block_reason` why not ("" when all of it did).
        group: None (one process), or a torch.distributed process group whose every rank
            makes this call with the same model, inputs and options: each rank runs a share
            of the forwards (whole chunks of variants, the same as in one process) and every
            rank returns the whole table, bitwise the one process's. The setup is shared too:
            rank 0 records the clean run while rank 1 makes the corrupted run (then each sends
            the other ranks what it made), and each self-check forward runs on one rank while
            the others start on the variants (not for what="pattern", whose corrupted run
            reads the clean pattern: every rank makes both runs there). An error on any rank
            raises on every rank (`multihead.heads._ranks`).

    Returns `(layers, heads)` float32 (NaN where a layer has fewer heads than the widest).
    Equal to TransformerLens' `get_act_patch_attn_head_out_all_pos` (and its k/v/pattern
    siblings) on the same weights.
    """
    check_group(group)
    ranks = Ranks(group, "patch_scan")

    def prepare(defer: bool = False) -> _Prepared:
        """Every check of the arguments and the inputs the scan runs (rolled by `aligned`); with
        `defer`, the rolled rows' check is not run but kept (`_Prepared.align_check`)."""
        pos, B, per_run = _check_scan(model, clean, corrupted, metric, what, positions, variants_per_run)
        budget = check_memory(max_memory)
        check_progress(progress)
        if info is not None and not isinstance(info, dict):
            raise TypeError(f"info must be None or a dict to fill; received {type(info).__name__}")
        if defer:
            clean_, corrupted_, metric_, align_why, align_check = unchecked(model, clean, corrupted, metric, pos)
        else:
            (clean_, corrupted_, metric_, align_why), align_check = aligned(model, clean, corrupted, metric, pos), None
        p0, T, why = _static_refusal(model, clean_, corrupted_, what)
        if pos is not None and T and any(not -T <= q < T for q in pos):
            raise ValueError(f"positions must lie in [-{T}, {T}) for inputs of {T} positions; received {positions!r}")
        memory = MEMORY_PER_RUN if budget is None else budget
        return _Prepared(pos, B, per_run, budget, memory, clean_, corrupted_, metric_, align_why, p0, T, why,
                         _lean(model, clean_, memory), (what, "z") if not why and what != "z" else (what,),
                         align_check)

    def clean_run(a: _Prepared) -> Recording:
        rec = record(model, with_keywords(a.clean, a.lean), what=a.whats)
        rec.logits = None  # the scan's own recording: its logits (B, T, vocab) are not read
        return rec

    def check_rec(a: _Prepared, rec: Recording) -> None:
        _check_positions_fit(a.pos, positions, rec, what)
        if what == "latent" and not any(lay.kind == "latent" for lay in rec.layers):
            raise ValueError("what='latent' patches MLA latents (multihead LatentAttention, or a DeepSeek model after "
                             "multihead.interop.hf.use_latent_attention); this model has none")

    def corrupted_run(a: _Prepared, rec: Recording) -> tuple[_Scan, str]:
        scan = _Scan(model, a.corrupted, rec, what, a.B)
        scan.lean, scan.metric, scan.aligned = a.lean, a.metric, (a.clean is not clean, a.align_why)
        scan.T, scan.keep = a.T, keep_positions(model, a.metric, a.T, a.B)
        scan.shortcut.early = _shortcut_too_big(scan.shortcut, rec, a.memory)
        why = a.why
        if not why:
            scan.stack, why = _causal_stack(model, scan.layers, scan.blocks, scan.parents)
        scan.run_corrupted(a.p0 if scan.stack is not None else 0)
        return scan, why

    def decide(a: _Prepared, rec: Recording, scan: _Scan, why: str, deferred: list | None):
        """The rest of the setup; `deferred` (a list): the self-check forwards are not run but
        put there (name, the check), to be run as units of the scan (`_deferred`)."""
        if scan.logits is not None:
            if not a.lean:  # a metric that cannot work fails before the scan (else at its first forward)
                scalar(a.metric(scan.logits), "on the corrupted run")
            scan.vocab = scan.logits.shape[-1] if scan.logits.dim() >= 3 else 0
            scan.itemsize = scan.logits.element_size()
        scan.logits = None  # (B, T, vocab): 0.8 GB at 4,096 positions of SmolLM2; the checks read `final`
        with _deferred(scan, "self_check", deferred):
            if scan.stack is not None:
                why = scan.decide_prefix(a.p0, a.T)
        # the shortcut's check, and the last block's trim check where the scan makes one
        with _deferred(scan, "shortcut_check", deferred), _deferred(scan, "last_block_check", deferred):
            scan.shortcut_reason = scan.decide_shortcut(a.memory)
        B, T, p0 = a.B, a.T, a.p0
        width = model_width(model, scan.layers[0].H * scan.layers[0].Dv)
        n_pos = (T - p0 if scan.cut else T) or _positions_of(rec)
        per_row = bytes_per_row(scan.vocab, scan.itemsize, scan.inner or [model], width, n_pos,
                                len(scan.keep["logits_to_keep"]) if scan.keep else None)
        auto, scan.budget = variants_per_forward(per_row, B, a.budget, n_pos)
        scan.per_row = per_row
        order = _variant_order(scan.layers, what)
        per_run = _even(len(order), auto) if a.per_run is None else a.per_run
        chunks = _chunks(order, per_run, scan.last_stack)
        return scan, a.pos, p0, why, chunks

    def setup(deferred: list | None = None):
        a = prepare()
        rec = clean_run(a)
        check_rec(a, rec)
        scan, why = corrupted_run(a, rec)
        return decide(a, rec, scan, why, deferred)

    def shared_setup(deferred: list):
        """setup() with the clean run on rank 0 and the corrupted run on rank 1 at once
        (`_shared_runs`), or None when that could not be done (every rank then runs setup())."""
        made = _shared_runs(ranks, model, lambda: prepare(defer=True), clean_run, corrupted_run)
        if made is None:
            return None
        a, rec, scan, why = made
        check_rec(a, rec)
        if a.align_check is not None:  # the rolled rows' check (two forwards), on one rank
            deferred.append(("align_check", a.align_check))
        return decide(a, rec, scan, why, deferred)

    def agreed(done):  # what every rank must share for the tables to be one table
        scan, pos, p0, why, chunks = done
        return (fingerprint(model, clean, corrupted), what, pos, p0, scan.cut, chunks)

    deferred: list | None = [] if ranks.size > 1 else None
    done = None
    if deferred is not None and what != "pattern":
        done = ranks.run(lambda: shared_setup(deferred), lambda d: () if d is None else agreed(d))
    if done is None:
        done = ranks.run(lambda: setup(deferred), agreed)
    scan, pos, p0, why, chunks = done
    head = head_cost(model, scan.inner)
    costs = [scan.cost(chunk, head) for chunk in chunks]
    shown = Progress(progress, sum(len(c) for c in chunks), costs, "patch_scan")
    if shown.draw:
        per_run = max(len(c) for c in chunks)
        shown.note(f"patch_scan: {per_run} variant(s) of {scan.B} row(s) per forward, about "
                   f"{per_run * scan.B * scan.per_row / 2**20:,.0f} MiB each (budget {scan.budget / 2**20:,.0f} MiB)")

    def one(unit, cost):
        if not isinstance(unit, list):  # a deferred check: (name, check) -> why it failed, or ""
            return unit[1]()
        values = scan.run_chunk(unit, pos, scan.metric)
        shown.step(len(unit), cost)
        return values
    try:
        checks = [(c, _check_cost(scan, c[0], head)) for c in deferred or ()]
        units = [*checks, *zip(chunks, costs)]
        results = ranks.map(lambda uc: one(*uc), units, [c for _, c in units])
        if any(results[:len(checks)]):
            # a check the other ranks took as passed failed: the whole setup again, its checks in line
            scan, pos, p0, why, chunks = ranks.run(setup, agreed)
            results = ranks.map(lambda c: scan.run_chunk(c, pos, scan.metric), chunks,
                                [scan.cost(c, head) for c in chunks])
        else:
            results = results[len(checks):]
    finally:
        shown.close()
    if info is not None:
        info.update(prefix=p0, skipped=scan.cut is not None, reason=why)
        if isinstance(metric, AtPositions):
            info.update(aligned=scan.aligned[0], aligned_reason=scan.aligned[1], last_block=scan.top is not None,
                        last_block_reason=scan.top_reason)
    n_heads = [_n_heads(lay, what) for lay in scan.layers]
    out = torch.full((len(scan.layers), max(n_heads)), math.nan)
    for values in results:
        for (layer, h), value in values:
            out[layer, h] = value
    return out


@contextmanager
def _deferred(scan: _Scan, name: str, into: list | None):
    """Within: `scan.<name>()` (a self-check forward) passes without running; the real check is
    appended to `into` as (name, check) to run later, on one rank of the group, while the others
    run variants. A check that then fails makes every rank redo the setup with it in line, so
    the table is one process's either way. `into` None (one process): nothing deferred."""
    real = getattr(scan, name, None) if into is not None else None
    if real is None:
        yield
        return
    ran: list = []
    setattr(scan, name, lambda: ran.append(True) or "")
    try:
        yield
    finally:
        delattr(scan, name)  # the class's method again
    if ran:
        into.append((name, real))


def _check_cost(scan: _Scan, name: str, head: float) -> float:
    """A deferred check's forward in `_Scan.cost`'s units: the self-check runs every block (one
    variant at the first layer's cost), the shortcut's check two variants at its last layers,
    the last block's check that block alone."""
    if name == "shortcut_check" and scan.shortcut.layers:
        return scan.cost([(i, 0) for i in sorted(scan.shortcut.layers)[-2:]], head)
    if name == "last_block_check":  # one variant's last block and head
        return scan.cost([(scan.layers[-1].index, 0)], head)
    if name == "align_check":  # two forwards of the corrupted rows, every block
        return 2 * scan.cost([(scan.layers[0].index, 0)], head)
    return scan.cost([(scan.layers[0].index, 0)], head)


def _shared_runs(ranks: Ranks, model, prepare, clean_run, corrupted_run):
    """(a, rec, scan, why) of `patch_scan`'s setup with its two recording forwards on two ranks
    at once: rank 0 records the clean run, rank 1 makes the corrupted run against a stand-in
    of that recording (`_stand_in`: the clean run's layers and tensor shapes, from a one-row,
    one-position forward), then each sends what it made (`_ranks.pack`) and every rank rebuilds
    the same state from those bytes, with the stand-in's tensors replaced by the clean ones.
    None (every rank then runs the setup itself) when a rank failed, the stand-in was not
    the clean run's shape, or what the corrupted run made does not travel: an error is then
    raised by that setup, in its own words, on every rank."""
    a = mine = None
    try:
        a = prepare()
        if ranks.rank == 0:
            mine = pack(clean_run(a), model)
        elif ranks.rank == 1 and a.T:
            stand = _stand_in(model, a)
            scan, why = corrupted_run(a, stand)
            refs = _refs(a, stand)
            shapes = [(k, tuple(t.shape), t.dtype) for k, t in stand.data.items()]
            mine = pack((vars(scan), why, shapes, [_layer_key(lay) for lay in stand.layers]), model, refs)
    except Exception:  # the setup on every rank raises it (or passes: then this was only the stand-in)
        mine = None
    parts = ranks.share(mine)
    made, ok = None, a is not None and parts[0] is not None and parts[1] is not None
    if ok:
        try:
            rec = unpack(parts[0], model)
            state, why, shapes, layers = unpack(parts[1], model, _refs(a, rec))
            ok = layers == [_layer_key(lay) for lay in rec.layers] and all(
                k in rec and tuple(rec[k].shape) == s and rec[k].dtype == d for k, s, d in shapes)
            if ok:
                scan = _Scan.__new__(_Scan)
                scan.__dict__.update(state)
                made = (a, rec, scan, why)
        except Exception:  # a key or module name the receiver lacks: it runs the setup itself
            ok = False
    return made if all(ranks.settle(None, ok)) else None


def _refs(a: _Prepared, rec: Recording) -> dict:
    """What every rank holds in its own right, sent by name: the call's inputs and metric, and
    the clean recording (its stand-in on the sending rank, the clean one on arrival)."""
    return {"clean": a.clean, "corrupted": a.corrupted, "metric": a.metric, "rec": rec, "layers": rec.layers,
            **{("layer", i): lay for i, lay in enumerate(rec.layers)}, **{("rec", k): t for k, t in rec.data.items()}}


def _layer_key(lay: Layer) -> tuple:
    return (lay.index, lay.module, lay.kind, lay.H, lay.Hkv, lay.D, lay.Dv)


def _stand_in(model, a: _Prepared) -> Recording:
    """The clean recording as the corrupted run reads it before the clean run is made: its
    layers (from a forward of one row and one position) and, for every tensor it will hold, an
    empty one of its shape (B, T, ...) and dtype on the meta device (any arithmetic with it
    raises: the corrupted run may only hold it, or read its size)."""
    inputs = a.clean
    if isinstance(inputs, Tensor):
        tiny = inputs[:1, :1]
    else:
        tiny = {k: (v[:1, :1] if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[:2] == (a.B, a.T) else v)
                for k, v in ((k, inputs[k]) for k in inputs.keys())}
    small = record(model, tiny, what=a.whats)
    data = {k: torch.empty((a.B, a.T, *t.shape[2:]), dtype=t.dtype, device="meta") for k, t in small.data.items()}
    return Recording(data, small.layers, None, None, a.B)


def _shortcut_too_big(short: _Shortcut, rec: Recording, budget: int) -> str:
    """Why the shortcut is declined before the corrupted run would hold its tensors (each
    layer's attention output and z, about two of the clean z a layer), or ""."""
    held = 2 * sum(rec["z", i].numel() * rec["z", i].element_size() for i in short.layers if ("z", i) in rec)
    if held <= budget // 4:
        return ""
    short.layers = set()
    return (f"it would hold {held / 2**20:,.0f} MiB (each layer's attention output and z), over a quarter "
            f"of the memory budget ({budget / 2**20:,.0f} MiB)")


def takes_logits_to_keep(model) -> bool:
    """Whether the model is a transformers model whose forward computes its head's logits at
    the positions `logits_to_keep` names only."""
    return is_hf(model) and forward_takes(model, "logits_to_keep")


def keep_positions(model, metric, T: int, B: int) -> dict:
    """{"logits_to_keep": the positions read} for an `AtPositions` metric on a model that
    takes the keyword (T known), else {} (the scan forwards compute every position's logits)."""
    if not isinstance(metric, AtPositions):
        return {}
    if len(metric.positions) != B:
        raise ValueError(f"the metric reads one position for each of {len(metric.positions)} rows; the inputs have "
                         f"{B} rows (valid: an AtPositions made for these inputs)")
    if not T or not takes_logits_to_keep(model):
        return {}
    return {"logits_to_keep": metric.keep(T)}


def read_metric(metric, logits: Tensor, keep: dict, T: int):
    """The metric of logits computed with `keep` (`keep_positions`' keywords): those of the
    kept positions only when it holds them, else every position's."""
    return metric.kept(logits, keep["logits_to_keep"], T) if keep else metric(logits)


def _lean(model, inputs, budget: int) -> dict:
    """{"logits_to_keep": 1} when the recording runs (clean, corrupted) may skip their full
    logits (a transformers model that takes the keyword) and those would take over a quarter
    of the budget (SmolLM2 at 4,096 positions: 0.8 GB a row); else {}. The scan reads
    neither run's logits: the self-checks compare the last block's output."""
    if not takes_logits_to_keep(model):
        return {}
    get = getattr(model, "get_output_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    ids = inputs if isinstance(inputs, Tensor) else next(
        (inputs[k] for k in inputs.keys() if isinstance(inputs[k], Tensor) and inputs[k].dim() == 2), None)
    if not isinstance(weight, Tensor) or ids is None:
        return {}
    return {"logits_to_keep": 1} if ids.numel() * weight.shape[0] * weight.element_size() > budget // 4 else {}


def _positions_of(rec: Recording) -> int:
    t = rec["z", rec.layers[0].index] if ("z", rec.layers[0].index) in rec else None
    return 1 if t is None else t.shape[1]


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


def attribution_scan(model, clean, corrupted, metric: Callable[[Tensor], Tensor], what: str = "z", *,
                     group=None) -> Tensor:
    """Attribution patching: `patch_scan`'s table to first order, every head at once.

    metric(corrupted) + sum over batch, positions and head dims of (a_clean - a_corr) *
    d metric / d a, at the corrupted run (two forwards, one backward). An
    approximation: exact only where the metric is linear in the head's activation (far
    from it for heads whose patch changes the output a lot); use `patch_scan` for the
    exact table. what: "z", "k" or "v". Returns `(layers, heads)`, like `patch_scan`.

    group: None (one process), or a torch.distributed process group whose every rank makes
    this call with the same model, inputs and options. There are no variants to share: rank
    0 records the clean run while rank 1 runs the corrupted forward and backward (at most
    (2 forwards + 1 backward) / (1 forward + 1 backward) faster; ranks above 1 wait), the
    two halves are exchanged and every rank computes the same table, bitwise the one
    process's. An error on any rank raises on every rank.
    """
    check_group(group)
    ranks = Ranks(group, "attribution_scan")
    clean_rank, corrupted_rank = 0, min(1, ranks.size - 1)

    def halves():
        check_model(model)
        check_what(what, ("z", "k", "v"))
        check_inputs(model, clean, corrupted, metric)
        check_grad_mode("attribution_scan")
        mine = {}
        if ranks.rank == clean_rank:
            rec = record(model, clean, what=(what,))
            mine["clean"] = [(lay.index, rec[what, lay.index]) for lay in rec.layers]
        if ranks.rank == corrupted_rank:
            mine["corrupted"] = _attribution_grads(model, corrupted, metric, what)
        return mine

    if group is None:
        got = halves()
        return _attribution_table(got["clean"], *got["corrupted"])
    error, mine = None, {}
    try:
        mine = _to(halves(), torch.device("cpu"))  # pickled by settle: CPU tensors unpickle on every rank
    except Exception as e:  # held for settle: every rank raises together
        error = e
    every = ranks.settle(error, mine, fingerprint(model, clean, corrupted) + what)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    got = _to({**every[clean_rank], **every[corrupted_rank]}, device)
    return _attribution_table(got["clean"], *got["corrupted"])


def _to(x, device: torch.device):
    """Every tensor in nested lists, tuples and dicts moved to `device`."""
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


def _attribution_grads(model, corrupted, metric, what: str) -> tuple[float, list[tuple[int, Tensor, Tensor | None]]]:
    """The corrupted half: (metric, [(layer, activation, d metric / d activation or None), ...])."""
    handler = _Attribution(what)
    with Engine(model, handler).installed(), torch.enable_grad():
        m = metric(logits_of(call(model, corrupted, takes_use_cache(model))))
        base = scalar(m, "on the corrupted run")
        if not isinstance(m, Tensor) or not m.requires_grad:
            raise TypeError(f"metric must return a scalar tensor computed from the logits (attribution "
                            f"differentiates it); received {type(m).__name__}"
                            + ("" if not isinstance(m, Tensor) else " without a gradient"))
        layers = sorted(handler.leaves)
        grads = torch.autograd.grad(m, [handler.leaves[i] for i in layers], allow_unused=True)
    return base, [(i, handler.values[i], g) for i, g in zip(layers, grads)]


def _attribution_table(clean: list[tuple[int, Tensor]], base: float,
                       corrupted: list[tuple[int, Tensor, Tensor | None]]) -> Tensor:
    """base + sum of (clean - corrupted) * gradient per head, `(layers, heads)`."""
    assert [i for i, _ in clean] == [i for i, _, _ in corrupted], "both halves ran the same attention layers"
    out = torch.full((len(clean), max(a.shape[2] for _, a in clean)), math.nan)
    for (i, a_clean), (_, a_corr, g) in zip(clean, corrupted):
        delta = a_clean - a_corr  # (B, T|S, heads, Dh)
        contrib = torch.zeros(delta.shape[2]) if g is None else (delta * g).sum(dim=(0, 1, 3))
        out[i, :delta.shape[2]] = base + contrib.float()
    return out
