"""Tensor parallelism over heads (Shoeybi et al., 2019, "Megatron-LM").

Heads are independent until the output projection, so P ranks can each compute H/P of
them: q/k/v are split by output columns (`ColwiseParallel`, each rank gets whole heads
because the columns of a head are contiguous), o by input rows (`RowwiseParallel`,
whose partial sums one all-reduce adds). The input x is replicated; its gradient is
all-reduced by ColwiseParallel's backward. The modules read the local head count back
from the projection outputs (`view(B, T, -1, D)`), so their forward runs unchanged.

Details: docs/distributed.md, "Tensor parallelism over heads: GQA with Hkv < P, and MLA".
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import Attention
from multihead.checks import check_divisible
from multihead.distributed._group import GroupRef, agree_on, float_code, tensor_code
from multihead.latent import LatentAttention

__all__ = ["shard_heads"]


class _SumGrad(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (Megatron's "f")."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = GroupRef(group)  # the graph holds no group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group.get())
        return grad, None


class _Wait(torch.autograd.Function):
    """Identity that waits for an async collective's result (the gradient passes through)."""

    @staticmethod
    def forward(ctx, t):
        return t.trigger_wait()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _waited(t):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor  # heavy: imported on use

    return _Wait.apply(t) if isinstance(t, AsyncCollectiveTensor) else t


class _SharedKVHeads(nn.Module):
    """k_proj or v_proj when Hkv < P: the whole projection on every rank, one KV head used.

    Keeps the parameter names `weight` and `bias`, so state dicts keep their keys.
    """

    def __init__(self, linear: nn.Linear, rows: slice, group):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.rows = rows
        self._group = GroupRef(group)

    def forward(self, x: Tensor) -> Tensor:
        group = self._group.get()
        w = _SumGrad.apply(self.weight, group)[self.rows]  # (D, C): this rank's KV head
        b = None if self.bias is None else _SumGrad.apply(self.bias, group)[self.rows]
        return F.linear(_SumGrad.apply(x, group), w, b)

    def extra_repr(self) -> str:
        return f"rows={self.rows.start}:{self.rows.stop} of {self.weight.shape[0]} (replicated KV heads)"


# What the ranks compare of a tensor-parallel layer's call (the arguments of Attention's and
# LatentAttention's forward), each described by _ARG_WIDTH ints.
_CALL_ARGS = ("x", "context", "mask", "cache", "return_weights", "positions", "rotary", "absorb")
_ARG_WIDTH = 8


def _describe(v) -> list[int]:
    """A fixed-length description of one argument, equal on two ranks when their calls match."""
    if v is None:
        code = [0]
    elif isinstance(v, Tensor):
        code = tensor_code(v, 4)
    elif isinstance(v, bool):
        code = [1, int(v)]
    elif isinstance(v, (int, float)):
        code = [2, float_code(v)]
    elif isinstance(v, (list, tuple)):
        code = [3, len(v), *[int(t) if isinstance(t, int) else t.numel() if isinstance(t, Tensor) else -1
                             for t in v[:_ARG_WIDTH - 2]]]
    elif hasattr(v, "length") and hasattr(v, "max_len"):  # a cache
        code = [4, v.length, v.max_len, *getattr(v, "k", getattr(v, "buf", None)).shape]
    else:  # a predicate or another object: its type
        code = [5, zlib.crc32(type(v).__qualname__.encode())]
    return (code + [0] * _ARG_WIDTH)[:_ARG_WIDTH]


