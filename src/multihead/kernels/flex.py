"""The opt-in "flex" backend: multihead's masks and score mods through torch's compiled flex_attention.

`torch.compile(flex_attention)` (torch.nn.attention.flex_attention) generates one fused
kernel per (shape, mask, score mod), skipping the blocks a `BlockMask` marks empty.
Compiling takes seconds per shape (every new T or S is a new shape), so it runs only
when asked for: `backend="flex"`; `"auto"` never picks it and never compiles anything.
On CPUs it measured slower than "auto" even once compiled (docs/kernel.md, "The opt-in
flex backend"; revisit when torch's CPU flex kernel improves); it is here for GPUs, and
to hold multihead's masks against flex's kernels.

On top of flex: index conventions, dense masks, a block-mask cache, key padding, the CPU
backward, and errors that name what failed.

Details: docs/kernel.md, "What the flex backend adds on top of flex_attention".
"""

from __future__ import annotations

import functools
import shutil
import types
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from multihead.kernels import explicit_tiles
from multihead.kernels import math as explicit_math
from multihead.kernels.planner import combine
from multihead.masks import MaskMod
from multihead.score_mods import ScoreMod

__all__ = ["attention", "clear_cache"]

# Compiled variants allowed on flex_attention's code object while this backend calls it.
# dynamo's default (8) would, once reached, silently run flex eagerly, which builds the
# whole (B, H, T, S) score matrix; we raise a clear error instead.
RECOMPILE_LIMIT = 64
CACHE_SIZE = 16  # block masks kept (one per predicate structure and shape)
_KV_BLOCK = 128  # create_block_mask's default block size
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INSTEAD = "use backend 'auto' (no compilation), 'sdpa' or 'tiles'"

_flex: dict[str, Callable] = {}  # "attention", "block_mask": filled on first use
_block_masks: OrderedDict = OrderedDict()  # structural key -> (pred, mask_fn, BlockMask)
_score_fns: OrderedDict = OrderedDict()  # structural key -> (mod, score_fn)


def clear_cache() -> None:
    """Forget the cached block masks and score functions (compiled kernels stay in torch's cache)."""
    _block_masks.clear()
    _score_fns.clear()


def _load() -> tuple[Callable, Callable]:
    """torch's flex_attention compiled (static shapes, one graph) and create_block_mask, imported
    on first use so that `import multihead` stays light."""
    if not _flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as e:
            raise RuntimeError(f"backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5); "
                               f"torch {torch.__version__} failed to import it ({e}); {_INSTEAD}") from None
        # dynamic=False: a recompile for a new shape would otherwise make sizes symbolic, and the
        # CPU flex template then fails to compile (measured with torch 2.13: C++ error
        # 'cur_qSplitSize8 was not declared'). fullgraph=True: a recompile-limit hit raises.
        _flex["attention"] = torch.compile(flex_attention, dynamic=False, fullgraph=True)
        _flex["block_mask"] = create_block_mask
    return _flex["attention"], _flex["block_mask"]


# ------------------------------------------------------------ structural cache keys


class _Unkeyable(Exception):
    """A predicate or mod reads something `_key` cannot see into: it is not cached."""


