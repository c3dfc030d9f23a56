"""Per-head summaries of every head of a model at any length, in bounded memory.

`summaries(model, text)` runs the text once on the fused kernel; an observer recomputes
each layer's probabilities a block of query rows at a time and folds them into
`rowstats.RowSums`, so never more than one block's scores exist, whatever T is.
`head_roles(summaries)` ranks heads from the same numbers.

Details: docs/inspect.md, "How `summaries` streams a model".
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from multihead.checks import check_int
from multihead.inspect.capture import encode_text, model_for_run, select_indices
from multihead.inspect.rowstats import BEYOND, RowSums
from multihead.kernels.common import NEG, acc_dtype, index, softmax_entropy
from multihead.kernels.math import rows_mask
from multihead.kernels.planner import serial_ops
from multihead.masks import MaskMod

__all__ = ["SUMMARY_FIELDS", "HeadSummaries", "summaries"]

#: The per-head numbers of `HeadSummaries.to_json()`, in this order (None where a text cannot show one).
SUMMARY_FIELDS = ("entropy", "mean_distance", "first_token_mass", "previous_token", "duplicate_token", "induction",
                  *BEYOND, "normalized_entropy", "current_token", "first_token", "delimiter", "next_token")
#: Scores in one block of query rows (float32 elements, all heads of a layer): 4 MiB, so that
#: the block's passes run from a core's cache (the sizes tried: docs/inspect.md).
BLOCK_ELEMENTS = 1 << 20
TOP_K = 8
GRID = 256


@dataclass(repr=False)
class HeadSummaries:
    """Per-head summaries of one text through one model.

    Attributes:
        tokens, token_ids: the T tokens.
        layers, heads: the summarised layer and head indices (the same heads in every layer).
        n_layers, n_heads: the model's geometry.
        scores: {name: float32 `(len(layers), len(heads))`}: every statistic of
            `multihead.inspect.rowstats` (absent where the text cannot show it).
        match_rows: query rows with a duplicate-token / induction match (head_roles' guards).
        top_index, top_weight: `(len(layers), len(heads), T, k)` int32 key indices and
            float16 weights of each query's k largest weights (-1 / 0 past the keys with weight).
        patterns: {(layer, head): float32 `(g, g)`} block sums of the weights over g x g
            bins of rows and keys (bin of position i: i * g // T), for the heads asked.
        model, meta: as in `AttentionCapture`.
    """

    tokens: list[str]
    token_ids: list[int]
    layers: list[int]
    heads: list[int]
    n_layers: int
    n_heads: int
    scores: dict[str, Tensor]
    match_rows: dict[str, int]
    top_index: Tensor | None = None
    top_weight: Tensor | None = None
    patterns: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    model: str = ""
    meta: dict = field(default_factory=dict)

    def __getattr__(self, name: str) -> Tensor:
        """`s.entropy`, `s.induction`, ...: the `(layers, heads)` array of one statistic."""
        if name.startswith("__") or name in ("scores",):
            raise AttributeError(name)
        scores = self.__dict__.get("scores", {})
        if name in scores:
            return scores[name]
        if name in SUMMARY_FIELDS:
            raise AttributeError(f"{name} is not defined for this text (e.g. no repeated token, no delimiter, "
                                 f"or no key that far back); defined: {', '.join(scores)}")
        raise AttributeError(f"HeadSummaries has no attribute {name!r}; per-head arrays: {', '.join(scores)}")

    def __repr__(self) -> str:
        every = len(self.layers) == self.n_layers and len(self.heads) == self.n_heads
        what = "every head" if every else f"{len(self.layers)} layers x {len(self.heads)} heads"
        return (f"HeadSummaries(model={self.model!r}, {len(self.tokens)} tokens, {self.n_layers} layers x "
                f"{self.n_heads} heads; {what}: {', '.join(self.scores)})")

    def head(self, layer: int, head: int) -> dict[str, float | None]:
        """Every summary of one (layer, head), by model indices (None where undefined)."""
        if layer not in self.layers or head not in self.heads:
            raise ValueError(f"(layer {layer}, head {head}) was not summarised; layers {self.layers}, "
                             f"heads {self.heads}")
        li, hi = self.layers.index(layer), self.heads.index(head)
        return {name: (float(self.scores[name][li, hi]) if name in self.scores else None)
                for name in SUMMARY_FIELDS + tuple(n for n in self.scores if n not in SUMMARY_FIELDS)}

    def to_json(self) -> dict:
        """A JSON-ready dict: the model, T, and "summaries": one entry per head,
        `{"layer", "head", "entropy", "mean_distance", "first_token_mass", ...}` (SUMMARY_FIELDS,
        null where undefined). Top-k rows and patterns are left to the page."""
        out = []
        for layer in self.layers:
            for head in self.heads:
                entry = {"layer": layer, "head": head}
                entry.update({k: (None if v is None or not math.isfinite(v) else round(v, 6))
                              for k, v in self.head(layer, head).items()})
                out.append(entry)
        return {"model": self.model, "n_tokens": len(self.tokens), "n_layers": self.n_layers,
                "n_heads": self.n_heads, "layers": self.layers, "heads": self.heads,
                "match_rows": dict(self.match_rows), "summaries": out}


# ------------------------------------------------------------------ one layer


def layer_statistics(query: Tensor, key: Tensor, acc: RowSums, heads: list[int], *, mask=None,
                     causal: bool = False, scale: float, score_mod=None, sinks: Tensor | None = None,
                     block_elements: int = BLOCK_ELEMENTS, workers: int | None = None) -> RowSums:
    """Fold one attention layer's probabilities into `acc`, a block of query rows at a time.

    query `(1, H, T, D)`, key `(1, Hkv, S, D)` and the rest as the kernel receives them
    (`mask`: None, a bool or float `(1, 1|H, T|1, S)` tensor, or a MaskMod; `sinks`: logits
    `(1, H, T|1, 1)`). Probabilities are softmax(q k^T * scale, score_mod, mask[, sink]) in
    float32 (float64 inputs stay float64), the heads `heads` only. A block holds about
    `block_elements` scores (rows sized to the keys they see): small enough that its passes
    (softmax, entropy, the sums, the top-k) run from the CPU's cache, not from memory.

    On the CPU the blocks are shared among `workers` threads (default: torch's thread count),
    each running its ops on one core (`serial_ops`) into its own `RowSums.fork`: a block's
    ops are small, and split across cores each ends in a wait for every thread (on a busy
    machine a time slice whenever one thread is not scheduled), whereas whole blocks per
    thread wait once per layer.
    """
    B, H, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    if B != 1:
        raise ValueError(f"summaries read one text at a time; received a batch of {B}")
    G = H // Hkv
    dev = query.device
    acc_t = acc_dtype(query.dtype)
    h = len(heads)
    # Every head asked: the G query heads of a K/V head are folded into the rows of one
    # matmul (as `kernels.common.fold_scores`), K used as it is; a subset: each head's K/V head.
    folded = G > 1 and list(heads) == list(range(H))
    q, kT, mask, sinks = _heads_operands(query, key, heads, mask, sinks, folded, acc_t)
    b_idx = index(1, 0, dev)
    h_idx = torch.tensor(heads, device=dev).view(1, h, 1, 1)
    triangle = mask is None and causal and S >= T  # the causal crop, analytically
    spans = _spans(block_elements, h, T, S, triangle)

    def fold(part: RowSums, share: list[tuple[int, int]]) -> None:
        for t0, t1 in share:
            t = t1 - t0
            if triangle:  # keys up to the last row's position; the diagonal band: keys hidden from some row
                k0, k1, runs, allowed, bias = 0, t1 + S - T, [(t0 + S - T + 1, t1 + S - T)], None, None
            else:
                k0, k1, runs, allowed, bias = _block_mask(mask, causal, t0, t1, T, S, b_idx, h_idx)
            w = k1 - k0
            rows = q[:, t0:t1].to(acc_t) * scale  # (h, t, D), in the queries' layout
            if folded:
                scores = torch.matmul(rows.reshape(Hkv, G * t, D), kT[..., k0:k1]).view(h, t, w)
            else:
                scores = torch.matmul(rows, kT[..., k0:k1])  # (h, t, w)
            del rows
            if score_mod is not None:
                scores = score_mod.apply(scores[None], b_idx, h_idx, index(t, 2, dev, t0), index(w, 3, dev, k0),
                                         S - T)[0]
            if runs is not None:
                _hide_runs(scores, runs, None if triangle else allowed)
                allowed = None
            sink = None
            if sinks is not None:
                sink = (sinks[:, t0:t1] if sinks.shape[1] == T else sinks).expand(h, t, 1)
            probs, entropy = softmax_entropy(scores, allowed, bias, score_mod is not None, sink)  # (h, t, w), (h, t)
            del scores, allowed, bias
            part.add(probs, t0, k0, entropy=entropy)
            del probs

    n = _workers(dev, len(spans), workers)
    parts = [acc] + [acc.fork() for _ in range(n - 1)]
    _in_workers(fold, [(parts[i], spans[i::n]) for i in range(n)])
    for part in parts[1:]:
        acc.merge(part)
    return acc


def _heads_operands(query: Tensor, key: Tensor, heads: list[int], mask, sinks: Tensor | None, folded: bool,
                    acc_t: torch.dtype) -> tuple[Tensor, Tensor, object, Tensor | None]:
    """The heads' share of the layer's operands: their queries `(h, T, D)`, keys transposed
    (`(Hkv, D, S)` when `folded`, else each head's K/V head: `(h, D, S)`), mask and sinks."""
    H, G = query.shape[1], query.shape[1] // key.shape[1]
    every = list(heads) == list(range(H))
    # The queries are scaled a block of rows at a time, as each block is copied for its product
    # anyway: a scaled copy of all of them would add (h, T, D) beside the model's own (128 MiB
    # for Gemma 3 at 32K tokens).
    q = query[0] if every else query[0, heads]  # (h, T, D)
    if folded:
        kT = key[0].to(acc_t).transpose(-2, -1)  # (Hkv, D, S)
    else:
        kT = key[0, [x // G for x in heads]].to(acc_t).transpose(-2, -1)  # (h, D, S)
    if isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1] == H and H > 1:
        mask = mask[:, heads]  # (1, h, T|1, S)
    if sinks is not None:
        sinks = sinks[0, heads] if sinks.shape[1] == H else sinks[0]  # (h|1, T|1, 1)
    return q, kT, mask, sinks


def _spans(block_elements: int, h: int, T: int, S: int, triangle: bool) -> list[tuple[int, int]]:
    """The blocks of query rows, (t0, t1) each, in order: `_block_rows` rows each."""
    spans, t0 = [], 0
    while t0 < T:
        spans.append((t0, t0 + _block_rows(block_elements, h, t0, T, S, triangle)))
        t0 = spans[-1][1]
    return spans


def _block_mask(mask, causal: bool, t0: int, t1: int, T: int, S: int, b_idx: Tensor, h_idx: Tensor):
    """(k0, k1, runs, allowed, bias) of the block of rows t0..t1: the keys k0..k1 it is cropped to,
    the runs of keys hidden from some row (`_key_span`; None: mask through the softmax), and the
    block's bool mask `(1|h, t, w)` and float bias `(1|h, t|1, w)` cropped to those keys."""
    k0, k1, runs = 0, S, None
    allowed, bias = rows_mask(mask, causal, t0, t1, T, S, h_idx.device, b_idx, h_idx)
    if allowed is not None:
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
        if allowed.shape[-1] == S and (bias is None or bias.shape[-1] == S):
            k0, k1, runs = _key_span(allowed)
            allowed = allowed[..., k0:k1]
        allowed = allowed[0]  # (1|h, t, w)
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))[0]
        bias = bias[..., k0:k1] if bias.shape[-1] == S else bias  # (1|h, t|1, w)
    return k0, k1, runs, allowed, bias


def _hide_runs(scores: Tensor, runs: list[tuple[int, int]], allowed: Tensor | None) -> None:
    """Set to NEG, in place, the keys of `scores` `(h, t, w)` hidden from some row, run by run.

    Every row sees a key (the triangle; checked by _key_span), so the hidden keys are set where
    some row hides them (a causal block's diagonal band), not over the whole block, and no row
    needs the softmax's empty-row rule. `allowed` None: the causal triangle, where band key c is
    hidden from block row r when c >= r."""
    t = scores.shape[-2]
    for a, b in runs:
        if b <= a:
            continue
        if allowed is None:
            hidden = torch.ones(t, b - a, dtype=torch.bool, device=scores.device).triu_()
        else:
            hidden = ~allowed[..., a:b]
        scores[..., a:b].masked_fill_(hidden, NEG)


def _workers(device, blocks: int, workers: int | None) -> int:
    """Threads for a layer's blocks: `workers`, or torch's intra-op count on the CPU (1 on an
    accelerator, whose ops are queued, not run, by the calling thread)."""
    if workers is None:
        workers = torch.get_num_threads() if torch.device(device).type == "cpu" else 1
    workers = check_int("workers", workers, minimum=1, allow_none=True)  # the message says None is valid too
    return max(1, min(workers, blocks))


def _in_workers(fold: Callable, shares: list[tuple]) -> None:
    """`fold(*share)` for each share, the first on this thread and the others on their own,
    each with torch's ops on one core and without autograd; the first error is raised here."""
    errors: list[BaseException] = []

    def run(share) -> None:
        try:
            with torch.no_grad(), serial_ops():
                fold(*share)
        except BaseException as err:  # noqa: BLE001 (re-raised on the calling thread)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(share,), daemon=True) for share in shares[1:]]
    for th in threads:
        th.start()
    run(shares[0])
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def _block_rows(block_elements: int, h: int, t0: int, T: int, S: int, triangle: bool) -> int:
    """Rows for the block from row t0: about `block_elements` scores, counting only the keys
    the rows see when the block is cropped to the causal triangle (rows t0..t0+t see
    t0 + t + S - T keys)."""
    if triangle:
        c = t0 + S - T
        t = int((math.sqrt(c * c + 4 * block_elements / h) - c) / 2)
    else:
        t = block_elements // max(1, h * S)
    return max(1, min(t, T - t0))


def _key_span(allowed: Tensor) -> tuple[int, int, list[tuple[int, int]] | None]:
    """For a bool block `(1, 1|h, t, S)`: the keys k0..k1 some row may see, and, when every
    row sees a key, the runs (relative to k0) of keys hidden from some row (None otherwise:
    rows with no key go through the softmax's empty-row rule)."""
    flat = allowed.reshape(-1, allowed.shape[-1])  # (rows, S)
    seen = flat.any(0)
    idx = seen.nonzero()
    if not len(idx):
        return 0, allowed.shape[-1], None
    k0, k1 = int(idx[0]), int(idx[-1]) + 1
    if not bool(flat.any(1).all()):
        return k0, k1, None
    partial = (~flat[:, k0:k1].all(0)).nonzero()[:, 0].tolist()  # keys hidden from some row
    runs: list[tuple[int, int]] = []
    for c in partial:
        if runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        else:
            runs.append((c, c + 1))
    return k0, k1, runs


# ------------------------------------------------------------------ the pass


class _LayerProgress:
    """'summaries: layer 12/30, 2.4 s per layer, ETA 43 s' on a terminal's stderr, replaced in place."""

    def __init__(self, total: int, enabled: bool | None):
        self.total = total
        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.t0 = time.perf_counter()
        self.done = 0

    def step(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        per = (time.perf_counter() - self.t0) / self.done
        eta = per * (self.total - self.done)
        sys.stderr.write(f"\r\033[Ksummaries: layer {self.done}/{self.total}, {per:.1f} s per layer, "
                         f"ETA {eta:.0f} s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


class _Observer:
    """Given to the registry as `multihead_observer=`: summarises each asked layer as it runs."""

    def __init__(self, modules: dict[int, int], make_acc: Callable[[int], RowSums], finish: Callable,
                 heads: list[int], block_elements: int, progress: _LayerProgress, stop: bool):
        self.modules = modules  # id(module) -> position in `layers`
        self.make_acc = make_acc
        self.finish = finish  # (position, its sums) -> the layer's results, the sums dropped
        self.heads = heads
        self.block_elements = block_elements
        self.progress = progress
        self.stop = stop
        self.done: dict[int, dict] = {}

    def observe(self, module, query, key, *, mask, causal, scale, score_mod, sinks) -> None:
        li = self.modules.get(id(module))
        if li is None or li in self.done:
            return
        if isinstance(mask, MaskMod):
            mask.check(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        _release_free_memory()
        self.done[li] = self.finish(li, layer_statistics(query, key, self.make_acc(li), self.heads, mask=mask,
                                                         causal=causal, scale=scale, score_mod=score_mod,
                                                         sinks=sinks, block_elements=self.block_elements))
        _release_free_memory()
        self.progress.step()
        if self.stop and len(self.done) == len(self.modules):
            from multihead.interop.hf import CaptureComplete

            raise CaptureComplete


def _takes(model, name: str) -> bool:
    """Whether `model.forward` takes keyword `name` (by name, not through **kwargs)."""
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).

    A long forward frees and allocates tensors of many sizes (the layers' activations, the
    blocks here); glibc keeps what is freed inside its heap, where later tensors of other
    sizes do not fit, so the resident size climbs layer after layer (measured: 320 MiB after
    6 of SmolLM2's layers at 8,192 tokens, 100 MiB with a trim per layer). Once per layer it
    costs milliseconds."""
    trim = _LIBC.get("malloc_trim", False)
    if trim is False:
        trim = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                trim = ctypes.CDLL(None).malloc_trim
                trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                trim = None
        _LIBC["malloc_trim"] = trim
    if trim is not None:
        trim(0)


_LIBC: dict = {}


def summaries(model_or_loaded="minilm", text_or_ids="", *, layers=None, heads=None, max_tokens: int | None = None,
              top_k: int = TOP_K, patterns=None, grid: int = GRID, transformer_lens: bool = False,
              progress: bool | None = None, block_elements: int = BLOCK_ELEMENTS) -> HeadSummaries:
    """Per-head summaries of every head (or the layers x heads asked) on one text, streamed.

    Args:
        model_or_loaded: anything `multihead.interop.loaders.load_model` takes ("minilm", "smollm2", a folder,
            a (model, tokenizer) pair, a LoadedModel).
        text_or_ids: a string, or token ids (list of ints, 1-D tensor) used as they are.
        layers, heads: indices (negative from the end) or None for all.
        max_tokens: keep at most this many tokens (longer texts are truncated, with a
            TruncationWarning).
        top_k: keep each query's k largest weights (0: none).
        patterns: the (layer, head) pairs whose pattern is kept as block sums over
            `grid` x `grid` bins (`True`: every head; costs layers x heads x grid^2 x 4 bytes).
        transformer_lens: also TransformerLens' head-detector scores (tl_*).
        progress: a progress line on stderr (default: when stderr is a terminal).
        block_elements: scores per block of rows (bounds the memory beside the model).

    Returns:
        A `HeadSummaries`.

    A model handed in comes back as it came (its train/eval flags, requires_grad and
    attention implementation), when the call raises too: `capture.model_for_run`.
    """
    with model_for_run(model_or_loaded) as lm:
        return _summarise(lm, text_or_ids, layers=layers, heads=heads, max_tokens=max_tokens, top_k=top_k,
                          patterns=patterns, grid=grid, transformer_lens=transformer_lens, progress=progress,
                          block_elements=block_elements)


def _summarise(lm, text_or_ids, *, layers, heads, max_tokens, top_k, patterns, grid, transformer_lens, progress,
               block_elements) -> HeadSummaries:
    from multihead.interop.loaded import HFModel

    layers = select_indices("layer", layers, lm.n_layers)
    heads = select_indices("head", heads, lm.n_heads)
    for name, value, lo in (("top_k", top_k, 0), ("grid", grid, 1), ("block_elements", block_elements, 1)):
        check_int(name, value, minimum=lo)
    ids, meta = encode_text(lm, text_or_ids, max_tokens)
    T = len(ids)
    from multihead.inspect.roles import text_context

    tokens = lm.tokens(ids)
    ctx = text_context(tokens, ids, lm.special_tokens, lm.causal)
    want = _pattern_heads(patterns, layers, heads)
    batch = torch.tensor([ids], dtype=torch.long)
    L, h = len(layers), len(heads)
    top_index = torch.full((L, h, T, top_k), -1, dtype=torch.int32) if top_k else None
    top_weight = torch.zeros(L, h, T, top_k, dtype=torch.float16) if top_k else None

    def make_acc(li: int, device=None) -> RowSums:
        g = grid if any((layers[li], x) in want for x in heads) else 0
        return RowSums(h, ctx, top_k=top_k, grid=g, transformer_lens=transformer_lens, device=device)

    out_patterns: dict[tuple[int, int], Tensor] = {}

    def finish(li: int, acc: RowSums) -> dict[str, Tensor]:
        """Layer li's results, its top-k keys and patterns copied out as soon as it is done, so
        that one layer's sums (top-k arrays and per-row weights: 10 MiB a layer of Gemma 3 at
        32K tokens) are held at a time, not every layer's until the end."""
        if top_k:
            top_index[li] = acc.top_index.cpu()
            top_weight[li] = acc.top_weight.cpu()
        if acc.pattern is not None:
            for hi, head in enumerate(heads):
                if (layers[li], head) in want:
                    out_patterns[(layers[li], head)] = acc.pattern[hi].cpu()
        return acc.result()

    bar = _LayerProgress(L, progress)
    done: dict[int, dict[str, Tensor]] = {}
    from_weights = []
    try:
        if isinstance(lm, HFModel):
            done = _run_hf(lm, batch, layers, heads, make_acc, finish, block_elements, bar)
        for li, layer in enumerate(layers):  # layers the observer did not reach: from their weights
            if li in done:
                continue
            from_weights.append(layer)
            weights = lm.attention(batch, {layer: tuple(heads)})[layer][0]  # (h, T, S)
            acc = make_acc(li, device=weights.device)
            rows = max(1, block_elements // max(1, h * weights.shape[-1]))
            for t0 in range(0, T, rows):
                acc.add(weights[:, t0:t0 + rows], t0)
            del weights
            done[li] = finish(li, acc)
            del acc
            bar.step()
    finally:
        bar.close()

    per_layer = [done.pop(li) for li in range(L)]
    scores = {name: torch.stack([d[name] for d in per_layer]) for name in per_layer[0]}
    meta = {**meta, "summaries": {"block_elements": block_elements, "top_k": top_k, "grid": grid,
                                  "layers_from_weights": from_weights}}
    return HeadSummaries(tokens=tokens, token_ids=list(ids), layers=layers, heads=heads, n_layers=lm.n_layers,
                         n_heads=lm.n_heads, scores=scores, match_rows=ctx.match_rows(), top_index=top_index,
                         top_weight=top_weight, patterns=out_patterns, model=lm.name, meta=meta)


def _pattern_heads(patterns, layers: list[int], heads: list[int]) -> set[tuple[int, int]]:
    if patterns is None or patterns is False:
        return set()
    if patterns is True:
        return {(layer, head) for layer in layers for head in heads}
    try:
        want = {(int(a), int(b)) for a, b in patterns}
    except (TypeError, ValueError):
        raise TypeError(f"patterns must be True, None or (layer, head) pairs; received {patterns!r}") from None
    missing = sorted(p for p in want if p[0] not in layers or p[1] not in heads)
    if missing:
        raise ValueError(f"patterns asks for {missing}, not among the summarised layers {layers} x heads {heads}")
    return want


def _run_hf(lm, batch: Tensor, layers: list[int], heads: list[int], make_acc, finish, block_elements: int,
            bar: _LayerProgress) -> dict[int, dict[str, Tensor]]:
    """One forward of `lm.model` with the observer; returns {position in layers: `finish`'s results}."""
    from multihead.interop.hf import CaptureComplete
    from multihead.interop.hf.registry import OBSERVER_KEYWORD

    device = next(lm.model.parameters()).device
    ids = batch.to(device)
    modules = {id(lm.layers[layer]): li for li, layer in enumerate(layers)}
    observer = _Observer(modules, lambda li: make_acc(li, device=device), finish, heads, block_elements, bar,
                         stop=True)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if lm.encoder_decoder:  # as a capture reads it: the text on both sides
        inputs["decoder_input_ids"] = ids
    if _takes(lm.model, "use_cache"):  # no K/V cache: at 8,192 tokens of SmolLM2 it is 360 MiB, never read
        inputs["use_cache"] = False
    with torch.no_grad(), _mlps_in_chunks(lm.model, MLP_ROWS):
        try:
            lm.model(**inputs, **{OBSERVER_KEYWORD: observer})
        except CaptureComplete:
            pass
    return observer.done


# Positions an MLP runs at a time in a long forward: its intermediate activations are then
# 3 x 4,096 x I floats (96 MiB for Gemma 3's I = 2,048) instead of 3 x T x I (768 MiB at 32K),
# which at 32K tokens is most of what the summaries hold above the model.
MLP_ROWS = 4096


@contextmanager
def _mlps_in_chunks(model, rows: int) -> Iterator[None]:
    """Every submodule named `mlp` runs `rows` positions at a time during the block, a
    position-wise MLP's same values at a chunk's memory; each is put back as it was (also when
    the block raises). An input that is not `(B, T, C)`, extra arguments or an output that is
    not a tensor (a mixture of experts' routing losses) take the module's own call."""
    mlps = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp" and "forward" not in vars(m)]

    def chunked(call):
        def forward(x, *args, **kwargs):
            if args or kwargs or not isinstance(x, Tensor) or x.dim() != 3 or x.shape[1] <= rows:
                return call(x, *args, **kwargs)
            out = None
            for i in range(0, x.shape[1], rows):
                y = call(x[:, i:i + rows])
                if not isinstance(y, Tensor) or y.shape[:2] != x[:, i:i + rows].shape[:2]:
                    return call(x)
                if out is None:
                    out = y.new_empty(x.shape[0], x.shape[1], *y.shape[2:])
                out[:, i:i + rows] = y
            return out
        return forward

    try:
        for m in mlps:
            m.forward = chunked(m.forward)
        yield
    finally:
        for m in mlps:
            vars(m).pop("forward", None)
