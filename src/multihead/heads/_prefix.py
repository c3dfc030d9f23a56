"""The shared-prefix skip of the scans (`patch_scan`, `path_patch_scan`).

When clean and corrupted agree on their first p positions, a causal model's two runs agree
there at every layer, and so does every variant: a variant's blocks then run on positions
[p, T) only, their attention reading the corrupted run's cached keys and values for [0, p)
(bottom-right causal, as a KV cache), and the last block's output gets the corrupted prefix
back before the model's head. Taken only for a transformers decoder whose every block holds
an attention layer on multihead's function, whose attention modules say `is_causal`
(`causal_stack`), whose block inputs are all of a known kind (`cut`), and whose two runs
are checked equal on the prefix (`prefix_mismatch`); otherwise the full positions run."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.heads._batch import first_output, one_row
from multihead.heads._record import Recording
from multihead.heads.engine import Handler, Layer, is_hf, multihead_modules
from multihead.masks import MaskMod


class NoCut(Exception):
    """A block input of a kind the prefix skip does not know how to cut."""


def cut(x, key, T: int, p: int):
    """Positions [p, T) of one block input; `key` is its keyword or its place among the
    positional arguments. Raises NoCut for a T-long input of an unknown kind."""
    if isinstance(x, MaskMod):  # built for T == S, where both readings of q_idx agree; the last queries
        return MaskMod(x.fn, x.name, relative=x.relative) if x.top_left else x  # read bottom-right
    return _positions(x, key, T, slice(p, None))


def _positions(x, key, T: int, rows: slice, keys: slice = slice(None)):
    """Positions `rows` of one block input (of a 4-D mask its query rows, and its keys
    `keys`); anything not T long as it is. Raises NoCut for a T-long input of an unknown
    kind: what `cut` and `_first` share."""
    if isinstance(x, Tensor):
        if x.dim() == 0 or T not in x.shape:
            return x
        if key in (0, "hidden_states") and x.dim() == 3:
            return x[:, rows] if x.shape[1] == T else x
        if x.dim() == 4 and x.shape[-2] == T and x.shape[-1] == T:  # a mask (B, 1|H, T, S)
            return x[..., rows, keys]
        if isinstance(key, str) and key.startswith("position_embeddings") and x.dim() >= 2 and x.shape[-2] == T:
            return x[..., rows, :]  # rotary angles as one (complex) tensor (B|1, T, D)
        if key == "position_ids" and x.shape[-1] == T:
            return x[..., rows]
        if key == "cache_position" and x.dim() == 1:
            return x[rows]
        raise NoCut(key)
    if isinstance(x, (tuple, list)) and isinstance(key, str) and key.startswith("position_embeddings"):
        return type(x)(t[..., rows, :] if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[-2] == T else t
                       for t in x)  # rotary (cos, sin), each (B|1, T, D)
    if isinstance(x, (tuple, list, dict)):
        items = x.values() if isinstance(x, dict) else x
        if any(isinstance(t, Tensor) for t in items):
            raise NoCut(key)
    return x


def cut_all(args, kwargs, at: tuple[int, int] | None):
    """Every block input on positions [p, T), `at` = (T, p); unchanged when `at` is None."""
    if at is None:
        return args, kwargs
    T, p = at
    return (tuple(cut(a, i, T, p) for i, a in enumerate(args)),
            {k: cut(v, k, T, p) for k, v in kwargs.items()})


def _first(x, key, T: int):
    """Position 0 of one block input (a 4-D mask's first query and first key; a MaskMod reads
    q_idx = kv_idx = 0 alike top-left and bottom-right). Raises NoCut for a T-long input of an
    unknown kind, and for a mask of other positions than the hidden states' (T, T)."""
    if isinstance(x, Tensor) and x.dim() == 4 and x.shape[-2:] != (T, T) and x.shape[-2:] != (1, 1):
        raise NoCut(key)
    return _positions(x, key, T, slice(0, 1), slice(0, 1))


def idle(args, kwargs, B: int, T: int, skipped: int | None = None):
    """The inputs of a block whose output the forward replaces (one below every patched
    layer): one row and, where every T-long input is of a kind `cut` knows, one position (a
    4-D mask its first query and key), so that it costs one token rather than a row of T.
    Otherwise, or where the skip's [p, T) is one position (`skipped` = T - p: the attention
    handler takes a block input of that length for a cut one), one row of every position.
    T: the forward's positions (the hidden states of the first idle block; later ones get
    the one position this left)."""
    args, kwargs = tuple(one_row(a, B) for a in args), {k: one_row(v, B) for k, v in kwargs.items()}
    if T > 1 and skipped != 1:
        try:
            return tuple(_first(a, i, T) for i, a in enumerate(args)), {k: _first(v, k, T) for k, v in kwargs.items()}
        except NoCut:
            pass
    # every position; hidden states an earlier idle block left at one position are widened
    # back to T (a broadcast view: what the block computes from them is never read)
    if args:
        return (_widened(args[0], T), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = _widened(kwargs["hidden_states"], T)
    return args, kwargs


def _widened(x, T: int):
    return x.expand(-1, T, -1) if isinstance(x, Tensor) and x.dim() == 3 and x.shape[1] == 1 else x


def cut_cache(cache: dict[int, tuple], at: tuple[int, int]) -> tuple[dict[int, tuple] | None, str]:
    """(every block's cached input on positions [p, T), ""), or (None, why one cannot be cut)."""
    try:
        return {i: cut_all(args, kwargs, at) for i, (args, kwargs) in cache.items()}, ""
    except NoCut as err:
        where = err.args[0]
        name = f"keyword {where!r}" if isinstance(where, str) else f"positional argument {where}"
        return None, (f"a block takes {name}, which holds the T positions and is of no kind the skip knows how to "
                      "cut (hidden_states, a 4-D mask, position_ids, position_embeddings, cache_position)")


def shared_prefix(clean, corrupted) -> tuple[int, int]:
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


def causal_stack(model: nn.Module, layers: list[Layer], blocks: dict[int, nn.Module],
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


def unskip(out, head: Tensor, B: int):
    """A block's output on positions [p, T) of its rows, with the corrupted run's [0, p) put back."""
    x = first_output(out)
    full = torch.cat([head.repeat(x.shape[0] // B, *([1] * (x.dim() - 1))), x], dim=1)
    return full if isinstance(out, Tensor) else (full, *out[1:])


def prefix_mismatch(rec: Recording, prefix: PrefixRecorder, layers: list[Layer], cache: dict[int, tuple], T: int,
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
    if any(sees_ahead(x, T, p, B) for args, kwargs in cache.values() for x in (*args, *kwargs.values())):
        return "a mask lets a query of the shared prefix see a later key"
    return ""


def sees_ahead(x, T: int, p: int, B: int) -> bool:
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
