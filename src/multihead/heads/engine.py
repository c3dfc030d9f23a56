"""The one place where `multihead.heads` meets a model: hooks that see every attention
layer's per-head tensors in a forward and let a handler read or rewrite them.

Two ways in, one interface: a transformers model on `attn_implementation="multihead"` gets
the keyword `multihead_heads=` (the registry's `INTERVENTION_KEYWORD`), which transformers
hands to the attention function, where the adapter sees q/k/v after RoPE and the heads'
outputs; a module that implements `multihead.head_access` (`Attention`, `LatentAttention`)
gets torch hooks on the projections it names (keys and values before RoPE: equal for
patching whole positions). Handlers work in TransformerLens' hook layout: z `(B, T, H, Dv)`,
k `(B, S, Hkv, D)`, v `(B, S, Hkv, Dv)`, pattern `(B, H, T, S)`; layers are numbered in the
order their attention runs. Every hook is removed when the context ends, also on an
exception, and acts only in the thread that installed it (`Hooks`). A model whose one
attention module runs several times in a forward (ALBERT's shared layer) is refused by name.
"""

from __future__ import annotations

import inspect
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from multihead.head_access import has_heads
from multihead.model_state import compiled

KEYWORD = "multihead_heads"  # = multihead.interop.hf.registry.INTERVENTION_KEYWORD (not imported: no transformers)
WEIGHTS_KEYWORD = "multihead_weights"  # = its REQUEST_KEYWORD


@dataclass
class Layer:
    """One attention layer as a forward met it."""

    index: int
    module: nn.Module
    kind: str  # "hf" | "attention" | "latent"
    H: int  # query heads
    Hkv: int  # key/value heads ("heads" of k and v: H for MLA, through the up-projection)
    D: int  # key head dim
    Dv: int  # value head dim


class Handler:
    """What an intervention does; every method returns its input unchanged by default."""

    def k(self, layer: Layer, k: Tensor) -> Tensor:  # (B, S, Hkv, D)
        return k

    def v(self, layer: Layer, v: Tensor) -> Tensor:  # (B, S, Hkv, Dv)
        return v

    def latent(self, layer: Layer, c: Tensor) -> Tensor:  # MLA: (B, S, 1, R + rope_dim), kv_a_proj's output
        return c

    def z(self, layer: Layer, z: Tensor, v: Tensor | None) -> Tensor:  # (B, T, H, Dv); v of this call
        return z

    def wants_weights(self, layer: Layer) -> bool:
        return False

    def weights(self, layer: Layer, w: Tensor) -> None:  # (B, H, T, S)
        pass

    def wants_kv(self, layer: Layer) -> bool:
        """Whether k/v (and v for z) are needed: MLA then runs its naive path."""
        return False

    def begin(self) -> None:  # a forward of the top model starts
        pass


# torch numbers hooks from one class-wide counter without a lock: two threads registering
# at once could get one id and overwrite (or remove) each other's hook
_REGISTER = threading.Lock()


class Hooks:
    """Forward hooks of one call: each acts only in the thread that installed it (a forward
    of the same modules in another thread passes through untouched); `remove` takes all."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.handles: list = []

    def _here(self, fn):
        thread = self.thread

        def hook(*args):
            return fn(*args) if threading.get_ident() == thread else None
        return hook

    def pre(self, module: nn.Module, fn, with_kwargs: bool = False) -> None:
        """fn(module, args) or, with_kwargs, fn(module, args, kwargs): torch's forward pre-hook."""
        with _REGISTER:
            self.handles.append(module.register_forward_pre_hook(self._here(fn), with_kwargs=with_kwargs))

    def post(self, module: nn.Module, fn) -> None:
        """fn(module, args, output): torch's forward hook."""
        with _REGISTER:
            self.handles.append(module.register_forward_hook(self._here(fn)))

    def remove(self) -> None:
        with _REGISTER:
            for h in self.handles:
                h.remove()
        self.handles.clear()


def _recomputing() -> bool:
    """Whether autograd is running a backward (gradient checkpointing runs the forward of a
    block again there: a second call of its attention that is no second layer)."""
    task = getattr(torch._C, "_current_graph_task_id", None)  # torch's, no public spelling
    return task is not None and task() != -1


def parents_of(model: nn.Module) -> dict[int, nn.Module]:
    """id(child) -> its parent module, for every module of `model` (built once per call)."""
    return {id(c): m for m in model.modules() for c in m.children()}


