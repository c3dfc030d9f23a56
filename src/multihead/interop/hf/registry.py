"""`attn_implementation="multihead"`: transformers' own attention registry, run on multihead.

`register()` puts `attention_forward` in transformers' `AttentionInterface` under
"multihead" (and its boolean mask builder in `AttentionMaskInterface`), so

    import multihead.interop.hf  # registers "multihead"
    model = AutoModel.from_pretrained(path, attn_implementation="multihead")
    model.set_attn_implementation("multihead")  # or switch a loaded model

runs every such model on `multihead.scaled_dot_product_attention`. Nothing of the model
changes: its modules, weights, caches and state dict stay transformers' own, so saving,
reloading and generate need nothing from multihead.

Details: docs/inspect.md, "How the registry runs a transformers model on multihead".
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from multihead import functional, masks, score_mods
from multihead.checks import check_positive_number
from multihead.functional import attend, check_backend_name
from multihead.kernels.validation import plain_scale
from multihead.masks import MaskMod, from_flex

__all__ = ["INTERVENTION_KEYWORD", "OBSERVER_KEYWORD", "REQUEST_KEYWORD", "AttentionCall", "CaptureComplete",
           "WeightsAnswer", "WeightsRequest", "attention_forward", "hf_mask", "register", "registered"]

#: The forward keyword that carries a `WeightsRequest` down to the attention function.
REQUEST_KEYWORD = "multihead_weights"
#: The forward keyword that carries a head intervention (`multihead.heads`) down to the attention
#: function: an object with `inputs(module, q, k, v) -> (q, k, v)`, called before the kernel, and
#: `output(module, out, v) -> out` on the heads' outputs `(B, H, T, Dv)`, before the output projection.
INTERVENTION_KEYWORD = "multihead_heads"
#: The forward keyword that carries a scores observer down to the attention function: an object with
#: `observe(module, query, key, *, mask, causal, scale, score_mod, sinks)`, called with exactly what the
#: kernel is given (mask, window and causality resolved, the scale a number), before the kernel runs,
#: so it can recompute chosen probabilities block by block (`multihead.inspect.summaries`) while the
#: kernel itself returns none. It may raise `CaptureComplete` to end the forward there.
OBSERVER_KEYWORD = "multihead_observer"

# Names transformers itself defines: registering over them would change every model that uses them.
_RESERVED = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4",
             "paged|eager")

_REGISTERED: dict[str, str] = {}  # name -> backend


# ------------------------------------------------------------------ masks


def hf_mask(attention_mask, q_dtype: torch.dtype | None = None) -> Tensor | None:
    """The mask transformers hands an attention function -> a multihead mask.

    - None stays None (the layer's causality, if any, applies).
    - bool `(B, 1|H, T, S)` (transformers' sdpa masks, and ours) already means True =
      may attend.
    - float `(B, 1|H, T, S)` (its eager masks, or a custom one) is added to the scores,
      with `finfo.min` for blocked keys: those become -inf, so a row with no key to
      attend gives zeros (multihead's rule) where transformers' eager path gives a
      uniform row; such rows exist only at padded query positions. No value is read
      back to the host (no device sync).
    - 2-D `(B, S)` with 1 = a real token (flash-attention's form) becomes `(B, 1, 1, S)`.
    """
    m = attention_mask
    if m is None or isinstance(m, MaskMod):
        return m
    if not isinstance(m, Tensor):
        raise TypeError(f"attention mask of type {type(m).__name__} is not supported by attn_implementation="
                        "'multihead' (a flex-attention BlockMask?); valid: None, a bool or float tensor "
                        "(B, 1|H, T, S), or a 0/1 (B, S) padding mask")
    if m.dim() == 2:
        return m.bool()[:, None, None, :]  # (B, 1, 1, S)
    if m.dim() != 4:
        raise ValueError(f"expected a 4-D (B, 1|H, T, S) or 2-D (B, S) attention mask; received {tuple(m.shape)}")
    if m.dtype == torch.bool:
        return m
    if m.is_floating_point():
        out = m.masked_fill(m <= torch.finfo(m.dtype).min / 2, float("-inf"))
        return out if q_dtype is None else out.to(q_dtype)
    return m.bool()


def multihead_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask: Tensor | None = None, local_size: int | None = None, use_vmap: bool = False,
                   **kwargs):
    """The mask builder registered beside the attention function (transformers'
    `AttentionMaskInterface` signature).

    transformers' boolean sdpa mask (True = may attend; None where plain causality or
    nothing is needed), except for the multi-token forwards of sliding-window and
    chunked layers (`local_size`): those get transformers' own mask function, padding
    included, as a `multihead.masks` predicate, so the kernel evaluates it tile by tile
    and skips the tiles outside the window instead of attending through a dense mask; a
    plain window without padding becomes multihead's `sliding_window(W)` (`_sliding_window`),
    which the kernels know as a function of q - kv.
    Two exceptions keep transformers' tensor: inside torch.compile (the block-sparse engine
    plans its tiles in Python per call, which dynamo cannot trace), and a mask `generate`
    builds ahead of the forward for a static cache (`_built_for_generate`), which it hands
    back to the forward as `attention_mask`, where transformers reads it as a tensor.
    Where such a layer's window cuts nothing (a decode step over a sliding-window cache, a
    prefill no longer than the window) and there is no padding, the mask is None, as
    transformers' own is for a layer without a window (`_plain_causal`): the decode steps
    then take the kernel's plain path.
    """
    from transformers.masking_utils import and_masks, padding_mask_function, prepare_padding_mask, sdpa_mask

    index_based = not use_vmap and not isinstance(q_offset, Tensor) and not isinstance(kv_offset, Tensor)
    window_cuts_nothing = local_size is not None and (q_length == 1 or kv_length <= local_size)

    def fixed() -> bool:  # a mask tensor is needed as it is; asked last (a frame walk) and once on any path
        return torch.compiler.is_compiling() or _built_for_generate()

    if local_size is None or window_cuts_nothing or not index_based or mask_function is None or fixed():
        mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         local_size=local_size, use_vmap=use_vmap, **kwargs)
        if window_cuts_nothing and kwargs.get("allow_is_causal_skip", True) and not fixed() and _plain_causal(mask):
            return None  # the attention function applies the layer's causality itself, on the plain path
        return mask
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    q0, kv0 = int(q_offset), int(kv_offset)
    if padding is None and q0 - kv0 == kv_length - q_length and _sliding_window(mask_function) == local_size:
        # transformers' window over positions aligned as multihead's are (the last query at the
        # last key): multihead's own predicate, a function of q - kv the kernels read as such
        # (a plan kept from call to call, the native band kernel)
        return masks.sliding_window(local_size)
    fn = mask_function if padding is None else and_masks(mask_function, padding_mask_function(padding))

    def predicate(b, h, q_idx, kv_idx):  # flex's top-left rows -> transformers' absolute positions
        return fn(b, h, q_idx + q0, kv_idx + kv0)

    return from_flex(predicate, f"transformers local attention ({local_size})")


def _sliding_window(fn) -> int | None:
    """W where `fn` is transformers' `sliding_window_causal_mask_function(W)` (its `and_masks`
    of `sliding_window_overlay(W)` and `causal_mask_function`: kv <= q and kv > q - W, which
    is multihead's `sliding_window(W)`), read from the closures that build it; None for any
    other function, so that it keeps its own predicate."""
    from transformers import masking_utils

    cells = getattr(fn, "__closure__", None) or ()
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask" or len(cells) != 1:
        return None
    parts = cells[0].cell_contents
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not masking_utils.causal_mask_function:
        return None
    overlay = parts[0]
    inner = getattr(overlay, "__closure__", None) or ()
    if getattr(overlay, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask" or len(inner) != 1:
        return None
    window = inner[0].cell_contents
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def _plain_causal(mask) -> bool:
    """Whether `mask` (B, 1, T, S), bool, lets each query see exactly the keys that causality
    alone would (bottom-right): every key for one query (a decode step whose window holds the
    whole cache, as a sliding-window layer's cache does), or the lower triangle for T == S (a
    prefill no longer than the window). transformers skips such a mask (None) only below the
    window's size; from it on it builds one, and a mask sends every call off the kernel's
    plain path (its checks and dispatch, ~50 us a call on a CPU decode step). One reduction
    and one read-back per mask, once per forward for all the layers that share it."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return False
    T, S = mask.shape[2], mask.shape[3]
    if T == 1:
        return bool(mask.all())
    if T != S:
        return False
    causal = torch.ones(T, S, dtype=torch.bool, device=mask.device).tril_()  # (T, S)
    return bool(torch.equal(mask, causal.expand_as(mask)))


# transformers' function that builds a model's masks ahead of its forward, for `generate` with a
# static cache (the general one in masking_utils, or a model's own method of that name)
_AHEAD_OF_FORWARD = "create_masks_for_generate"


def _built_for_generate(depth: int = 8) -> bool:
    """Whether the mask being built is `generate`'s, made ahead of the forward: it comes back to
    the forward as `attention_mask`, and transformers' mask preparation there takes a tensor or
    a BlockMask only (a predicate fails on its `.ndim`). Read from the few frames above the
    builder (mask builder <- create_*_mask <- create_masks_for_generate, with decorators)."""
    frame = inspect.currentframe()
    frame = frame.f_back.f_back if frame is not None and frame.f_back is not None else None  # the builder's caller
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == _AHEAD_OF_FORWARD:
            return True
        frame = frame.f_back
    return False


# ----------------------------------------------------------- weights on request


class CaptureComplete(Exception):  # a signal, not an error: hence no Error suffix
    """Raised by the attention function once a `WeightsRequest(stop=True)` has every weight
    it asked for: the rest of the forward is skipped. `WeightsRequest.run` catches it."""


class AttentionCall(NamedTuple):
    """One call of the attention function, as a probe records it."""

    module: nn.Module
    H: int  # query heads
    Hkv: int  # key/value heads
    T: int  # queries
    S: int  # keys
    D: int  # query/key head dim


class WeightsRequest:
    """Heads whose attention weights a forward should return, per attention module.

    Pass it as the forward keyword `multihead_weights=` of a model running on
    attn_implementation="multihead" (transformers hands unknown keywords down to the
    attention function). Each listed module computes its output with the fused kernel
    and the weights of its listed heads only, `(B, len(heads), T, S)`, and hands them
    back here (`weights[module]`); unlisted modules compute no weights at all.

    Args:
        heads: {attention module: head indices, or None for all its heads}.
        stop: end the forward (by raising `CaptureComplete`, which `run` catches) once
            every listed module has been seen, so layers after the last one asked for
            are never computed.
        probe: record every call of the attention function (`calls`, a list of
            `AttentionCall`) instead of weights, to find a model's attention modules.
    """

    def __init__(self, heads: dict[nn.Module, Sequence[int] | None] | None = None, *, stop: bool = False,
                 probe: bool = False):
        self._heads = {id(m): (m, None if h is None else tuple(int(i) for i in h)) for m, h in (heads or {}).items()}
        self.stop = bool(stop)
        self.probe = bool(probe)
        self.weights: dict[int, Tensor] = {}
        self.calls: list[AttentionCall] = []

    def heads_for(self, module: nn.Module) -> tuple[int, ...] | bool | None:
        """The heads asked of `module`: a tuple, True for all, or None (not asked)."""
        entry = self._heads.get(id(module))
        if entry is None:
            return None
        return True if entry[1] is None else entry[1]

    def record(self, call: AttentionCall, weights: Tensor | None) -> None:
        """Called by the attention function: keep `weights` (or, probing, the call)."""
        if self.probe:
            self.calls.append(call)
            return
        module = call.module
        if weights is not None:
            self.weights[id(module)] = weights
        if self.stop and len(self.weights) == len(self._heads):
            raise CaptureComplete

    def get(self, module: nn.Module) -> Tensor | None:
        """The weights recorded for `module` `(B, len(heads), T, S)`, or None."""
        return self.weights.get(id(module))

    def run(self, model: nn.Module, **inputs):
        """model(**inputs, multihead_weights=self) under no_grad; CaptureComplete ends it early.
        Returns the model's output, or None if the forward was ended early."""
        with torch.no_grad():
            try:
                return model(**inputs, **{REQUEST_KEYWORD: self})
            except CaptureComplete:
                return None


class WeightsAnswer(NamedTuple):
    """How one attention call answers for its weights: what transformers asked
    (`output_attentions`: every head's, returned to it) and what a `WeightsRequest` asked
    of this module (its heads, recorded there). The attention function and the DeepSeek
    patch (`patch.LatentAttentionLayer`) both answer through it."""

    request: WeightsRequest | None
    want_all: bool  # output_attentions
    asked: tuple[int, ...] | bool | None  # the request's heads of this module (True: all; None: not asked)

    @classmethod
    def of(cls, module: nn.Module, kwargs: dict, want_all: bool) -> WeightsAnswer:
        """Read the forward's keywords; a `multihead_weights=` that is not a WeightsRequest is refused."""
        request = kwargs.get(REQUEST_KEYWORD)
        if request is not None and not isinstance(request, WeightsRequest):
            raise TypeError(f"{REQUEST_KEYWORD}= takes a multihead.interop.hf.WeightsRequest; "
                            f"received {type(request).__name__}")
        asked = request.heads_for(module) if request is not None and not request.probe else None
        return cls(request, bool(want_all), asked)

    @property
    def return_weights(self) -> bool | list[int]:
        """What to ask the kernel for: every head, the requested ones, or none."""
        asked = self.asked
        return True if self.want_all or asked is True else (list(asked) if asked else False)

    def record(self, call: AttentionCall, weights: Tensor | None) -> None:
        """Hand the request (if any) its heads of `weights` (as `return_weights` computed them)."""
        if self.request is None:
            return
        mine = weights
        if self.want_all and self.asked not in (None, True):
            mine = weights[:, list(self.asked)]
        self.request.record(call, None if self.asked is None else mine.detach())

    def returned(self, weights: Tensor | None) -> Tensor | None:
        """What goes back to transformers: the weights when output_attentions asked, else None."""
        return weights if self.want_all else None


# ---------------------------------------------------------- the attention function


def _sink_logits(sinks, B: int, H: int, T: int) -> Tensor | None:
    """Sink logits `(B|1, H, T|1, 1)` from a per-head `(H,)` parameter (GPT-OSS) or a 4-D tensor."""
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor):
        raise TypeError(f"attention sinks must be a tensor (H,) or (B, H, T, 1); received {type(sinks).__name__}")
    if sinks.dim() == 1 and sinks.shape[0] == H:
        return sinks.view(1, H, 1, 1)
    if sinks.dim() == 4 and sinks.shape[-1] == 1:
        return sinks
    raise ValueError(f"attention sinks must have shape (H,) = ({H},) or (B, H, T, 1) = ({B}, {H}, {T}, 1); "
                     f"received {tuple(sinks.shape)}")


