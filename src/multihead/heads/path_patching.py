"""Path patching: what one head does to another head's input, or to the logits directly.

Wang et al. (2022), "Interpretability in the Wild: a Circuit for Indirect Object
Identification in GPT-2 small", section 3.1. For senders (query heads) and receivers:
1. record every head's z (the output projection's input, per head) on clean and corrupted;
2. run corrupted with every head's z pinned to its corrupted value, the senders' to their
   clean value (everything else recomputes), and keep each receiver's input (its query,
   or its key/value head's keys or values);
3. run corrupted with only the receivers' inputs replaced by step 2's and read the metric.
The receiver "logits" is the direct path: step 3's final residual plus the senders'
clean-minus-corrupted results (after the norm that follows the attention in Gemma 2/3).
`path_patch_scan` makes every head the only sender in few batched forwards on the scans'
shared parts (`_batch`, `_prefix`, `_budget`, `_runner`).
Where queries are taken, the prefix skip and the batching: docs/heads-circuit.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from multihead.heads._align import aligned
from multihead.heads._batch import block_of, check_whole, first_output, grow, keep_inputs, one_row, with_first
from multihead.heads._budget import (
    bytes_per_row,
    check_memory,
    head_cost,
    keep_positions,
    model_width,
    read_metric,
    variants_per_forward,
)
from multihead.heads._in_place import in_place_activations
from multihead.heads._inputs import call, check_inputs, check_variants_per_run, scalar, takes_use_cache
from multihead.heads._interventions import check_heads
from multihead.heads._prefix import PrefixRecorder, cut_all, cut_cache, sees_ahead, shared_prefix
from multihead.heads._ranks import Ranks, check_group, fingerprint
from multihead.heads._record import Recording, head_results, record
from multihead.heads._runner import run_units, table
from multihead.heads.engine import (
    KEYWORD,
    Engine,
    Handler,
    Hooks,
    Layer,
    is_hf,
    logits_of,
    multihead_modules,
    parents_of,
)
from multihead.heads.progress import check_progress

VIAS = ("q", "k", "v")
LOGITS = "logits"


# ---------------------------------------------------------------- what the caller asked for


def check_via(via) -> str:
    if not isinstance(via, str):
        raise TypeError(f"via must be one of {', '.join(map(repr, VIAS))}; received {via!r} ({type(via).__name__})")
    if via not in VIAS:
        raise ValueError(f"via must be one of {', '.join(map(repr, VIAS))}; received {via!r}")
    return via


def check_receivers(receivers, via: str) -> tuple[list[tuple[int, int, str]], bool]:
    """([(layer, head, via), ...], whether the direct path to the logits is a receiver).

    Receivers are "logits", or a sequence of (layer, head) pairs (their input is `via`),
    (layer, head, "q"|"k"|"v") triples (their own input) and the string "logits"."""
    via = check_via(via)
    if isinstance(receivers, str):
        if receivers != LOGITS:
            raise ValueError(f"receivers must be 'logits' or a sequence of (layer, head) pairs; "
                             f"received {receivers!r}")
        return [], True
    if isinstance(receivers, tuple) and len(receivers) in (2, 3) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in receivers[:2]) and \
            (len(receivers) == 2 or isinstance(receivers[2], str)):
        receivers = [receivers]
    if not isinstance(receivers, Iterable) or isinstance(receivers, bytes):
        raise TypeError(f"receivers must be 'logits' or a sequence of (layer, head) pairs; received {receivers!r}")
    out, logits = [], False
    for r in receivers:
        if isinstance(r, str) and r == LOGITS:
            logits = True
            continue
        if isinstance(r, (tuple, list)) and len(r) == 3:
            if not isinstance(r[2], str) or r[2] not in VIAS:
                error = ValueError if isinstance(r[2], str) else TypeError
                raise error(f"a receiver triple's input must be one of {', '.join(map(repr, VIAS))}; received {r!r}")
            (layer, head), = check_heads([tuple(r[:2])], "receivers")
            out.append((layer, head, r[2]))
            continue
        (layer, head), = check_heads([r], "receivers")
        out.append((layer, head, via))
    if not out and not logits:
        raise ValueError("receivers is empty; pass 'logits' or (layer, head) pairs")
    return sorted(set(out)), logits


def _check_ranges(layers: list[Layer], senders: list[tuple[int, int]], receivers: list[tuple[int, int, str]]):
    n = len(layers)
    bad = sorted({layer for layer, _ in senders if layer >= n} | {layer for layer, _, _ in receivers if layer >= n})
    if bad:
        raise ValueError(f"layer(s) {bad} out of range: this model has {n} attention layers (0..{n - 1})")
    for layer, head in senders:
        H = layers[layer].H
        if head >= H:
            raise ValueError(f"sender head {head} out of range in layer {layer}, which has {H} query heads "
                             f"(0..{H - 1})")
    for layer, head, via in receivers:
        lay = layers[layer]
        n_heads, kind = (lay.H, "query heads") if via == "q" else (lay.Hkv, "key/value heads")
        if head >= n_heads:
            raise ValueError(f"receiver head {head} (via {via!r}) out of range in layer {layer}, which has "
                             f"{n_heads} {kind} (0..{n_heads - 1})")


def _by_layer(receivers: list[tuple[int, int, str]], above: int) -> dict[tuple[int, str], list[int]]:
    """(layer, via) -> heads, for the receivers above layer `above` (the only ones a sender reaches)."""
    out: dict[tuple[int, str], list[int]] = {}
    for layer, head, via in receivers:
        if layer > above:
            out.setdefault((layer, via), []).append(head)
    return out


# ---------------------------------------------------------------- queries


class _QueryAdapter:
    """Wraps the engine's `multihead_heads=` object: queries after its keys and values."""

    def __init__(self, inner, queries: _Queries):
        self.inner, self.queries = inner, queries

    def inputs(self, module, q, k, v):
        q, k, v = self.inner.inputs(module, q, k, v)
        lay = self.queries.engine.layers[id(module)]
        t = q.transpose(1, 2)  # (B, T, H, D)
        new = self.queries.fn(lay, t)
        return (q if new is t else new.transpose(1, 2)), k, v

    def output(self, module, out, value):
        return self.inner.output(module, out, value)