def _key(x, depth: int = 0):
    """A hashable key equal for predicates/score mods that compute the same thing *now*.

    Functions by code, defaults, captured values and the globals they name; tensors by
    memory (storage, offset, shape, strides) and version (an in-place edit of doc ids
    changes the key); containers (list, dict, tuple, set), `functools.partial`, bound
    methods and plain objects (a callable class) by their current contents and attributes;
    classes and builtins by identity. Anything else raises `_Unkeyable`: what the key
    cannot see is not cached. The key is taken at every call, and a cache hit is checked
    against the key of the object the entry was built from (see `_lookup`), so an entry
    whose predicate has changed since is rebuilt, never served stale.
    """
    if depth > 8:
        raise _Unkeyable
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return (type(x).__name__, x)
    if isinstance(x, Tensor):  # by memory, so a fresh view of the same ids (doc_ids[None]) matches
        return ("tensor", x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(),
                x.dtype, str(x.device), x._version)
    if isinstance(x, MaskMod):
        if x.op is not None:
            return ("op", x.op, tuple(_key(p, depth + 1) for p in x.parts))
        return ("mask", _key(x.fn, depth + 1), x.top_left)
    if isinstance(x, ScoreMod):
        return ("score", _key(x.fn, depth + 1), x.top_left)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_key(i, depth + 1) for i in x))
    if isinstance(x, (set, frozenset)):
        return (type(x).__name__, frozenset(_key(i, depth + 1) for i in x))
    if isinstance(x, dict):
        return ("dict", tuple((_key(n, depth + 1), _key(val, depth + 1)) for n, val in x.items()))
    if isinstance(x, functools.partial):
        return ("partial", _key(x.func, depth + 1), _key(x.args, depth + 1), _key(x.keywords, depth + 1))
    if isinstance(x, types.MethodType):
        return ("method", _key(x.__func__, depth + 1), _key(x.__self__, depth + 1))
    if isinstance(x, types.FunctionType):
        cells = []
        for c in x.__closure__ or ():
            try:
                cells.append(_key(c.cell_contents, depth + 1))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        defaults = tuple(_key(d, depth + 1) for d in x.__defaults__ or ())
        kwdefaults = tuple(sorted((n, _key(d, depth + 1)) for n, d in (x.__kwdefaults__ or {}).items()))
        glob = tuple((n, _key(x.__globals__[n], depth + 1)) for n in x.__code__.co_names  # globals it reads
                     if n in x.__globals__ and not isinstance(x.__globals__[n], types.ModuleType))
        return ("fn", x.__code__, defaults, kwdefaults, tuple(cells), glob)
    if isinstance(x, (type, types.BuiltinFunctionType, types.BuiltinMethodType, types.ModuleType,
                      torch._ops.OpOverloadPacket, torch._ops.OpOverload)):  # classes, builtins, ops
        return ("id", id(x))
    if isinstance(x, (np.generic,)):
        return ("np", x.dtype.str, x.item())
    state = getattr(x, "__dict__", None)
    if isinstance(state, dict) and not hasattr(type(x), "__slots__"):  # a callable object: its attributes
        call = type(x).__call__ if callable(x) else None
        return ("object", id(type(x)), _key(call, depth + 1) if isinstance(call, types.FunctionType) else None,
                _key(state, depth + 1))
    raise _Unkeyable


def _try_key(x):
    """`_key(x)`, or None when it cannot be keyed (then nothing is cached)."""
    try:
        key = _key(x)
        hash(key)
        return key
    except (_Unkeyable, TypeError):
        return None


def _lookup(cache: OrderedDict, key, make: Callable, built_from: Callable | None = None):
    """LRU get-or-build: `make()` runs on a miss (and, uncached, when `key` is None); the oldest
    entry goes beyond CACHE_SIZE. `built_from(entry)`: the key the entry's own object has now;
    a hit whose object no longer matches (a tensor it reads was edited since) is rebuilt."""
    if key is None:
        return make()
    hit = cache.get(key)
    if hit is not None and (built_from is None or built_from(hit) == key):
        cache.move_to_end(key)
        return hit
    value = make()
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return value


# --------------------------------------------------------------- masks and mods


def _extent(pred: MaskMod, B: int, H: int, T: int, S: int, device) -> tuple[int | None, int | None]:
    """(B or None, H or None): None where the predicate depends on neither batch nor head,
    so create_block_mask builds one block mask broadcast over them.

    Read from the shape of the analytic tile classes (one tile), or of the predicate on a
    2 x 2 corner with every batch and head index: an index the predicate ignores
    broadcasts to size 1. Conservative: a spurious dependence only builds more.
    """
    if pred.analytic:
        shape = pred.tiles(B, H, T, S, T, S, device)[0].shape
    else:
        out = pred.evaluate(*_corner(B, H, T, S, device), S - T)
        shape = (1,) * (4 - out.dim()) + tuple(out.shape)
    return (B if shape[0] > 1 else None), (H if shape[1] > 1 else None)