def _with_sinks(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool, scale: float,
                softcap: float | None, sinks: Tensor, dropout_p: float) -> tuple[Tensor, Tensor]:
    """Attention with sinks (GPT-OSS: one extra logit per head in the softmax's
    denominator, with no value), which the fused kernels do not take: `attend`'s `sinks=`
    (a backend capability: "auto" picks the math path), and the softcap too when a model has
    both. Returns (out
    `(B, H, T, Dv)`, weights `(B, H, T, S)`, the probabilities before dropout)."""
    return functional.attend(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, return_weights=True,
                             score_mod=None if softcap is None else score_mods.softcap(softcap), sinks=sinks)


def _field_getter(self):  # the body of transformers' `PreTrainedConfig.output_attentions` (transformers 5)
    return self._output_attentions


_FIELD_READS: dict[type, bool] = {}  # config class -> whether its output_attentions is `_field_getter`


def _reads_the_field(cls: type) -> bool:
    """Whether `cls.output_attentions` is a property whose getter is exactly
    `return self._output_attentions` (bytecode and names compared) with no `attribute_map`
    renaming either name: then the instance's `_output_attentions` is what it returns."""
    prop = inspect.getattr_static(cls, "output_attentions", None)
    code = getattr(getattr(prop, "fget", None), "__code__", None) if isinstance(prop, property) else None
    renames = inspect.getattr_static(cls, "attribute_map", {})
    return code is not None and code.co_code == _field_getter.__code__.co_code \
        and code.co_names == _field_getter.__code__.co_names and isinstance(renames, dict) \
        and "output_attentions" not in renames and "_output_attentions" not in renames