def is_hf(model: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def forward_takes(model: nn.Module, *names: str) -> bool:
    """Whether the model's forward names every keyword of `names` (False when its signature
    cannot be read)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


def multihead_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules the tools understand (`multihead.head_access`: multihead's
    `Attention` and `LatentAttention`) in module order, each once, with the one a layer holds
    as `.mla` (a patched DeepSeek layer keeps it unregistered; `convert.to_mla`'s transformers
    layer registers it, so it is met twice)."""
    out: dict[int, nn.Module] = {}
    for m in model.modules():
        if has_heads(m):
            out.setdefault(id(m), m)
        elif has_heads(getattr(m, "mla", None)):
            out.setdefault(id(m.mla), m.mla)
    return list(out.values())


def check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module (a transformers model or one built from multihead's "
                        f"Attention/LatentAttention); received {type(model).__name__}")
    if compiled(model):
        # The tools hook every attention call and change their handlers on each call: inside a compiled
        # forward every call recompiles until dynamo's limit, so they refuse up front instead.
        raise ValueError(f"{type(model).__name__} is compiled (torch.compile); multihead.heads hooks its attention "
                         "calls, which a compiled forward cannot take call after call; valid: the uncompiled "
                         "model (for torch.compile(model): its ._orig_mod)")
    if is_hf(model):
        impl = getattr(model.config, "_attn_implementation", None)
        from multihead.interop.hf import registered  # registers "multihead" (transformers is already imported)

        if impl not in registered() and not multihead_modules(model):
            raise ValueError(f"this transformers model runs attn_implementation={impl!r}; multihead.heads needs "
                             "'multihead': load it with attn_implementation='multihead' or call "
                             "model.set_attn_implementation('multihead')")
    elif not multihead_modules(model):
        raise ValueError(f"{type(model).__name__} has no multihead Attention/LatentAttention module and is not a "
                         "transformers model; valid: a transformers model on attn_implementation='multihead', or "
                         "a module built from multihead.Attention / LatentAttention")


def check_grad_mode(what: str) -> None:
    """Tools that differentiate (importance, attribution) turn gradients on themselves, which
    torch.inference_mode() forbids: say so instead of autograd's "does not require grad"."""
    if torch.is_inference_mode_enabled():
        raise ValueError(f"{what} differentiates through the model, and it was called inside torch.inference_mode(), "
                         "where nothing can; valid: call it outside the inference_mode block (inside torch.no_grad() "
                         "is fine: it turns gradients on itself)")


class Engine:
    """The hooks of one context on one model, routing every layer's tensors to `handler`."""

    def __init__(self, model: nn.Module, handler: Handler, order: dict[int, Layer] | None = None):
        self.model = model
        self.handler = handler
        self.layers: dict[int, Layer] = {} if order is None else order  # id(module) -> Layer
        self._v: dict[int, Tensor] = {}  # layer index -> this call's v (for pattern z)
        self._asked: dict[int, object] = {}  # id(module) -> the caller's own return_weights
        self._ran: set[int] = set()  # id(module) of the attention calls of this forward
        self.hf = is_hf(model)

    # ---------------------------------------------------------------- layers

    def layer(self, module: nn.Module, kind: str, H: int, Hkv: int, D: int, Dv: int) -> Layer:
        entry = self.layers.get(id(module))
        if entry is None:
            entry = self.layers[id(module)] = Layer(len(self.layers), module, kind, H, Hkv, D, Dv)
        return entry

    def called(self, module: nn.Module) -> None:
        """One attention call of this forward; a second call of the same module is refused."""
        if id(module) in self._ran and not _recomputing():
            lay = self.layers.get(id(module))
            raise ValueError(
                f"{type(self.model).__name__} runs one attention module ({type(module).__name__}"
                f"{'' if lay is None else f', layer {lay.index}'}) more than once in a forward (its weights are shared "
                "across layers, as in ALBERT); multihead.heads tells layers apart by module and cannot number its "
                "calls; valid: models whose every attention layer has a module of its own")
        self._ran.add(id(module))

    def ordered(self) -> list[Layer]:
        return sorted(self.layers.values(), key=lambda lay: lay.index)

    # ------------------------------------------------------------------ hooks

    @contextmanager
    def installed(self):
        hooks = Hooks()
        try:
            hooks.pre(self.model, self._top, with_kwargs=True)
            for m in multihead_modules(self.model):
                self._hook_module(hooks, m)
            for owner in self.model.modules():  # a patched DeepSeek layer: number its LatentAttention as it starts
                if has_heads(getattr(owner, "mla", None)):
                    hooks.pre(owner, lambda mod, a: self._mh_layer(mod.mla) and None)
            yield self
        finally:
            hooks.remove()
            self._v.clear()
            self._asked.clear()

    def _top(self, model, args, kwargs):
        self._ran.clear()
        self.handler.begin()
        if not self.hf:
            return None
        previous = kwargs.get(KEYWORD)
        adapter = _HFAdapter(self)
        kwargs = dict(kwargs)
        kwargs[KEYWORD] = adapter if previous is None else _Chain(previous, adapter)
        if any(self.handler.wants_weights(lay) for lay in self.ordered()) or not self.layers:
            if kwargs.get(WEIGHTS_KEYWORD) is None:
                kwargs[WEIGHTS_KEYWORD] = _weights_request(self)
        return args, kwargs

    def _hook_module(self, hooks: Hooks, m: nn.Module) -> None:
        heads = m.head_access()
        latent = heads.kind == "latent"
        hooks.pre(m, lambda mod, a, kw: self._mh_pre(mod, a, kw, latent), with_kwargs=True)
        hooks.post(m, lambda mod, a, out: self._mh_post(mod, out))
        if latent and heads.latent is None:
            raise ValueError(f"{type(self.model).__name__} holds a LatentAttention without kv_a_proj (the layer that "
                             "holds it computes its latent from per-head normed keys, as convert.to_mla makes for a "
                             "model with q/k norms such as Qwen3), whose keys, values and latent multihead.heads "
                             "cannot see; valid: a model converted from a family without q/k norms (Llama, Mistral, "
                             "Qwen2), or the model before conversion")
        if latent:
            hooks.post(heads.kv, lambda mod, a, out: self._mla_kv(m, out))
            hooks.post(heads.latent, lambda mod, a, out: self._mla_latent(m, out))
        else:
            hooks.post(heads.k, lambda mod, a, out: self._mh_proj(m, out, "k"))
            hooks.post(heads.v, lambda mod, a, out: self._mh_proj(m, out, "v"))
        hooks.pre(heads.o, lambda mod, a: self._mh_z(m, a))

    def _mh_layer(self, m: nn.Module) -> Layer:
        entry = self.layers.get(id(m))
        if entry is not None:
            return entry
        a = m.head_access()
        return self.layer(m, a.kind, a.H, a.Hkv, a.D, a.Dv)

    def _mh_pre(self, m, args, kwargs, latent: bool):
        lay = self._mh_layer(m)
        changed = False
        if self.handler.wants_weights(lay):
            self._asked[id(m)] = kwargs.get("return_weights", False)
            kwargs = {**kwargs, "return_weights": True}
            changed = True
        if latent and self.handler.wants_kv(lay) and kwargs.get("absorb") is not False:
            kwargs = {**kwargs, "absorb": False}  # per-head k/v exist only on the naive path
            changed = True
        return (args, kwargs) if changed else None

    def _mh_post(self, m, out):
        if id(m) not in self._asked:
            return None
        asked = self._asked.pop(id(m))
        y, w = out
        self.handler.weights(self._mh_layer(m), w)
        if asked is False:
            return y
        return (y, w) if asked is True else (y, w[:, list(asked)])

    def _mh_proj(self, m, out: Tensor, what: str):
        lay = self._mh_layer(m)
        B, S, width = out.shape
        t = out.view(B, S, width // lay.D, lay.D)  # (B, S, Hkv, D)
        new = self.handler.k(lay, t) if what == "k" else self.handler.v(lay, t)
        if what == "v":
            self._v[lay.index] = new
        return None if new is t else new.reshape(B, S, width)

    def _mla_kv(self, m, out: Tensor):
        lay = self._mh_layer(m)
        B, S, width = out.shape
        kv = out.view(B, S, lay.H, lay.D + lay.Dv)  # (B, S, H, D + Dv): rows per head [W_UK_h ; W_UV_h]
        k, v = kv.split([lay.D, lay.Dv], dim=-1)
        k2, v2 = self.handler.k(lay, k), self.handler.v(lay, v)
        self._v[lay.index] = v2
        if k2 is k and v2 is v:
            return None
        return torch.cat([k2, v2], dim=-1).reshape(B, S, width)

    def _mla_latent(self, m, out: Tensor):
        lay = self._mh_layer(m)
        c = out.unsqueeze(2)  # (B, S, 1, R + rope_dim): the latent, one "head" shared by all
        new = self.handler.latent(lay, c)
        return None if new is c else new.squeeze(2)

    def _mh_z(self, m, args):
        self.called(m)  # o_proj runs once per attention call, on every path
        lay = self._mh_layer(m)
        x = args[0]
        B, T, width = x.shape
        z = x.view(B, T, lay.H, width // lay.H)  # (B, T, H, Dv)
        new = self.handler.z(lay, z, self._v.pop(lay.index, None))
        return None if new is z else (new.reshape(B, T, width), *args[1:])


class _HFAdapter:
    """The object transformers hands down to `attention_forward` as `multihead_heads=`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._v: dict[int, Tensor] = {}

    def inputs(self, module, query, key, value):
        e = self.engine
        e.called(module)
        lay = e.layer(module, "hf", query.shape[1], key.shape[1], query.shape[-1], value.shape[-1])
        k = key.transpose(1, 2)  # (B, S, Hkv, D)
        k2 = e.handler.k(lay, k)
        v = value.transpose(1, 2)  # (B, S, Hkv, Dv)
        v2 = e.handler.v(lay, v)
        if k2 is not k:
            key = k2.transpose(1, 2)
        if v2 is not v:
            value = v2.transpose(1, 2)
        self._v[lay.index] = v2
        return query, key, value

    def output(self, module, out, value):
        e = self.engine
        lay = e.layers[id(module)]
        z = out.transpose(1, 2)  # (B, T, H, Dv)
        z2 = e.handler.z(lay, z, self._v.pop(lay.index, None))
        return out if z2 is z else z2.transpose(1, 2)


class _Chain:
    """Two interventions in one forward (nested contexts): the outer one first."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def inputs(self, module, q, k, v):
        return self.second.inputs(module, *self.first.inputs(module, q, k, v))

    def output(self, module, out, value):
        return self.second.output(module, self.first.output(module, out, value), value)


def _key(module) -> int:
    """A patched DeepSeek layer asks for weights as itself; its LatentAttention is the layer."""
    mla = getattr(module, "mla", None)
    return id(mla) if has_heads(mla) else id(module)


def _weights_request(engine: Engine):
    from multihead.interop.hf.registry import WeightsRequest

    class _Request(WeightsRequest):
        """Weights of the layers the handler asks for, handed to it as they are computed."""

        def heads_for(self, module):
            lay = engine.layers.get(_key(module))
            return True if lay is not None and engine.handler.wants_weights(lay) else None

        def record(self, call, weights):
            if weights is not None:
                engine.handler.weights(engine.layers[_key(call.module)], weights)

    return _Request()


# ---------------------------------------------------------------- inputs and outputs


def run(model: nn.Module, inputs):
    """model(inputs): a tensor is the first argument, a mapping the keywords."""
    if isinstance(inputs, Tensor):
        return model(inputs)
    if hasattr(inputs, "keys") and hasattr(inputs, "__getitem__"):
        return model(**{k: inputs[k] for k in inputs.keys()})
    raise TypeError(f"inputs must be a tensor (input_ids) or a mapping of keyword arguments (a tokenizer's "
                    f"BatchEncoding); received {type(inputs).__name__}")


def logits_of(out) -> Tensor:
    """The run's logits: `.logits`, else `.last_hidden_state` (a base model), else the tensor."""
    if isinstance(out, Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if isinstance(t, Tensor):
            return t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(f"cannot find logits in the model's output of type {type(out).__name__}")


def batch_size(inputs) -> int:
    if isinstance(inputs, Tensor):
        return inputs.shape[0]
    for k in inputs.keys():
        t = inputs[k]
        if isinstance(t, Tensor) and t.dim() >= 1:
            return t.shape[0]
    raise ValueError("inputs hold no tensor")


def padding_of(inputs) -> Tensor | None:
    """The (B, T) bool mask of real tokens, when the inputs carry an attention_mask."""
    if isinstance(inputs, Tensor) or not hasattr(inputs, "keys"):
        return None
    m = inputs["attention_mask"] if "attention_mask" in inputs.keys() else None
    return None if m is None or not isinstance(m, Tensor) or m.dim() != 2 else m.bool()
