"""Context parallelism for `Attention`: a layer whose input is this rank's shard of the
sequence runs its kernel through `ring_attention`, and RoPE rotates each token by its
position in the whole sequence.

Everything else in the layer (the projections, RoPE itself) works token by token, so
only the kernel needs the other ranks: `Attention._attend` is the one method replaced.
Parameters stay whole on every rank; each rank's parameter gradients are its shard's
share, so sum them across the group after backward (as data parallelism does; the
example does it with one all_reduce per parameter).

torch has its own `torch.distributed.tensor.experimental.context_parallel`: it patches
`F.scaled_dot_product_attention` for CUDA's flash / efficient kernels inside a context
manager. It is not used here: the ring below runs on CPU/gloo and CUDA/NCCL alike.
"""

from __future__ import annotations

import copy
import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.attention import Attention
from multihead.distributed._group import (
    GroupRef,
    agree_on,
    check_layout,
    chunk_ids,
    layout_code,
    resolve_group,
    tensor_code,
)
from multihead.distributed.ring import ring_attention
from multihead.layer_parts import check_input

__all__ = ["context_parallel", "shard_positions"]


def shard_positions(length: int, layout: str = "zigzag", group=None, device=None) -> Tensor:
    """Global positions `(length,)` of the tokens of this rank's shard of `length` tokens."""
    group = resolve_group(group, "shard_positions")
    check_layout(layout)
    P, r = dist.get_world_size(group), dist.get_rank(group)
    ids = chunk_ids(r, P, layout)
    c = length // len(ids)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


class _ContextParallel:
    """Mixed into the module's class by `context_parallel`."""

    cp_group = None
    cp_layout: str

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                cache=None, return_weights=False, positions: Tensor | None = None, rotary=None):
        """x `(B, T, C)` is this rank's shard (T = N/P tokens, in `shard_sequence` order).

        mask: None or a bool key-padding mask `(B, T)` of this rank's tokens (True = may
        attend). positions default to the shard's global positions.
        """
        group = self._group()
        # Every rank checks its call, then the ranks agree on what each received before any
        # of them raises: one rank's wrong width must not leave the others in the ring.
        agree_on(resolve_group(group, "context_parallel"), "context_parallel layer",
                 lambda: self._describe_call(x, context, mask, cache, return_weights, positions, rotary),
                 _CALL_WIDTH, "(x, mask, positions, cos, sin: present, ndim, dtype, shape; training; device)")
        if self.rope is not None and positions is None and rotary is None:
            positions = shard_positions(x.shape[1], self.cp_layout, group, device=x.device)
        return super().forward(x, mask=mask, positions=positions, rotary=rotary)

    def _describe_call(self, x, context, mask, cache, return_weights, positions, rotary) -> list[int]:
        """This rank's checks of a call (ValueError/TypeError), else its description."""
        if context is not None:
            raise ValueError("a context-parallel layer is self-attention over the sharded sequence; "
                             "received a context (cross-attention is not supported)")
        if cache is not None:
            raise ValueError("a context-parallel layer takes no KV cache (decode with the unsharded module)")
        if return_weights is not False:
            raise ValueError("a context-parallel layer cannot return attention weights: no rank holds the "
                             "(T, N) weights of its queries; use the unsharded module to inspect them")
        if self.training and self.dropout > 0:
            raise ValueError(f"ring attention applies no dropout; this layer has dropout={self.dropout} in "
                             f"training mode: set dropout=0 or call .eval()")
        check_input("x", x, self.d_model)
        weight = self.q_proj.weight
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x is {x.dtype} but this module's weights are {weight.dtype}; cast one to the other")
        if mask is not None and (not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2):
            got = f"shape {tuple(mask.shape)}, {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be None or a bool key-padding mask (B, T) of this rank's tokens; "
                             f"received {got}")
        if positions is not None and rotary is not None:
            raise ValueError("pass positions= or rotary=(cos, sin), not both")
        if (positions is not None or rotary is not None) and self.rope is None:
            raise ValueError("positions/rotary were given but this module has no rotary embedding (rope=None)")
        if positions is not None:
            self._check_positions(positions, x.shape[0], x.shape[1])
        cos = sin = None
        if rotary is not None:
            if not (isinstance(rotary, tuple) and len(rotary) == 2 and all(isinstance(t, Tensor) for t in rotary)):
                raise TypeError(f"rotary must be a tuple (cos, sin) of tensors; received {type(rotary).__name__}")
            cos, sin = rotary
        return [*tensor_code(x, 3), *tensor_code(mask, 2), *tensor_code(positions, 2), *tensor_code(cos),
                *tensor_code(sin), int(self.training), zlib.crc32(str(x.device).encode())]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask, *, causal: bool, dropout_p: float,
                return_weights) -> tuple[Tensor, None]:
        out = ring_attention(q, k, v, causal=causal, layout=self.cp_layout, group=self._group(), mask=mask,
                             _agreed=True)  # forward agreed on the call: shapes follow from it
        return out, None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", context parallel: layout={self.cp_layout!r}"

    # The class is made by `context_parallel`, so pickle cannot find it by name: it is made
    # again from the original class on load. A process group cannot be saved: the default
    # group is saved as None (resolved at each call, in the loading process); another group
    # is left out, and the loaded layer says so when called.
    def __reduce_ex__(self, protocol):
        state = self.__getstate__()
        group = state.get("cp_group")
        if group is not None and not (dist.is_initialized() and group == dist.group.WORLD):
            state["cp_group"] = _GROUP_NOT_SAVED
        else:
            state["cp_group"] = None
        return _new_context_parallel, (type(self).__bases__[1],), state

    def __deepcopy__(self, memo):
        new = _new_context_parallel(type(self).__bases__[1])
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k != "cp_group"}
        new.__setstate__(copy.deepcopy(state, memo))
        new.cp_group = self.cp_group  # the same group, not a copy of it
        return new

    def _group(self):
        if isinstance(self.cp_group, str):
            raise ValueError("this context-parallel layer was saved with a process group other than the default "
                             "one, which cannot be saved; set layer.cp_group = <your group> after loading")
        return self.cp_group.get() if isinstance(self.cp_group, GroupRef) else self.cp_group