class _HeadSharded:
    """Mixed into the module's class by `shard_heads`: the local head bookkeeping."""

    tp_mesh = None
    tp_heads: tuple[int, int]  # (first, count) of this rank's query heads
    tp_kv_heads: tuple[int, int]  # (first, count) of this rank's KV heads

    def forward(self, *args, **kwargs):
        # The ranks agree on a description of this call first (one small all_gather): a call
        # that raises on one rank alone (a wrong width, a cache on one rank) would leave the
        # others in the projections' collectives.
        agree_on(self.tp_mesh.get_group(), f"tensor-parallel {type(self).__bases__[1].__name__}",
                 lambda: self._describe_call(args, kwargs), len(_CALL_ARGS) * _ARG_WIDTH,
                 f"({', '.join(_CALL_ARGS)}: type, ndim or length, dtype or value, shape)")
        # RowwiseParallel ends in an async all-reduce (an AsyncCollectiveTensor): waited for
        # here, so an output nobody reads leaves no collective unwaited ("there are still 1
        # unwaited collective calls" at exit, with the README's snippet).
        out = super().forward(*args, **kwargs)
        return tuple(_waited(t) for t in out) if isinstance(out, tuple) else _waited(out)

    def _describe_call(self, args, kwargs) -> list[int]:
        import inspect

        try:
            bound = inspect.signature(super().forward).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{type(self).__bases__[1].__name__}.forward: {e}") from None
        x = bound.arguments.get("x")
        if isinstance(x, Tensor) and x.dim() == 3 and x.shape[-1] != self.d_model:
            raise ValueError(f"x has width {x.shape[-1]}; this module expects {self.d_model}")
        return [code for name in _CALL_ARGS for code in _describe(bound.arguments.get(name))]

    def extra_repr(self) -> str:
        h0, h = self.tp_heads
        return (super().extra_repr() + f", tensor parallel: heads {h0}..{h0 + h - 1} on rank "
                f"{self.tp_mesh.get_local_rank()} of {self.tp_mesh.size()}")


class _ShardedAttention(_HeadSharded):
    def new_cache(self, batch_size: int, max_len: int | None = None, **kwargs):
        """A cache of this rank's KV heads only: `(B, Hkv_local, max_len, D)`."""
        full = self.n_kv_heads
        self.n_kv_heads = self.tp_kv_heads[1]  # the parent reads the head count from here
        try:
            return super().new_cache(batch_size, max_len, **kwargs)
        finally:
            self.n_kv_heads = full

    def _score_mod(self):
        """ALiBi with the slopes of this rank's heads (h0 .. h0 + h - 1), not of heads 0 .. h - 1."""
        if not self.alibi:
            return super()._score_mod()
        from multihead import score_mods  # the kernel floor (already loaded with multihead.functional)

        h0, h = self.tp_heads
        return score_mods.alibi(score_mods.alibi_slopes(self.n_heads)[h0:h0 + h])


class _ShardedLatent(_HeadSharded):
    def latents(self, x: Tensor, offset: int = 0, **kwargs) -> Tensor:
        # Every rank's heads read the one replicated latent: its gradient is their sum.
        return _SumGrad.apply(super().latents(x, offset, **kwargs), self.tp_mesh.get_group())