class _Queries:
    """Hands every layer's queries `(B, T, H, Dq)` to `fn(layer, q) -> q`: a transformers
    model's in its attention function, multihead modules' as their query projection's
    output. Enter inside the engine's `installed()`: its layers are numbered by then."""

    def __init__(self, engine: Engine, fn: Callable[[Layer, Tensor], Tensor]):
        self.engine, self.fn = engine, fn

    @contextmanager
    def installed(self):
        model = self.engine.model
        hooks = Hooks()  # act only in this thread, as the engine's do
        try:
            if self.engine.hf:  # registered after the engine's hook, so it finds the engine's adapter
                hooks.pre(model, self._top, with_kwargs=True)
            for m in multihead_modules(model):  # also in a transformers model (to_mla's layers, a patched DeepSeek)
                hooks.post(m.head_access().q, lambda mod, a, out, m=m: self._proj(m, out))
            yield self
        finally:
            hooks.remove()

    def _top(self, model, args, kwargs):
        kwargs = dict(kwargs)
        kwargs[KEYWORD] = _QueryAdapter(kwargs[KEYWORD], self)
        return args, kwargs

    def _proj(self, m, out: Tensor):
        lay = self.engine.layers[id(m)]
        B, T, width = out.shape
        t = out.view(B, T, lay.H, width // lay.H)  # (B, T, H, Dq)
        new = self.fn(lay, t)
        return None if new is t else new.reshape(B, T, width)


# ---------------------------------------------------------------- the steps' handlers


class _Stop(Exception):
    """Step 2 has every receiver's input: the layers above are not needed."""


class _Step(Handler):
    """What both steps do: act on the receivers' queries, keys and values (`_at`, each step
    its own); under the prefix skip, keys and values of positions [p, T) get the corrupted
    run's [0, p) in front (the attention reads them as a KV cache)."""

    receivers: dict[tuple[int, str], list[int]]

    def __init__(self, skip: _Skip | None):
        self.skip = skip

    def _at(self, lay: Layer, t: Tensor, via: str) -> Tensor:
        raise NotImplementedError

    def q(self, lay, q):
        return self._at(lay, q, "q")

    def k(self, lay, k):
        return self._at(lay, self._full(lay, k, "k"), "k")

    def v(self, lay, v):
        return self._at(lay, self._full(lay, v, "v"), "v")

    def wants_kv(self, lay):
        return any(via != "q" for _, via in self.receivers)

    def _full(self, lay: Layer, t: Tensor, what: str) -> Tensor:
        sk = self.skip
        if sk is None or t.shape[1] != sk.T - sk.p:
            return t
        head = sk.prefix[what, lay.index]  # (B, p, Hkv, D)
        return torch.cat([head.to(t.dtype).repeat(t.shape[0] // head.shape[0], 1, 1, 1), t], dim=1)


class _Pinned(_Step):
    """Step 2 for n variants (variant i in rows [i B, (i + 1) B)): from layer `start` on,
    every head's z is the corrupted run's, each variant's senders' the clean run's; the
    receivers' inputs are kept, and `stop` (a layer) ends the forward once they are."""

    def __init__(self, corrupted: Recording, clean: Recording, senders: list[list[tuple[int, int]]],
                 receivers: dict[tuple[int, str], list[int]], B: int, start: int = 0, stop: int | None = None,
                 skip: _Skip | None = None):
        super().__init__(skip)
        self.corrupted, self.clean = corrupted, clean
        self.senders = senders
        self.receivers = receivers
        self.B, self.start, self.stop = B, start, stop
        self.kept: dict[tuple[int, str], Tensor] = {}

    def z(self, lay, z, v):
        if lay.index < self.start:
            return z
        B, t = self.B, z.shape[1]  # t: T, or T - p under the prefix skip (the positions this forward runs)
        corrupted = self.corrupted["z", lay.index]
        new = corrupted[:, corrupted.shape[1] - t:].to(z.dtype).repeat(z.shape[0] // B, 1, 1, 1)  # (n B, t, H, Dv)
        clean = self.clean["z", lay.index][:, corrupted.shape[1] - t:]
        for i, heads in enumerate(self.senders):
            for layer, h in heads:
                if layer == lay.index:
                    new[i * B:(i + 1) * B, :, h] = clean[:, :, h].to(z.dtype)
        return new

    def _at(self, lay: Layer, t: Tensor, via: str) -> Tensor:
        hs = self.receivers.get((lay.index, via))
        if hs is not None:
            self.kept[lay.index, via] = t[:, :, hs].clone()  # (n B, T|S, receivers, D)
            if lay.index == self.stop and all(key in self.kept for key in self.receivers):
                raise _Stop
        return t


class _Received(_Step):
    """Step 3: the receivers' inputs are step 2's, everything else this run's own."""

    def __init__(self, kept: dict[tuple[int, str], Tensor], receivers: dict[tuple[int, str], list[int]],
                 skip: _Skip | None = None):
        super().__init__(skip)
        self.kept, self.receivers = kept, receivers

    def _at(self, lay: Layer, t: Tensor, via: str) -> Tensor:
        new = self.kept.get((lay.index, via))
        if new is None:
            return t
        t = t.clone()
        t[:, :, self.receivers[lay.index, via]] = new.to(t.dtype)
        return t


# ---------------------------------------------------------------- running the model


def _call(model: nn.Module, inputs, **extra):
    """model(inputs) without a KV cache (a scan's forwards change their batch between blocks);
    `extra`: keywords of the call (`logits_to_keep`)."""
    return call(model, inputs, takes_use_cache(model), **extra)


def _forward(model: nn.Module, inputs, handler: Handler, hooks: list[tuple[nn.Module, str, Callable]],
             keep: dict | None = None):
    """One forward with `handler` on the heads and `hooks` (module, "pre"|"post", fn) on the
    blocks; the logits, or None when step 2 stopped early. `keep`: {"logits_to_keep": the
    positions the metric reads} (`_Runs.keep`), or None for every position's logits."""
    installed = Hooks()
    try:
        for module, kind, fn in hooks:
            if kind == "pre":
                installed.pre(module, fn, with_kwargs=True)
            else:
                installed.post(module, fn)
        engine = Engine(model, handler)
        with engine.installed(), _Queries(engine, handler.q).installed(), torch.no_grad(), in_place_activations(model):
            try:
                return logits_of(_call(model, inputs, **(keep or {})))
            except _Stop:
                return None
    finally:
        installed.remove()


def _post_norm(block: nn.Module) -> nn.Module | None:
    """The norm a post-norm block applies to its attention's output before the residual sum
    (transformers' Gemma 2/3 and OLMo 2 name it post_attention_layernorm, beside a
    post_feedforward_layernorm; in Llama the same name is the MLP's pre-norm), or None."""
    norm = getattr(block, "post_attention_layernorm", None)
    return norm if isinstance(norm, nn.Module) and hasattr(block, "post_feedforward_layernorm") else None


class _Runs:
    """What every path patch of one (clean, corrupted) pair shares: both runs' z, the
    corrupted logits and metric, the layers, and each head's clean-minus-corrupted result."""

    def __init__(self, model, clean, corrupted, metric):
        self.B = check_inputs(model, clean, corrupted, metric)
        self.model, self.corrupted_inputs, self.metric = model, corrupted, metric
        self.clean = record(model, clean)
        self.corrupted = record(model, corrupted)
        self.layers = self.corrupted.layers
        for lay in self.layers:
            a, b = self.clean["z", lay.index], self.corrupted["z", lay.index]
            if a.shape != b.shape:
                raise ValueError(f"clean and corrupted runs must have the same shape; layer {lay.index}'s z is "
                                 f"{tuple(a.shape)} on clean and {tuple(b.shape)} on corrupted")
        self.corrupted_metric = scalar(metric(self.corrupted.logits), "on the corrupted run")
        logits = self.corrupted.logits
        self.vocab = logits.shape[-1] if logits.dim() >= 3 else 0
        self.itemsize = logits.element_size()
        self.clean.logits = self.corrupted.logits = None  # (B, T, vocab) each: 0.8 GB at 4,096 positions of SmolLM2
        self.T = logits.shape[1] if logits.dim() >= 3 else 0
        self.keep = keep_positions(model, metric, self.T, self.B)
        self._deltas: dict[int, Tensor] = {}  # one layer's (B, T, H, C): the senders come layer by layer
        self.parents = parents_of(model)

    def delta(self, layer: int) -> Tensor:
        """What each head of `layer` alone, its z clean, adds to the residual stream of the
        corrupted run: `(B, T, H, C)` (see `direct`)."""
        if layer not in self._deltas:
            self._deltas.clear()
            lay = self.layers[layer]
            d = head_results(self.model, lay, self.clean["z", layer] - self.corrupted["z", layer])  # (B, T, H, C)
            self._deltas[layer] = self._normed(layer, d, 2)
        return self._deltas[layer]

    def direct(self, senders: list[tuple[int, int]]) -> Tensor:
        """What the senders, their z clean, add to the residual stream of the corrupted run
        with every later layer's output held: `(B, T, C)`. A pre-norm block adds the output
        projection's change; a post-norm block (Gemma 2/3, OLMo 2) adds the change of its norm's
        output, the senders of one layer together (the norm couples the heads of a layer)."""
        total = 0
        for layer in sorted({layer for layer, _ in senders}):
            hs = [h for i, h in senders if i == layer]
            d = head_results(self.model, self.layers[layer], self.clean["z", layer] - self.corrupted["z", layer])
            total = total + self._normed(layer, d[:, :, hs].sum(2), None)  # (B, T, C)
        return total

    def _normed(self, layer: int, d: Tensor, at: int | None) -> Tensor:
        """`d`, a change of layer's attention output (a head axis at `at`, or none), as the
        change it makes to the residual stream: itself, or post_norm(out + d) - post_norm(out)
        where a norm follows the attention (out: the corrupted run's attention output)."""
        norm = _post_norm(block_of(self.model, self.layers[layer].module, self.parents))
        if norm is None:
            return d
        lay = self.layers[layer]
        z = self.corrupted["z", layer]
        out = head_results(self.model, lay, z).sum(2)  # (B, T, C)
        bias = getattr(getattr(lay.module, "o_proj", None), "bias", None)
        if bias is not None:
            out = out + bias.detach().to(out.dtype)
        if at is not None:
            out = out.unsqueeze(at)
        with torch.no_grad():
            return norm(out + d) - norm(out)

    def last_block(self, senders: list[tuple[int, int]]) -> nn.Module:
        """The block whose output is the final residual; refuses senders outside its stack."""
        blocks = [block_of(self.model, lay.module, self.parents) for lay in self.layers]
        last = blocks[-1]
        stack = self.parents.get(id(last))
        if last is self.model or not isinstance(stack, nn.ModuleList):
            raise ValueError(f"receivers='logits' adds the senders' results to the final residual, the output of "
                             f"the last block of an nn.ModuleList; {type(self.model).__name__}'s attention layers "
                             "sit in no ModuleList")
        off = sorted({layer for layer, _ in senders if self.parents.get(id(blocks[layer])) is not stack})
        if off:
            raise ValueError(f"receivers='logits': sender layer(s) {off} are not in the stack of blocks whose output "
                             "the model's head reads (an encoder's layers reach the logits only through "
                             "cross-attention); pick senders of the last stack")
        return last

    def metric_of(self, logits: Tensor, where: str) -> float:
        """The metric of one run's logits (those of the kept positions only with `self.keep`)."""
        return scalar(read_metric(self.metric, logits, self.keep, self.T), where)


def _one(runs: _Runs, senders: list[tuple[int, int]], receivers: list[tuple[int, int, str]], logits: bool) -> float:
    """The three steps for one set of senders, on full forwards of the B rows."""
    low = min(layer for layer, _ in senders)
    mine = _by_layer(receivers, low)
    if not mine and not logits:
        return runs.corrupted_metric  # no receiver is reached: the corrupted run, exactly
    model, B = runs.model, runs.B
    kept: dict = {}
    if mine:
        step2 = _Pinned(runs.corrupted, runs.clean, [senders], mine, B, stop=max(layer for layer, _ in mine))
        _forward(model, runs.corrupted_inputs, step2, [])
        kept = step2.kept
    hooks = []
    if logits:
        last = runs.last_block(senders)
        delta = runs.direct(senders)  # (B, T, C)
        def add_delta(m, a, out):
            x = first_output(out)
            return with_first(out, x + delta.to(x.dtype))

        hooks.append((last, "post", add_delta))
    out = _forward(model, runs.corrupted_inputs, _Received(kept, mine), hooks, runs.keep)
    return runs.metric_of(out, "on the patched run")


def path_patch(model, clean, corrupted, metric: Callable[[Tensor], Tensor], senders, receivers,
               via: str = "q") -> float:
    """The metric of the corrupted run with the senders' effect let through to the receivers only.

    Args:
        model: a transformers model on attn_implementation="multihead", or a module built
            from multihead's Attention/LatentAttention.
        clean, corrupted: inputs of the same shape (a tensor of input_ids or a mapping of
            keyword arguments).
        metric: logits of one run (`(B, ...)` of its B rows) -> a scalar tensor.
        senders: (layer, head) query heads.
        receivers: "logits" (the direct path), or (layer, head) pairs: query heads for
            via="q", key/value heads for via="k"/"v". A sequence may also hold
            (layer, head, "q"|"k"|"v") triples (each receiver's own input) and "logits"
            (the senders' results added to the final residual as well): several paths at once.
        via: the receivers' input: "q" (query), "k" (keys) or "v" (values).

    Returns the metric after the three steps (see the module docstring); the corrupted metric,
    exactly, when every sender sits at or above every receiver's layer.
    """
    receivers, logits = check_receivers(receivers, via)
    pairs = check_heads(senders, "senders")
    if not pairs:
        raise ValueError("senders is empty; pass (layer, head) pairs of query heads")
    runs = _Runs(model, clean, corrupted, metric)
    _check_ranges(runs.layers, pairs, receivers)
    return _one(runs, pairs, receivers, logits)


# ---------------------------------------------------------------- the scan's rows


class _Skip:
    """The prefix [0, p) clean and corrupted share, on a causal decoder: there every run of
    the scan is the corrupted run (the senders' clean z equal the corrupted z there), so
    the variants run positions [p, T) only, their attention reading the corrupted run's
    keys and values of [0, p) (`prefix`), and the last block's output gets the corrupted
    run's [0, p) back (`tail`)."""

    def __init__(self, T: int, p: int, prefix: dict[tuple[str, int], Tensor], tail: Tensor):
        self.T, self.p, self.prefix, self.tail = T, p, prefix, tail


class _Join:
    """Block pre-hooks for a forward of n variants that all start at block `start`: the
    blocks below run on one row (their output unused), `start` takes the corrupted run's
    cached input (n copies of its B rows), the blocks above get the per-batch tensors the
    model hands them repeated (and cut to [p, T) under the prefix skip). `start=None`:
    every block runs on one row (the direct path's forward replaces the last one's output)."""

    def __init__(self, start: nn.Module | None, cache: dict[int, tuple], n: int, B: int, skip: _Skip | None):
        self.start, self.cache, self.n, self.B, self.skip = start, cache, n, B, skip
        self.started = False

    def begin(self):
        self.started = False

    def hook(self, block, args, kwargs):
        n, B = self.n, self.B
        if block is self.start:
            self.started = True
            cargs, ckw = self.cache[id(block)]
            kwargs = {**kwargs, **ckw}  # the forward's own keywords (the intervention) stay
            return tuple(grow(a, B, n * B, B) for a in cargs), {k: grow(v, B, n * B, B) for k, v in kwargs.items()}
        if not self.started:
            return tuple(one_row(a, B) for a in args), {k: one_row(v, B) for k, v in kwargs.items()}
        if self.skip is not None:  # the hidden states are cut already; what the model hands each block is not
            args, kwargs = cut_all(args, kwargs, (self.skip.T, self.skip.p))
        # the hidden states have n B rows already (left as they are); the model's per-batch tensors still B
        return tuple(grow(a, B, n * B, B) for a in args), {k: grow(v, B, n * B, B) for k, v in kwargs.items()}

    def hooks(self, model: nn.Module, blocks: list[nn.Module]) -> list[tuple[nn.Module, str, Callable]]:
        return [(model, "pre", lambda m, a, kw: self.begin())] + [(b, "pre", self.hook) for b in blocks]


class _Laid:
    """What the scan's forwards start from: each layer's block, the corrupted run's input to
    each block (cut to [p, T) under the prefix skip) and its final residual `(B, T, C)`."""

    def __init__(self, blocks: list[nn.Module], cache: dict[int, tuple], final: Tensor, skip: _Skip | None):
        self.blocks, self.cache, self.final, self.skip = blocks, cache, final, skip

    def finish(self, n: int, B: int, delta: Tensor | None, replace: bool = False):
        """The last block's forward hook: the corrupted prefix back (prefix skip), the
        senders' results added (direct path), or (`replace`) the corrupted final residual
        plus those results instead of what the blocks computed."""
        def hook(m, a, out):
            x = first_output(out)
            if replace:
                x = self.final.repeat(n, 1, 1)
            elif self.skip is not None and x.shape[1] == self.skip.T - self.skip.p:
                x = torch.cat([self.skip.tail.to(x.dtype).repeat(x.shape[0] // B, 1, 1), x], dim=1)
            if delta is not None:
                x = x + delta.to(x.dtype)
            return with_first(out, x)
        return hook


def _lay_out(runs: _Runs, clean) -> _Laid | None:
    """The scan's layout when every layer has a block of its own in one ModuleList (a
    decoder); None otherwise (the scan then runs the three steps on full forwards, sender by
    sender). The prefix skip is taken where it is exact (see `_Skip`): a transformers decoder
    whose every layer says `is_causal`, block inputs of kinds it can cut, both runs' z equal
    on the prefix, no mask that lets the prefix see ahead, and the corrupted run put through
    the skip giving back its own logits."""
    model, B = runs.model, runs.B
    blocks = [block_of(model, lay.module, runs.parents) for lay in runs.layers]
    stack = runs.parents.get(id(blocks[0]))
    if any(b is model for b in blocks) or len({id(b) for b in blocks}) != len(blocks) or \
            not isinstance(stack, nn.ModuleList) or any(runs.parents.get(id(b)) is not stack for b in blocks):
        return None
    p, T = shared_prefix(clean, runs.corrupted_inputs)
    skip_ok = 0 < p < T and is_hf(model) and not multihead_modules(model) and \
        not getattr(model.config, "is_encoder_decoder", False) and \
        all(getattr(lay.module, "is_causal", False) is True for lay in runs.layers)
    cache: dict[int, tuple] = {}
    hooks = Hooks()
    for b in blocks:
        hooks.pre(b, keep_inputs(cache), with_kwargs=True)
    final: list[Tensor] = []
    hooks.post(blocks[-1], lambda m, a, out: final.append(first_output(out)))
    prefix = PrefixRecorder(p, z=False)
    try:
        with torch.no_grad(), Engine(model, prefix).installed():
            logits = logits_of(_call(model, runs.corrupted_inputs))
    finally:
        hooks.remove()
    if len(cache) != len(blocks) or not final or logits.shape[0] != B or final[0].shape[0] != B:
        return None
    laid = _Laid(blocks, cache, final[0], None)
    if not skip_ok or not all(torch.allclose(runs.clean["z", i][:, :p], runs.corrupted["z", i][:, :p], rtol=1e-5,
                                             atol=1e-6 * (1 + float(runs.corrupted["z", i].abs().max())))
                              for i in range(len(blocks))):
        return laid
    cut, _ = cut_cache(cache, (T, p))
    if cut is None:
        return laid
    if any(sees_ahead(x, T, p, B) for args, kwargs in cache.values() for x in (*args, *kwargs.values())):
        return laid
    skip = _Skip(T, p, prefix.data, final[0][:, :p])
    skipped = _Laid(blocks, cut, final[0], skip)
    again = _forward(model, runs.corrupted_inputs, _Received({}, {}, skip),
                     _Join(blocks[0], cut, 1, B, skip).hooks(model, blocks) +
                     [(blocks[-1], "post", skipped.finish(1, B, None))])
    if again.shape != logits.shape or not torch.allclose(again, logits, rtol=1e-5,
                                                         atol=1e-5 * (1 + float(logits.abs().max()))):
        return laid  # a block input the cut does not read right: every position runs
    return skipped


def _scan_setup(model, clean, corrupted, metric, receivers, via: str, variants_per_run, max_memory, progress):
    """path_patch_scan's checks, both runs and its layout: (receivers, logits, runs, per_run, laid)."""
    rec, logits = check_receivers(receivers, via)
    budget = check_memory(max_memory)
    check_progress(progress)
    check_variants_per_run(variants_per_run)
    clean_, corrupted_, metric_, _ = aligned(model, clean, corrupted, metric, None, last_block=False)
    runs = _Runs(model, clean_, corrupted_, metric_)
    _check_ranges(runs.layers, [], rec)
    if logits:
        runs.last_block([(lay.index, 0) for lay in runs.layers])  # refuses senders the direct path cannot take
    laid = _lay_out(runs, clean_)
    lay0 = runs.layers[0]
    T = runs.corrupted["z", lay0.index].shape[1]
    if laid is not None and laid.skip is not None:
        T -= laid.skip.p
    per_row = bytes_per_row(runs.vocab, runs.itemsize, laid.blocks if laid is not None else [model],
                            model_width(model, lay0.H * lay0.Dv), T,
                            len(runs.keep["logits_to_keep"]) if runs.keep else None)
    auto = variants_per_forward(per_row, runs.B, budget, T)[0]
    per_run = auto if variants_per_run is None else variants_per_run
    return rec, logits, runs, per_run, laid


def _scan_units(runs: _Runs, laid: _Laid | None, rec, logits: bool, per_run: int) -> tuple[list, list, list]:
    """(units (sender layer, its heads, the receivers above it by layer), their costs in
    block-rows, the cells that need no forward: the corrupted metric where no receiver is reached)."""
    layers = runs.layers
    units, costs, cells = [], [], []
    head = head_cost(runs.model, laid.blocks) if laid is not None else 0.0
    for lay in layers:
        mine = _by_layer(rec, lay.index)
        if not mine and not logits:
            cells += [((lay.index, h), runs.corrupted_metric) for h in range(lay.H)]
            continue
        for s in range(0, lay.H, per_run):
            units.append((lay.index, list(range(s, min(lay.H, s + per_run))), mine))
            # block-rows: step 2 from the sender to the last receiver, step 3 from the first receiver up
            blocks = (max(i for i, _ in mine) - lay.index + 1 + len(layers) - min(i for i, _ in mine)) if mine else 0
            costs.append(len(units[-1][1]) * (blocks + head))
    return units, costs, cells


def path_patch_scan(model, clean, corrupted, metric: Callable[[Tensor], Tensor], receivers, via: str = "q", *,
                    variants_per_run: int | None = None, max_memory: int | None = None, progress=None,
                    group=None) -> Tensor:
    """`path_patch` with every query head as the only sender: `(layers, heads)` float32.

    Args as in `path_patch` (the receivers the same for every sender); `variants_per_run`:
    how many senders one forward carries (default: as many as `max_memory` holds, at most
    16 // B, or more when the rows run few positions (`variants_per_forward`), at least 1);
    `max_memory` and `progress` as in `patch_scan`. A cell is the corrupted metric,
    exactly, where the sender sits at or above every receiver's layer; NaN where a layer
    has fewer heads than the widest. On a causal transformers decoder the prefix clean and
    corrupted share is skipped, as in `patch_scan`; an `AtPositions` metric's rows are
    rolled to end where it reads first, where that is checked equal (`_align`). `group`: None, or a
    torch.distributed process group, as in `patch_scan` (each rank runs whole chunks of
    senders; every rank returns the one process's table, bitwise).
    """
    check_group(group)
    ranks = Ranks(group, "path_patch_scan")

    def agreed(done):  # what every rank must share for the tables to be one table
        rec, logits, runs, per_run, laid = done
        skip = None if laid is None or laid.skip is None else (laid.skip.T, laid.skip.p)
        return fingerprint(model, clean, corrupted), rec, logits, per_run, laid is None, skip

    rec, logits, runs, per_run, laid = ranks.run(lambda: _scan_setup(model, clean, corrupted, metric, receivers, via,
                                                                    variants_per_run, max_memory, progress), agreed)
    units, costs, cells = _scan_units(runs, laid, rec, logits, per_run)

    def run(unit) -> list[float]:
        layer, heads, mine = unit
        if laid is None:
            return [_one(runs, [(layer, h)], rec, logits) for h in heads]
        return _chunk(runs, laid, layer, heads, mine, logits)

    results, _ = run_units(ranks, units, costs, run, progress, "path_patch_scan", size=lambda unit: len(unit[1]))
    cells += [((layer, h), value) for (layer, heads, _), values in zip(units, results)
              for h, value in zip(heads, values)]
    return table([lay.H for lay in runs.layers], cells)


def _chunk(runs: _Runs, laid: _Laid, layer: int, heads: list[int], mine: dict[tuple[int, str], list[int]],
           logits: bool) -> list[float]:
    """Steps 2 and 3 for senders `heads` of `layer`, each alone: one forward each."""
    model, B, n, blocks, skip = runs.model, runs.B, len(heads), laid.blocks, laid.skip
    kept: dict = {}
    if mine:
        step2 = _Pinned(runs.corrupted, runs.clean, [[(layer, h)] for h in heads], mine, B, start=layer,
                        stop=max(i for i, _ in mine), skip=skip)
        _forward(model, runs.corrupted_inputs, step2, _Join(blocks[layer], laid.cache, n, B, skip).hooks(model, blocks))
        kept = step2.kept
    join = _Join(blocks[min(i for i, _ in mine)] if mine else None, laid.cache, n, B, skip)
    delta = torch.cat([runs.delta(layer)[:, :, h] for h in heads]) if logits else None  # (n B, T, C)
    hooks = join.hooks(model, blocks) + [(blocks[-1], "post", laid.finish(n, B, delta, replace=not mine))]
    got = _forward(model, runs.corrupted_inputs, _Received(kept, mine, skip), hooks, runs.keep)
    check_whole(got, n * B, model)
    return [runs.metric_of(got[i * B:(i + 1) * B], f"for layer {layer} head {h}") for i, h in enumerate(heads)]