# Length of the description of one call that the ranks compare (see _describe_call).
_CALL_WIDTH = (3 + 3) + (3 + 2) + (3 + 2) + 2 * (3 + 4) + 2  # tensor_code(t, n) gives 3 + n ints

# What a pickled layer holds in place of a group that is not the default one.
_GROUP_NOT_SAVED = "<process group not saved>"

_CLASSES: dict[type, type] = {}


def _cp_class(cls: type) -> type:
    """The context-parallel class of `cls`, made once per process."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ContextParallel{cls.__name__}", (_ContextParallel, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _new_context_parallel(cls: type) -> Attention:
    """An empty instance of the context-parallel class of `cls` (what unpickling calls)."""
    return _cp_class(cls).__new__(_cp_class(cls))


def context_parallel(module: Attention, group=None, layout: str = "zigzag") -> Attention:
    """Make `module` take this rank's shard of the sequence and attend over all of it, in place.

    Every rank calls the layer on its shard `x_r = shard_sequence(x, 1, layout)`; the
    result is `shard_sequence(module(x), 1, layout)` of the unsharded layer, and
    `gather_sequence` gives the whole. Keys and values travel around the ring
    (`ring_attention`); RoPE uses global positions. Not supported (ValueError):
    cross-attention, KV caches, returned weights, dropout in training,
    sliding_window / softcap / alibi (the ring applies none of them).

    Returns the module (its class is now a `ContextParallel...` subclass of the original).
    """
    group = resolve_group(group, "context_parallel")

    def check():
        if isinstance(module, _ContextParallel):
            raise ValueError("this module is already context-parallel")
        if not isinstance(module, Attention):
            raise TypeError(f"context_parallel takes a multihead Attention; received {type(module).__name__}")
        check_layout(layout)
        unsupported = [name for name, on in (("sliding_window", module.sliding_window is not None),
                                             ("softcap", module.softcap is not None), ("alibi", module.alibi)) if on]
        if unsupported:
            raise ValueError(f"context_parallel runs the kernel as ring attention, which does not apply "
                             f"{', '.join(unsupported)}; received a module with {', '.join(unsupported)} set")
        return [layout_code(layout), module.d_model, module.n_heads, module.n_kv_heads, module.head_dim,
                int(module.causal), int(module.rope is not None)]

    # every rank wraps its layer together: one rank's refusal must not leave the others in the ring
    agree_on(group, "context_parallel", check, 7, "(layout, d_model, n_heads, n_kv_heads, head_dim, causal, rope)")
    module.__class__ = _cp_class(type(module))
    # The default group is kept as None and resolved at each call, another one weakly: a
    # module that held the group would keep it alive past destroy_process_group() (see GroupRef).
    module.cp_group = None if group == dist.group.WORLD else GroupRef(group)
    module.cp_layout = layout
    return module