def _padded(S: int, device) -> int:
    """Keys as flex sees them: on the CPU, S rounded up to a multiple of the KV block (128).

    torch 2.13's CPU flex kernel reads uninitialised memory when the last KV block's
    length is 8 mod 16 (S = 8, 24, 40, 152, ...: wrong values, NaN, different every run;
    measured on this AVX2 machine, the same with a plain `torch.compile(flex_attention)`),
    so K/V get zero keys appended and the mask hides them: every KV block is then whole.
    """
    if torch.device(device).type != "cpu" or S % _KV_BLOCK == 0:
        return S
    return -(-S // _KV_BLOCK) * _KV_BLOCK


def _mask_entry(pred: MaskMod | None, B: int, H: int, T: int, S: int, device):
    """(pred, mask_fn, BlockMask) for a predicate (None: only the padded keys hidden), cached."""
    Bm, Hm = (None, None) if pred is None else _extent(pred, B, H, T, S, device)
    Sp = _padded(S, device)
    tail = (Bm, Hm, T, S, str(device))
    pred_key = None if pred is None else _try_key(pred)
    key = None if pred is not None and pred_key is None else (pred_key, *tail)

    def make():
        shift = S - T

        def mask_fn(b, h, q_idx, kv_idx):
            if Sp == S:
                return pred.evaluate(b, h, q_idx, kv_idx, shift)  # each leaf in its own convention
            real = kv_idx < S  # the padded keys are hidden; clamped, a predicate indexes inside its tensors
            return real if pred is None else real & pred.evaluate(b, h, q_idx, kv_idx.clamp(max=S - 1), shift)

        # Eager (_compile=False): 0.43 s for sliding_window(256) & causal at N=4096 on one thread,
        # once per cached shape; _compile=True took 9.5 s of compilation per new shape, then 0.02 s.
        name = "hiding the padded keys" if pred is None else pred.name
        return pred, mask_fn, _create(mask_fn, Bm, Hm, T, Sp, device, name)

    return _lookup(_block_masks, key, make,
                   lambda hit: (None if hit[0] is None else _try_key(hit[0]), *tail))


def _dense_index(dense: Tensor, b, h, q_idx, kv_idx, S: int):
    """dense[b, h, q_idx, kv_idx] for a mask `(Bm, Hm, Tm, Sm)` broadcastable to (B, H, T, S):
    broadcast dims are read at 0, so nothing is expanded or copied; padded keys read key S-1."""
    Bm, Hm, Tm, Sm = dense.shape
    return dense[b if Bm > 1 else 0, h if Hm > 1 else 0, q_idx if Tm > 1 else 0,
                 kv_idx.clamp(max=S - 1) if Sm > 1 else 0]


def _block_mask(pred: MaskMod | None, dense: Tensor | None, B, H, T, S, device):
    """The BlockMask (None: every pair) for a predicate and/or a dense mask (float: its
    entries that are not -inf)."""
    Sp = _padded(S, device)
    if pred is None and dense is None and Sp == S:
        return None
    pred_fn = None
    if pred is not None or Sp != S:
        _, pred_fn, bm = _mask_entry(pred, B, H, T, S, device)
        if dense is None:
            return bm
    # A dense mask is the user's own (T, S) tensor, usually new each call: built, not cached.
    allowed = dense if dense.dtype == torch.bool else ~torch.isneginf(dense)

    def fn(b, h, q_idx, kv_idx):
        here = _dense_index(allowed, b, h, q_idx, kv_idx, S)
        return here if pred_fn is None else pred_fn(b, h, q_idx, kv_idx) & here

    Bp, Hp = (None, None) if pred is None else _extent(pred, B, H, T, S, device)
    Bm = B if dense.shape[0] > 1 or Bp else None
    Hm = H if dense.shape[1] > 1 or Hp else None
    return _create(fn, Bm, Hm, T, Sp, device, "a dense mask" if pred is None else f"{pred.name} and a dense mask")


def _create(fn, Bm, Hm, T: int, Sp: int, device, name: str):
    """flex's create_block_mask, whose vmap over the indices refuses some predicates that run
    eagerly (data-dependent Python branches): said in multihead's terms."""
    try:
        return _load()[1](fn, Bm, Hm, T, Sp, device=device)
    except (RuntimeError, TypeError, IndexError) as e:
        first = _first_line(e)
        raise ValueError(f"backend 'flex': flex's create_block_mask could not evaluate the mask {name}: "
                         f"{type(e).__name__}: {first}. It runs the predicate under torch.vmap: element-wise "
                         f"tensor code only (no Python branching on tensor values, no .item()); {_INSTEAD}, "
                         f"which evaluate it eagerly on whole tiles") from None


def _score_fn(mod: ScoreMod | None, dense: Tensor | None, T: int, S: int, device) -> Callable | None:
    """flex's score_mod: the ScoreMod in its own index convention, then a float mask added."""
    fn = None
    padded = _padded(S, device) != S
    if mod is not None:
        def make():
            shift = S - T

            def score_fn(score, b, h, q_idx, kv_idx):
                if padded:  # a padded key's score is hidden anyway; clamped, a mod indexes inside its tensors
                    kv_idx = kv_idx.clamp(max=S - 1)
                return mod.apply(score, b, h, q_idx, kv_idx, shift)

            return mod, score_fn

        mod_key = _try_key(mod)
        key = None if mod_key is None else (mod_key, T, S, str(device))
        fn = _lookup(_score_fns, key, make, lambda hit: (_try_key(hit[0]), T, S, str(device)))[1]
    if dense is None or dense.dtype == torch.bool:
        return fn
    inner = fn

    def with_bias(score, b, h, q_idx, kv_idx):
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        bias = _dense_index(dense, b, h, q_idx, kv_idx, S)
        # hidden (-inf) entries are masked by the block mask; adding -inf here too would be NaN-prone
        return score + torch.where(torch.isneginf(bias), 0.0, bias).to(score.dtype)

    return with_bias


# ------------------------------------------------------------------- the backend


def _check(q: Tensor, dropout_p: float, score_mod: ScoreMod | None, k: Tensor | None = None) -> None:
    if dropout_p > 0:
        raise ValueError(f"backend 'flex' cannot apply dropout (torch's flex_attention has none); received "
                         f"dropout_p={dropout_p}; backends that can: 'tiles', 'math'")
    if q.device.type == "cpu" and q.dtype not in _CPU_DTYPES:
        raise ValueError(f"backend 'flex' on the CPU takes float32, float16 or bfloat16 (torch's CPU flex "
                         f"kernel); received {q.dtype}; for {q.dtype} use backend 'tiles', 'math' or 'auto'")
    if q.device.type == "cpu" and score_mod is not None:
        explicit_tiles.refuse_trainable(score_mod, q, q.shape[2] if k is None else k.shape[2],
                                     "on the CPU the 'flex' backend's backward is the tile engine's, which")


def _call(q: Tensor, k: Tensor, v: Tensor, block_mask, score_fn, scale: float, what: str) -> Tensor:
    """One compiled flex call; compilation failures become errors that say what to do.
    `what` names the mask and score mod, for the message."""
    flex_attention, _ = _load()
    G = q.shape[1] // k.shape[1]
    try:
        with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)):
            return flex_attention(q, k, v, score_mod=score_fn, block_mask=block_mask, scale=scale,
                                  enable_gqa=G > 1)  # GQA: K/V read per group, never copied
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        raise RuntimeError(f"backend 'flex': flex_attention has been compiled for more than {RECOMPILE_LIMIT} "
                           f"distinct (shape, mask, score mod) variants in this process, one per new T or S "
                           f"(decoding over a growing cache is a new shape every step); {_INSTEAD}, or raise "
                           f"multihead.kernels.flex.RECOMPILE_LIMIT") from None
    except Exception as e:  # dynamo / inductor / C++ compiler failures arrive as many exception types
        kind = _failure_kind(e)
        if kind is None:
            raise
        first = _first_line(e)
        if kind == "machine":
            cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
            hint = "" if q.device.type != "cpu" or cxx else " (no C++ compiler on PATH: inductor needs one on the CPU)"
            raise RuntimeError(f"backend 'flex': torch.compile(flex_attention) failed on this machine{hint}: "
                               f"{type(e).__name__}: {first}; {_INSTEAD}") from None
        raise ValueError(f"backend 'flex': torch.compile could not compile flex_attention with {what}: "
                         f"{type(e).__name__}: {first}. Compiled mods must be element-wise tensor code (no "
                         f".item(), no Python branching on tensor values); {_INSTEAD}, which call the mods "
                         f"eagerly on whole tiles") from None