def _config_output_attentions(module: nn.Module):
    """`module.config.output_attentions` (False without a config or without the attribute).

    transformers 5's configs answer every attribute read through two Python
    `__getattribute__` overrides, and `output_attentions` is a property over
    `_output_attentions`: about 6 us a read, once per layer per token of `generate`. Where the
    config's class has exactly that property (`_reads_the_field`, decided once per class),
    the field is read from the instance's `__dict__` instead; any other config (an older or
    newer transformers, a custom class) is read as written. Per call, so a change of the
    module's config, or of its flag, is seen at the next call. Inside torch.compile it is read
    as written too: dynamo traces the config's `__getattribute__` overrides, not a read of the
    instance's `__dict__` through `object.__getattribute__` (a graph break in every layer)."""
    config = getattr(module, "config", None)
    if config is None:
        return False
    if torch.compiler.is_compiling():
        return getattr(config, "output_attentions", False)
    cls = type(config)
    direct = _FIELD_READS.get(cls)
    if direct is None:
        direct = _FIELD_READS[cls] = _reads_the_field(cls)
    if direct:
        return object.__getattribute__(config, "__dict__").get("_output_attentions", False)
    return getattr(config, "output_attentions", False)


def _output_attentions(module: nn.Module, kwargs: dict):
    """Whether transformers asks for every head's weights: the `output_attentions` keyword if
    passed, else the module's config."""
    return kwargs["output_attentions"] if "output_attentions" in kwargs else _config_output_attentions(module)


