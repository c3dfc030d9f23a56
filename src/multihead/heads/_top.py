"""The model's last block at the read position only: what a scan's variants need of it
when their metric reads one position.

With an `AtPositions` metric whose every row reads the last position (T - 1, where
`_align` puts it), nothing of the last block reaches the metric but its output at T - 1:
forward pre-hooks cut the output projection's and the MLP's inputs to that position (the
residual adds broadcast it), an intervention hands the attention kernel the last query
alone, and hooks on the query projection run it at the last position only (`QueryAtLast`),
each where its check passes. `last_block` decides from the model's structure and the
metric; the scan then checks the trimmed block against the full one on the corrupted run
(its output and logits at T - 1) and declines, with the reason, where they differ or the
forward fails. In full: docs/heads.md, "The last block at the read position".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.heads._record import out_projection
from multihead.heads.engine import KEYWORD, Layer, is_hf, multihead_modules
from multihead.heads.metrics import AtPositions
from multihead.masks import MaskMod


def _last_position(module: nn.Module, args: tuple, kwargs: dict):
    """A module's input `(rows, T, width)` cut to its last position `(rows, 1, width)`."""
    if args:
        x, rest = args[0], args[1:]
    elif "hidden_states" in kwargs:
        x, rest = kwargs["hidden_states"], ()
    else:
        raise ValueError(f"{type(module).__name__} was called without a positional input or hidden_states=")
    if not isinstance(x, Tensor) or x.dim() != 3:
        got = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{type(module).__name__}'s input is {got}, not (rows, T, width)")
    cut = x[:, -1:]  # (rows, 1, width)
    if args:
        return (cut, *rest), kwargs
    return args, {**kwargs, "hidden_states": cut}


def _mask_last_query(module: nn.Module, args: tuple, kwargs: dict):
    """The attention module's `attention_mask` `(rows, 1|H, T, S)` cut to its last query row;
    a predicate read bottom-right (`MaskMod`: q_idx = i + S - T, the last query's own
    position for one query; one built top-left is for T == S, where both readings agree)."""
    m = kwargs.get("attention_mask")
    if m is None:
        return None
    if isinstance(m, MaskMod):
        return None if not m.top_left else (args, {**kwargs, "attention_mask": MaskMod(m.fn, m.name,
                                                                                       relative=m.relative)})
    x = args[0] if args else kwargs.get("hidden_states")
    T = x.shape[1] if isinstance(x, Tensor) and x.dim() == 3 else None
    if isinstance(m, Tensor) and m.dim() == 4 and T is not None and m.shape[-2] in (1, T):
        return None if m.shape[-2] == 1 else (args, {**kwargs, "attention_mask": m[..., -1:, :]})
    got = f"shape {tuple(m.shape)}" if isinstance(m, Tensor) else type(m).__name__
    raise ValueError(f"the last attention layer's mask is {got}, not (rows, 1|H, T, S) for its T = {T} queries")