def _chain(e: BaseException) -> list[BaseException]:
    """e and what it wraps, outermost first: dynamo's BackendCompilerFailed carries inductor's
    error (a C++ compiler's among them) as its cause, its own text often a bare heading."""
    out: list[BaseException] = []
    while e is not None and all(e is not x for x in out) and len(out) < 8:
        out.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None)
    return out


def _first_line(e: BaseException) -> str:
    """The outermost error's first line, and the innermost's where it wraps one (dynamo's reads
    "backend='inductor' raised:" and no more)."""
    def line(x):
        return next((ln.strip() for ln in str(x).splitlines() if ln.strip()), "")
    chain = _chain(e)
    text = line(e) or type(e).__name__
    inner = chain[-1]
    if inner is not e:
        text += f" ({type(inner).__name__}: {line(inner) or 'no message'})"
    return text[:400]


def _failure_kind(e: Exception) -> str | None:
    """What a compilation failure says, read through what it wraps: "machine" (no or a broken
    C++ toolchain), "mods" (what the mask or score mod does cannot be traced or lowered), None
    (not one: re-raised as is)."""
    chain = _chain(e)
    names = {c.__name__ for x in chain for c in type(x).__mro__}
    text = " ".join(str(x)[:2000] for x in chain)
    if names & {"CppCompileError", "InvalidCxxCompiler"} or "CppCompileError" in text \
            or "InvalidCxxCompiler" in text:
        return "machine"
    if names & {"BackendCompilerFailed", "InductorError", "LoweringException", "Unsupported", "UserError",
                "TorchRuntimeError"}:
        return "mods"
    return None