_CLASSES: dict[type, type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Give `module` a subclass of its class with `mixin` first (what FSDP2's fully_shard does)."""
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"HeadSharded{cls.__name__}", (mixin, cls), {"__module__": __name__})
    module.__class__ = _CLASSES[cls]


def _broadcast(parts: list[nn.Module], mesh) -> None:
    with torch.no_grad():
        for part in parts:
            for p in part.parameters():
                dist.broadcast(p, mesh.mesh[0].item(), group=mesh.get_group())


def _check(module, mesh) -> None:
    """The process group and the mesh, checked here; the module, checked on every rank and
    agreed on before any rank raises (one rank's refusal would leave the others waiting in
    parallelize_module's collectives)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_heads needs a process group: call torch.distributed.init_process_group() "
                           "(torchrun sets its environment) and pass a DeviceMesh")
    from torch.distributed.device_mesh import DeviceMesh  # heavy: imported on use

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a 1-D torch.distributed.device_mesh.DeviceMesh, e.g. "
                        f"init_device_mesh('cpu', (world_size,)); received {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"mesh must be 1-D (the ranks that share the heads); received {mesh.ndim}-D "
                         f"{tuple(mesh.shape)}: pass one dimension, e.g. mesh['tp']")

    def check():
        _check_module(module, mesh)
        kind = 1 if isinstance(module, Attention) else 2
        return [kind, module.d_model, module.n_heads, getattr(module, "n_kv_heads", 0), module.head_dim]

    agree_on(mesh.get_group(), "shard_heads", check, 5, "(kind, d_model, n_heads, n_kv_heads, head_dim)")


def _check_module(module, mesh) -> None:
    if isinstance(module, _HeadSharded):
        raise ValueError("this module is already sharded by shard_heads")
    if not isinstance(module, (Attention, LatentAttention)):
        # Not the head_access protocol: sharding swaps in a subclass that overrides these two
        # classes' own methods (new_cache, ALiBi's slopes, the latent), so another variant is refused.
        raise TypeError(f"shard_heads takes a multihead Attention or LatentAttention (subclasses included); "
                        f"received {type(module).__name__}")
    P, H = mesh.size(), module.n_heads
    check_divisible("n_heads", H, "the number of ranks", P)
    device = next(module.parameters()).device
    if device.type != mesh.device_type:
        raise ValueError(f"the module is on {device.type} but the mesh is for {mesh.device_type}; "
                         f"move the module first (module.to(...))")
    if isinstance(module, Attention):
        Hkv = module.n_kv_heads
        valid = ", ".join(str(p) for p in range(1, H + 1) if H % p == 0 and (Hkv % p == 0 or p % Hkv == 0))
        # not `check_divisible`: either way round works (P < Hkv shares heads, P > Hkv replicates them)
        if Hkv % P and P % Hkv:
            raise ValueError(f"n_kv_heads ({Hkv}) must be divisible by the number of ranks ({P}), or divide "
                             f"it (then each KV head is replicated on P / Hkv ranks); valid: {valid}")


def shard_heads(module: Attention | LatentAttention, mesh) -> Attention | LatentAttention:
    """Split the heads of `module` across the ranks of a 1-D `DeviceMesh`, in place.

    Rank r computes query heads r*H/P .. (r+1)*H/P - 1 and the KV heads they read
    (Hkv/P of them, or one shared KV head when Hkv < P: see the module docstring).
    Input and output stay `(B, T, C)` and replicated on every rank; forward, backward
    and cached decoding equal the unsharded module's. `new_cache` gives a cache of the
    local KV heads (MLA: the whole latent, replicated). Weights are taken from mesh
    rank 0 (torch's `distribute_tensor`). `return_weights` returns the local heads'
    weights, indexed locally.

    Returns the module (its class is now a `HeadSharded...` subclass of the original).
    """
    _check(module, mesh)
    from torch.distributed.tensor.parallel import (  # heavy: imported on use
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    P, r = mesh.size(), mesh.get_local_rank()
    H = module.n_heads
    h = H // P
    if isinstance(module, Attention):
        Hkv = module.n_kv_heads
        plan = {"q_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
        if Hkv >= P:
            plan.update(k_proj=ColwiseParallel(), v_proj=ColwiseParallel())
            kv = (r * Hkv // P, Hkv // P)
        else:
            kv = (r // (P // Hkv), 1)
            rows = slice(kv[0] * module.head_dim, (kv[0] + 1) * module.head_dim)
            _broadcast([module.k_proj, module.v_proj], mesh)  # rank 0's weights, as distribute_tensor
            module.k_proj = _SharedKVHeads(module.k_proj, rows, mesh.get_group())
            module.v_proj = _SharedKVHeads(module.v_proj, rows, mesh.get_group())
        parallelize_module(module, mesh, plan)
        _swap_class(module, _ShardedAttention)
    else:
        q_name = "q_proj" if module.q_rank is None else "q_b_proj"
        parallelize_module(module, mesh, {q_name: ColwiseParallel(), "o_proj": RowwiseParallel()})
        # kv_b_proj keeps plain local rows (not a DTensor): the absorbed path reads its
        # weight directly, and the latent's gradient is summed once in `latents`.
        width = module.head_dim + module.v_head_dim
        _broadcast([module.kv_b_proj], mesh)  # rank 0's weights, as distribute_tensor
        with torch.no_grad():
            w = module.kv_b_proj.weight
            local = w[r * h * width:(r + 1) * h * width].clone()  # (h * (D + Dv), R)
        module.kv_b_proj.weight = nn.Parameter(local, requires_grad=w.requires_grad)
        module.kv_b_proj.out_features = local.shape[0]
        # The replicated parts must start equal too.
        _broadcast([module.kv_a_proj, module.kv_a_norm]
                   + ([] if module.q_rank is None else [module.q_a_proj, module.q_a_norm]), mesh)
        kv = (0, 1)
        _swap_class(module, _ShardedLatent)
    module.tp_mesh = mesh
    module.tp_heads = (r * h, h)
    module.tp_kv_heads = kv
    return module
