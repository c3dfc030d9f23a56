"""The state of one `patch_scan` call and its forwards (`ScanState`): the model's blocks,
the corrupted run's cached block inputs, the prefix skip's and the shortcut's decisions, the
last block's trim, and the handler that writes the clean head into each variant's rows (z,
k, v, or z = clean pattern @ v). Made per call: its hooks act only in its own thread, so two
threads may scan one model at once. The method is in docs/heads.md and `multihead.heads.scan`."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn

from multihead.heads._batch import append, block_of, check_whole, first_output, grow, keep_inputs
from multihead.heads._budget import read_metric
from multihead.heads._in_place import in_place_activations
from multihead.heads._inputs import call, scalar, takes_use_cache
from multihead.heads._prefix import PrefixRecorder, cut_all, cut_cache, idle, prefix_mismatch, unskip
from multihead.heads._record import Recording
from multihead.heads._shortcut import Shortcut
from multihead.heads._top import LastBlock, last_block
from multihead.heads.engine import Engine, Handler, Hooks, Layer, logits_of, parents_of


def variant_blocks(model: nn.Module, layers: list[Layer], parents: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """Where each layer's variants join the batch. Layers of every stack but the last
    (an encoder-decoder's encoder) join at the model's input: what sits between two stacks
    (the decoder's masks built from the encoder's batch and the inputs') is no block's."""
    blocks = {lay.index: block_of(model, lay.module, parents) for lay in layers}
    stacks = [parents.get(id(b)) for b in blocks.values()]
    last = stacks[-1]
    return {i: (b if stack is last else model) for (i, b), stack in zip(blocks.items(), stacks)}


class Grower:
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
        args = tuple(grow(a, self.rows, new_rows, self.B) for a in args)
        kwargs = {k: grow(v, self.rows, new_rows, self.B) for k, v in kwargs.items()}
        self.rows = new_rows
        return args, kwargs


class CorruptedRun(PrefixRecorder):
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


class FromCache:
    """Block pre-hooks of a chunk when the corrupted run's block inputs are cached: blocks
    below the first patched layer run on one row and one position (`idle`: their output is
    replaced), the first patched block starts from the cached input repeated once per
    variant, later patched blocks append their cached input for their variants. No
    corrupted row is recomputed.
    With `cut`, the cache holds the inputs on [p, T) already; what the forward hands the
    blocks is cut here."""

    def __init__(self, B: int, per_block: dict[int, int], cache: dict[int, tuple], cut: tuple[int, int] | None = None):
        self.B, self.per_block, self.cache = B, per_block, cache
        self.cut = cut  # (T, p): variants run on positions [p, T) (the shared prefix skipped)
        self.rows = 0
        self.T = 0  # the forward's positions, read off the first block's hidden states

    def begin(self):
        self.rows = self.T = 0

    def hook(self, block, args, kwargs):
        n, B = self.per_block.get(id(block), 0), self.B
        if self.rows == 0:
            if n == 0:
                if not self.T:
                    x = args[0] if args else kwargs.get("hidden_states")
                    self.T = x.shape[1] if isinstance(x, Tensor) and x.dim() == 3 else 1
                return idle(args, kwargs, B, self.T, None if self.cut is None else self.cut[0] - self.cut[1])
            cargs, ckw = self.cache[id(block)]
            self.rows = n * B
            merged = {**cut_all((), kwargs, self.cut)[1], **ckw}  # what the forward adds (the intervention) stays
            return (tuple(grow(a, B, self.rows, B) for a in cargs),
                    {k: grow(v, B, self.rows, B) for k, v in merged.items()})
        args, kwargs = cut_all(args, kwargs, self.cut)
        rows, new = self.rows, self.rows + n * B
        self.rows = new
        if n == 0:
            return tuple(grow(a, rows, rows, B) for a in args), {k: grow(v, rows, rows, B) for k, v in kwargs.items()}
        cargs, ckw = self.cache[id(block)]
        return (tuple(append(a, c, rows, n, B) for a, c in zip(args, cargs)),
                {k: append(v, ckw.get(k), rows, n, B) for k, v in kwargs.items()})


class ScanHandler(Handler):
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


def forward(model, corrupted, no_cache: bool, handler: Handler, grower, hooked: list, last: nn.Module | None,
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
            hooks.post(last, lambda m, a, out: unskip(out, tail[0], B))
        if final is not None:
            hooks.post(hooked[-1], lambda m, a, out: final.append(first_output(out)))
        hooks.pre(model, lambda m, a: grower.begin())
        with Engine(model, handler).installed(), torch.no_grad(), in_place_activations(model):
            return logits_of(call(model, corrupted, no_cache, **(keep or {})))
    finally:
        hooks.remove()


class ScanState:
    """What one patch_scan call holds: the model's blocks, the corrupted run's cached block
    inputs and, with the prefix skip, its prefix. Made per call (two threads may scan one
    model at once: the hooks act only in their own thread)."""

    def __init__(self, model, corrupted, rec: Recording, what: str, B: int, shortcut: bool = True,
                 trim: bool = True):
        self.model, self.corrupted, self.rec, self.what, self.B = model, corrupted, rec, what, B
        self.trim = trim  # whether the last block may run at the read position only
        self.layers = rec.layers
        parents = parents_of(model)
        self.parents = parents
        self.blocks = variant_blocks(model, self.layers, parents)  # layer -> where its variants join
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
        self.shortcut = Shortcut()
        per_block: dict[int, int] = {}
        for i in self.last_stack:
            per_block[id(self.blocks[i])] = per_block.get(id(self.blocks[i]), 0) + 1
        if shortcut and what in ("z", "pattern"):
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
        self.prefix = CorruptedRun(p, self.stack is not None, short.layers, self.what, self.rec)
        hooks = Hooks()
        try:
            for b in self.inner:
                hooks.pre(b, keep_inputs(cache), with_kwargs=True)
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
        never = sorted({type(b).__name__ for b in self.inner if id(b) not in cache})
        if never:  # its variants' rows would never join the batch
            raise ValueError(f"{type(self.model).__name__}'s attention layers sit in items of an nn.ModuleList that "
                             f"its forward never calls ({', '.join(never)}: it calls what they hold instead); valid: "
                             "a model whose ModuleList items are the blocks it calls, one layer's block each")
        short.z, short.src = self.prefix.z_of, self.prefix.src
        if isinstance(self.logits, Tensor) and self.logits.dim() == 3:
            self.last_logits = self.logits[:, -1].detach().clone()

    def decide_prefix(self, p: int, T: int) -> str:
        """After the corrupted run: take the skip (set `cut`, return "") or say why not."""
        cached, why = cut_cache(self.cache, (T, p))
        if cached is None:
            return why
        why = prefix_mismatch(self.rec, self.prefix, self.layers, self.cache, T, p, self.B)
        if why:
            return why
        self.cut, self.cut_cache = (T, p), cached
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
        why not (or why the kernel still runs every query, or the query projection every
        position)."""
        self.top = None
        if not self.trim:
            return "turned off"
        if not self.inner:
            return "the attention layers are in no block of a stack"
        block = self.inner[-1]
        top, why = last_block(self.model, block, [lay for lay in self.layers if self.blocks[lay.index] is block],
                              self.parents, self.metric, self.T)
        if top is None:
            return why
        self.top, query, first = top, top.query, ""
        # the fullest trim first; each of the two last-query cuts can fail alone (a mask the
        # kernel cannot cut, a module that writes into its queries)
        tries = list(dict.fromkeys([(query, True), (None, True), (query, False), (None, False)]))
        for top.query, top.queries in tries:
            why = self.last_block_check()
            if not why:
                break
            first = first or why
        else:
            self.top = None
            return why
        full = [part for part, cut in (("its attention kernel runs every query", top.queries),
                                       ("its query projection runs every position", top.query or not query)) if not cut]
        return f"taken, but {' and '.join(full)} (with the last query alone: {first})" if full else ""

    def last_block_check(self) -> str:
        """The corrupted run from the cached input of its last block, that block trimmed and
        nothing patched (through the prefix skip when it is taken): its output and logits at
        T - 1 must be the corrupted run's own, to float rounding."""
        B, block, final = self.B, self.top.block, []
        grower = FromCache(B, {id(block): 1}, self.cut_cache if self.cut else self.cache, self.cut)
        handler = ScanHandler(self.what, self.rec, B, None, self.prefix.data if self.cut else None, self.cut)
        try:
            logits = forward(self.model, self.corrupted, self.no_cache, handler, grower, self.inner,
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
        grower = FromCache(B, {id(self.stack[0]): 1}, self.cut_cache, self.cut)
        handler = ScanHandler(self.what, self.rec, B, None, self.prefix.data, self.cut)
        forward(self.model, self.corrupted, self.no_cache, handler, grower, self.inner, self.stack[-1],
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
        handler = ScanHandler(self.what, self.rec, B, pos, self.prefix.data if cut else None, cut)
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
            grower = FromCache(B, per_block, self.cut_cache if cut else self.cache, cut)
        else:
            grower = Grower(B, per_block)
        hooked = self.inner if cached else self.block_list
        top = self.top
        extra = self.shortcut.hooks(joining, B, pos, cut, zero, top.layer.index if top else None) if joining else []
        if top is not None:
            extra += top.hooks()
        keep = self.keep if top is None else {**self.keep, **top.keywords()}
        logits = forward(self.model, self.corrupted, self.no_cache, handler, grower, hooked,
                          self.stack[-1] if cut else None, self.tail, B, extra, final, keep)
        check_whole(logits, first_row, self.model)
        return logits, start, order

    def cost(self, chunk: list[tuple[int, int]], head: float) -> float:
        """A chunk's forward in block-rows (B rows through one block): each variant runs the
        blocks from its own upward, then the model's head (`head` blocks' worth per row)."""
        where = {id(b): j for j, b in enumerate(self.block_list)}
        n = len(self.block_list)
        frac = 1.0 if self.cut is None else (self.cut[0] - self.cut[1]) / self.cut[0]
        return sum((n - where[id(self.blocks[layer])]) * frac + head for layer, _ in chunk)