class _FlexForwardTileBackward(torch.autograd.Function):
    """Forward: compiled flex. Backward: the tile engine recomputes the attention and its
    gradient (torch's compiled flex has no backward on the CPU), of q, k, v and of a float
    mask that requires grad. Under create_graph=True the recomputation is recorded from the
    saved inputs (`explicit_tiles.twice`: each slot's own partial, whatever aliases), so a
    second differentiation is exact too."""

    @staticmethod
    def forward(ctx, q, k, v, dense, run, recompute):
        ctx.save_for_backward(q, k, v, dense)
        ctx.recompute = recompute
        return run(q.detach(), k.detach(), v.detach())

    @staticmethod
    def backward(ctx, d_out):
        saved = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: per-slot partials through the saved inputs
            return (*explicit_tiles.twice(ctx.needs_input_grad, saved, d_out, ctx.recompute), None, None)
        wanted = [i for i, x in enumerate(saved) if x is not None and ctx.needs_input_grad[i]]
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(ctx.needs_input_grad[i])
                      for i, t in enumerate(saved)]
            out = ctx.recompute(*leaves)
        grads = torch.autograd.grad(out, [leaves[i] for i in wanted], d_out, allow_unused=True)
        result = [None] * 6
        for i, g in zip(wanted, grads):
            result[i] = g
        return tuple(result)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | MaskMod | None, *, causal: bool, scale: float,
              dropout_p: float, weight_heads: tuple[int, ...] | None,
              score_mod: ScoreMod | None = None) -> tuple[Tensor, Tensor | None]:
    """The "flex" backend (signature: `kernels.registry.Backend`)."""
    _check(q, dropout_p, score_mod, k)
    B, H, T, _ = q.shape
    S = k.shape[2]
    pred, dense = combine(mask, causal)  # (predicate with causal folded in, dense tensor)
    _check_mods(pred, score_mod, B, H, T, S, q.device)
    block_mask = _block_mask(pred, dense, B, H, T, S, q.device)
    score_fn = _score_fn(score_mod, dense, T, S, q.device)
    Sp = _padded(S, q.device)
    what = " and ".join(w for w in (pred is not None and f"mask {pred.name}", dense is not None and "a dense mask",
                                    score_mod is not None and f"score mod {score_mod.name}") if w) or "no mask"

    def run(qq, kk, vv):
        if Sp != S:  # zero keys appended, hidden by the block mask: (B, Hkv, Sp, D)
            kk = torch.nn.functional.pad(kk, (0, 0, 0, Sp - S))
            vv = torch.nn.functional.pad(vv, (0, 0, 0, Sp - S))
        return _call(qq, kk, vv, block_mask, score_fn, scale, what)

    # a float mask that requires grad (a learned bias): flex would read it as a captured constant
    grad_dense = dense if dense is not None and dense.is_floating_point() and dense.requires_grad else None
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, grad_dense) if t is not None)
    if needs_grad and (q.device.type == "cpu" or grad_dense is not None):
        def recompute(qq, kk, vv, dd):
            return explicit_tiles.explicit(qq, kk, vv, mask if dd is None else dd, causal=causal, scale=scale,
                                           dropout_p=0.0, score_mod=score_mod)

        out = _FlexForwardTileBackward.apply(q, k, v, grad_dense, run, recompute)
    else:
        out = run(q, k, v)
    weights = None
    if weight_heads is not None:
        weights = explicit_math.weights_pass(q, k, mask, causal, scale, weight_heads, score_mod=score_mod)
    return out, weights


def _check_mods(pred: MaskMod | None, score_mod: ScoreMod | None, B, H, T, S, device) -> None:
    """Run the predicate and the score mod on a 2 x 2 corner first: one that returns a non-bool,
    a non-tensor or the wrong shape fails here with multihead's message, not inside the compiler."""
    b, h, rows, kv = _corner(B, H, T, S, device)
    if pred is not None:
        pred.evaluate(b, h, rows, kv, S - T)
    if score_mod is not None:
        score_mod.apply(torch.zeros(B, H, rows.shape[2], kv.shape[3], device=device), b, h, rows, kv, S - T)


def _corner(B: int, H: int, T: int, S: int, device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tensors (b, h, q_idx, kv_idx) of every batch and head over the first 2 x 2 pairs."""
    return (torch.arange(B, device=device).view(B, 1, 1, 1), torch.arange(H, device=device).view(1, H, 1, 1),
            torch.arange(min(T, 2), device=device).view(1, 1, -1, 1),
            torch.arange(min(S, 2), device=device).view(1, 1, 1, -1))