class _LastQuery:
    """The intervention that runs one attention module's kernel for its last query only: q
    `(rows, H, T, D)` cut to `(rows, H, 1, D)`, the output `(rows, H, 1, Dv)` widened back to
    T positions (a broadcast view; the module's reshape and projection then run unchanged)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.T = 0

    def inputs(self, module, q, k, v):
        if module is not self.module:
            return q, k, v
        self.T = q.shape[2]
        return q[:, :, -1:], k, v

    def output(self, module, out, value):
        return out if module is not self.module else out.expand(-1, -1, self.T, -1)


class QueryAtLast:
    """Forward hooks that run an attention module's query projection at the last position
    only: the attention output at any other position reaches nothing the trimmed block
    computes (its output projection reads T - 1), and a query feeds its own position's
    output alone. The input is cut to `(rows, 1, C)`; the output is widened back to the T
    positions the module reshapes to, as a broadcast view of that row. A fused projection
    (GPT-2's `c_attn`, `split` query columns ahead of the keys' and values') runs every
    column at the last position and its key and value columns at every position, into one
    output whose query columns hold the last row at every position."""

    def __init__(self, module: nn.Module, split: int | None = None):
        self.module, self.split = module, split
        self.x: Tensor | None = None  # the input at every position, between the two hooks

    def pre(self, module: nn.Module, args: tuple, kwargs: dict):
        self.x = args[0] if args else kwargs.get("hidden_states")
        return _last_position(module, args, kwargs)

    def post(self, module: nn.Module, args: tuple, out):
        x, self.x = self.x, None
        if not isinstance(out, Tensor) or out.dim() != 3 or out.shape[1] != 1:
            got = f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"{type(module).__name__}'s output at the last position is {got}, not (rows, 1, width)")
        rows, T, C = x.shape
        if self.split is None:
            return out.expand(rows, T, out.shape[-1])
        s, W, b = self.split, module.weight, module.bias  # Conv1D: y = x @ W + b, W (C, width)
        full = out.new_empty(rows, T, out.shape[-1])
        torch.addmm(b[s:], x.reshape(rows * T, C), W[:, s:], out=full.view(rows * T, -1)[:, s:])
        full[..., :s] = out[..., :s]
        return full


def query_projection(attention: nn.Module) -> QueryAtLast | None:
    """The query projection of a transformers attention module as `QueryAtLast` hooks: its
    `q_proj` (an nn.Linear), or GPT-2's fused `c_attn` (a Conv1D whose first `split_size`
    columns are the queries); None for another layout (a fused projection whose columns
    interleave heads, a cross-attention)."""
    q = getattr(attention, "q_proj", None)
    if isinstance(q, nn.Linear):
        return QueryAtLast(q)
    fused, s = getattr(attention, "c_attn", None), getattr(attention, "split_size", None)
    if (type(fused).__name__ == "Conv1D" and isinstance(s, int) and not getattr(attention, "is_cross_attention", False)
            and isinstance(fused.bias, Tensor) and tuple(fused.weight.shape[1:]) == (3 * s,)):
        return QueryAtLast(fused, s)
    return None


class LastBlock:
    """The last block's output projection and MLP, to run at the last position only; with
    `queries` its attention kernel for the last query only, and with `query` (`QueryAtLast`)
    its query projection at the last position only."""

    def __init__(self, block: nn.Module, layer: Layer, projection: nn.Module, mlp: nn.Module, queries: bool,
                 query: QueryAtLast | None = None):
        self.block, self.layer, self.projection, self.mlp = block, layer, projection, mlp
        self.queries, self.query = queries, query

    def hooks(self) -> list:
        """(module, pre, post) forward hooks, the scan's format: inputs cut to the last position."""
        cut = [(self.projection, _last_position, None), (self.mlp, _last_position, None)]
        if self.query is not None:
            cut.append((self.query.module, self.query.pre, self.query.post))
        return cut + ([(self.layer.module, _mask_last_query, None)] if self.queries else [])

    def keywords(self) -> dict:
        """The model call's keywords: the last-query intervention when `queries`."""
        return {KEYWORD: _LastQuery(self.layer.module)} if self.queries else {}


def _projection_module(model: nn.Module, block: nn.Module, lay: Layer) -> nn.Module | None:
    """The module of `block` whose weight is the layer's output projection (GPT-2's Conv1D
    stores it transposed: the same storage), or None."""
    W = out_projection(model, lay)
    return next((m for m in block.modules() if isinstance(getattr(m, "weight", None), Tensor)
                 and m.weight.data_ptr() == W.data_ptr() and m.weight.numel() == W.numel()), None)


def last_block(model: nn.Module, block: nn.Module, layers: list[Layer], parents: dict[int, nn.Module], metric,
               T: int) -> tuple[LastBlock | None, str]:
    """(the trim of `block`, "") when the metric reads only the last position and the block
    is shaped for it (the last of its stack, one attention layer with an output projection
    and an `mlp`), else (None, why not). `layers`: the attention layers in `block`."""
    if not isinstance(metric, AtPositions):
        return None, "the metric is a plain function (an AtPositions metric says which position it reads)"
    if not T:
        return None, "the inputs' positions cannot be read off them"
    read = sorted(set(metric.absolute(T).tolist()))
    if read != [T - 1]:
        return None, (f"the metric reads positions {read}; the trim needs every row to read the last one ({T - 1}, "
                      "where rows are rolled to end when they can be)")
    if not is_hf(model) or multihead_modules(model):
        return None, "not a transformers model on multihead's attention function"
    stack = parents.get(id(block))
    if not isinstance(stack, nn.ModuleList) or stack[-1] is not block:
        return None, "the last attention layer's block is not the last block of its stack"
    if len(layers) != 1:
        return None, f"the last block ({type(block).__name__}) holds {len(layers)} attention layers"
    try:
        projection = _projection_module(model, block, layers[0])
    except (ValueError, TypeError, AttributeError) as err:
        return None, f"the last attention layer's output projection: {err}"
    if projection is None:
        return None, f"no module of the last block ({type(block).__name__}) holds its output projection"
    mlp = getattr(block, "mlp", None)
    if not isinstance(mlp, nn.Module):
        return None, f"the last block ({type(block).__name__}) has no `mlp` module"
    return LastBlock(block, layers[0], projection, mlp, queries=True, query=query_projection(layers[0].module)), ""