# The forward keywords that ask for more than the kernel's plain call: a request, an intervention,
# an observer, or transformers' `output_attentions`
_ASKING = frozenset((REQUEST_KEYWORD, INTERVENTION_KEYWORD, OBSERVER_KEYWORD, "output_attentions"))
# What each of multihead's own keywords is, for the refusal of a compiled forward that carries one
_HOOKS = {REQUEST_KEYWORD: "a WeightsRequest", INTERVENTION_KEYWORD: "multihead.heads' hooks",
          OBSERVER_KEYWORD: "multihead.inspect's observer"}


def _refuse_compiled(module: nn.Module, kwargs: dict) -> None:
    """Inside torch.compile, refuse multihead's own keywords: each forward of a tool brings a
    new Python object whose methods (and what they record) a compiled graph would have to be
    retraced for, at every call, until dynamo's recompile limit fails the call."""
    asked = [name for name in _HOOKS if kwargs.get(name) is not None]
    if asked:
        what = ", ".join(f"{name}= ({_HOOKS[name]})" for name in asked)
        raise ValueError(f"{what} cannot run inside torch.compile; received a compiled forward of "
                         f"{type(module).__name__}; valid: run the tool on the uncompiled model (`del model.forward` "
                         "after `model.forward = torch.compile(model.forward)`, or `compiled._orig_mod`), or ask "
                         "for output_attentions=True, which compiles")


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, s_aux: Tensor | None = None,
                      sinks: Tensor | None = None, position_bias: Tensor | None = None, *,
                      backend: str = "auto", **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature, on multihead's kernel.

    query `(B, H, T, D)`, key `(B, Hkv, S, D)`, value `(B, Hkv, S, Dv)` -> (out
    `(B, T, H, Dv)`, weights `(B, H, T, S)` when output_attentions is asked, else None).
    Causality follows transformers' sdpa path: applied only when no mask is given (the
    mask utilities fold it into the mask otherwise), from `is_causal` or the module's
    `is_causal`, and top-left when a static cache's prefill hands more key slots than
    queries (those slots are empty, so they are cut off).

    Four jobs, in order: the decode step's quick way (nothing but q, k, v); the mask
    (`_resolve_mask`: transformers' mask, causality, the window, T5's bias); the kernel
    (`_attend`: sinks, softcap, the weights asked for); the answers (a request's weights,
    an intervention's edit of the heads' outputs).
    """
    if attention_mask is None and query.shape[2] == 1 and plain_scale(scaling) and position_bias is None \
            and softcap is None and s_aux is None and sinks is None and _ASKING.isdisjoint(kwargs) \
            and not _config_output_attentions(module):
        # A decode step with nothing but q, k, v (every layer, every token of `generate`): what
        # the general path below does with it, without its per-keyword work. One query sees
        # every key (no causality to apply). Without dropout on "auto", the kernel's own decode
        # step (`functional.decode_step`, attend's checks without its argument handling); else,
        # or where the tensors are not such a step, `attend`, which checks the shapes and the dropout.
        out = functional.decode_step(query, key, value, scaling) \
            if backend == "auto" and type(dropout) in (float, int) and dropout == 0 else None
        if out is None:
            out, _ = attend(query, key, value, None, scale=scaling, dropout_p=dropout, backend=backend)
        return out.transpose(1, 2).contiguous(), None  # (B, 1, H, Dv)
    if torch.compiler.is_compiling():
        _refuse_compiled(module, kwargs)
    intervention = kwargs.get(INTERVENTION_KEYWORD)
    own_keys = key.shape[2]
    if intervention is not None:  # multihead.heads reads or edits keys/values per KV head
        query, key, value = intervention.inputs(module, query, key, value)
    key, value, mask, causal = _resolve_mask(module, query, key, value, attention_mask, is_causal, sliding_window,
                                             position_bias, prepended=key.shape[2] - own_keys)
    B, H, T, _ = query.shape
    softcap = check_positive_number("softcap", softcap, allow_none=True)
    sinks = _sink_logits(s_aux if s_aux is not None else sinks, B, H, T)
    scale = check_positive_number("scaling", scaling, allow_none=True)
    answer = WeightsAnswer.of(module, kwargs, _output_attentions(module, kwargs))
    out, weights = _attend(module, query, key, value, mask, causal, dropout, scale, softcap, sinks,
                           answer.return_weights, backend, kwargs.get(OBSERVER_KEYWORD))
    if answer.request is not None:  # (no AttentionCall to build on the common path)
        answer.record(AttentionCall(module, H, key.shape[1], T, key.shape[2], query.shape[-1]), weights)
    if intervention is not None:  # ... and the heads' outputs, before the output projection
        out = intervention.output(module, out, value)
    out = out.transpose(1, 2).contiguous()  # (B, T, H, Dv)
    return out, answer.returned(weights)


def _resolve_mask(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, is_causal,
                  sliding_window, position_bias, *, prepended: int) -> tuple[Tensor, Tensor, object, bool]:
    """What the kernel is given for transformers' mask: (key, value, mask, causal). The mask
    as multihead reads it (`hf_mask`); without one, the layer's causality (a static cache's
    empty slots cut off, unless an intervention `prepended` keys before this call's own),
    the sliding window as a predicate; T5's position bias added to the mask; a predicate
    made dense where the written-out paths (bias, sinks) need a tensor."""
    B, H, T, _ = query.shape
    S = key.shape[2]
    mask = hf_mask(attention_mask, query.dtype)
    causal = False
    if mask is None and T > 1:
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if causal and S > T and not prepended:  # a static cache's prefill: the slots after the T queries are empty
            key, value = key[:, :, :T], value[:, :, :T]
            if position_bias is not None:
                position_bias = position_bias[..., :T]
            S = T
        window = int(sliding_window) if isinstance(sliding_window, int) and not isinstance(sliding_window, bool) \
            else None
        if causal and window is not None and S > window:  # no mask carries the window: apply it here
            mask, causal = masks.sliding_window(window), False  # bottom-right, a predicate (block-sparse)
    if isinstance(mask, MaskMod) and (position_bias is not None or torch.compiler.is_compiling()):
        # the written-out paths take tensors; so does a compiled model (the block-sparse engine
        # plans its tiles in Python per call, which dynamo cannot trace)
        mask = mask.to_dense(B, H, T, S, device=query.device)
    if position_bias is not None:  # T5: a learned bias on the scores, combined with the mask
        bias = position_bias.to(query.dtype)
        mask = bias if mask is None else mask + bias if mask.dtype != torch.bool \
            else bias.masked_fill(~mask, float("-inf"))
    return key, value, mask, causal


def _attend(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask, causal: bool, dropout,
            scale: float | None, softcap: float | None, sinks: Tensor | None, return_weights, backend: str,
            observer) -> tuple[Tensor, Tensor | None]:
    """The kernel's call, with the options checked: (out `(B, H, T, Dv)`, the weights
    `return_weights` asks for). The softcap as a score mod, attention sinks (logits
    `(B|1, H, T|1, 1)`) on the math path (`_with_sinks`), the observer told exactly what
    the kernel is given, before it runs."""
    if isinstance(mask, MaskMod) and sinks is not None:
        B, H, T, _ = query.shape
        mask = mask.to_dense(B, H, T, key.shape[2], device=query.device)  # the math path with sinks takes tensors
    score_mod = None if softcap is None else score_mods.softcap(softcap)
    if observer is not None:
        observer.observe(module, query, key, mask=mask, causal=causal,
                         scale=query.shape[-1] ** -0.5 if scale is None else scale, score_mod=score_mod, sinks=sinks)
    if sinks is None:
        return attend(query, key, value, mask, causal=causal, scale=scale, dropout_p=dropout,
                      return_weights=return_weights, backend=backend, score_mod=score_mod)
    out, weights = _with_sinks(query, key, value, mask, causal=causal,
                               scale=query.shape[-1] ** -0.5 if scale is None else scale,
                               softcap=softcap, sinks=sinks, dropout_p=dropout)
    if not return_weights:
        weights = None
    elif return_weights is not True:
        weights = weights[:, return_weights]
    return out, weights


# ------------------------------------------------------------------ registering


def register(name: str = "multihead", *, backend: str = "auto") -> str:
    """Register multihead's kernel with transformers as attention implementation `name`.

    Importing `multihead.interop.hf` registers "multihead" (backend "auto"). Register
    another name for another backend, e.g. `register("multihead_math", backend="math")`
    for the explicit path that matches transformers' eager attention operation by
    operation. Returns `name`.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string; received {name!r}")
    if name in _RESERVED:
        raise ValueError(f"{name!r} is one of transformers' own attention implementations; "
                         f"choose another name (reserved: {', '.join(_RESERVED)})")
    check_backend_name(backend)
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise ImportError("attn_implementation='multihead' needs transformers >= 4.53 (AttentionInterface and "
                          f"AttentionMaskInterface): pip install 'multihead[hf]' (from a checkout of the repository: "
                          f"pip install -e '.[hf]') ({err})") from None
    fn = functools.partial(attention_forward, backend=backend)
    functools.update_wrapper(fn, attention_forward)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, multihead_mask)
    _REGISTERED[name] = backend
    return name


def registered() -> dict[str, str]:
    """The names registered by this process, with their backends."""
    return dict(_REGISTERED)

