"""Cutting a sequence into per-rank shards and putting it back together.

`layout="contiguous"` gives rank r the r-th of P equal pieces. `layout="zigzag"` cuts
the sequence into 2P chunks and gives rank r chunks r and 2P-1-r: under a causal mask
a early chunk has little to attend to and a late one much, so pairing them gives every
rank the same work (Brandon et al., 2023, "Striped Attention"; the zigzag form is the
one used by ring-flash-attention and Megatron's context parallelism).

Both functions are differentiable with DTensor's meaning: sharding a tensor that is
the same on every rank is a local slice whose gradient is gathered; gathering gives
every rank the whole tensor, whose gradient each rank takes its own slice of.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.checks import check_divisible, check_int
from multihead.distributed._group import (
    GroupRef,
    agree_on,
    check_device,
    check_layout,
    chunk_ids,
    dtype_code,
    layout_code,
    resolve_group,
)

__all__ = ["gather_sequence", "shard_sequence"]

_MAX_DIMS = 8  # of a tensor gather_sequence describes to the other ranks (a fixed-length signature)


def _check_dim(x, dim) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor; received {type(x).__name__}")
    return check_int(f"dim of a {x.dim()}-D tensor", dim, minimum=-x.dim(), maximum=x.dim() - 1) % x.dim()


def _local(x: Tensor, dim: int, rank: int, size: int, layout: str) -> Tensor:
    """This rank's shard of the whole `x` along `dim` (a view for contiguous, a copy for zigzag)."""
    n = len(chunk_ids(rank, size, layout)) * size
    pieces = x.chunk(n, dim=dim)
    mine = [pieces[c] for c in chunk_ids(rank, size, layout)]
    return mine[0] if len(mine) == 1 else torch.cat(mine, dim=dim)


def _whole(x: Tensor, dim: int, group, size: int, layout: str) -> Tensor:
    """All ranks' shards in global order along `dim`."""
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    halves = [s.chunk(2, dim=dim) for s in shards]  # rank r: (chunk r, chunk 2P-1-r)
    order = [halves[c][0] if c < size else halves[2 * size - 1 - c][1] for c in range(2 * size)]
    return torch.cat(order, dim=dim)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, rank, size, layout):
        ctx.args = (dim, GroupRef(group), rank, size, layout)  # the graph holds no group
        return _local(x, dim, rank, size, layout).clone()

    @staticmethod
    def backward(ctx, grad):
        dim, group, _, size, layout = ctx.args
        return _whole(grad, dim, group.get(), size, layout), None, None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, rank, size, layout):
        ctx.args = (dim, None, rank, size, layout)
        return _whole(x, dim, group, size, layout)

    @staticmethod
    def backward(ctx, grad):
        dim, _, rank, size, layout = ctx.args
        return _local(grad, dim, rank, size, layout).contiguous(), None, None, None, None, None


def shard_sequence(x: Tensor, dim: int, layout: str = "contiguous", group=None) -> Tensor:
    """This rank's shard of `x` (the whole sequence, the same on every rank) along `dim`.

    The length along `dim` must divide into P pieces (contiguous) or 2P chunks (zigzag).
    The result is what `ring_attention` and `context_parallel` expect, and
    `gather_sequence(shard, dim, layout)` gives `x` back.
    """
    group = resolve_group(group, "shard_sequence")
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def check():
        check_layout(layout)
        d = _check_dim(x, dim)
        pieces = size * (2 if layout == "zigzag" else 1)
        error = check_device(group, x, "x")
        if error:
            raise ValueError(error)
        check_divisible(f"the length along dim {d}", x.shape[d],
                        "2P" if layout == "zigzag" else "the number of ranks P", pieces)
        return [d, x.dim(), x.shape[d], layout_code(layout)]

    dim = agree_on(group, "shard_sequence", check, 4, "(dim, ndim, length, layout)")[0]
    return _Shard.apply(x, dim, group, rank, size, layout)


def gather_sequence(x: Tensor, dim: int, layout: str = "contiguous", group=None) -> Tensor:
    """The whole sequence from every rank's shard `x` (the inverse of `shard_sequence`)."""
    group = resolve_group(group, "gather_sequence")
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def check():
        check_layout(layout)
        d = _check_dim(x, dim)
        if x.dim() > _MAX_DIMS:
            raise ValueError(f"x may have at most {_MAX_DIMS} dims; received shape {tuple(x.shape)}")
        error = check_device(group, x, "x")
        if error:
            raise ValueError(error)
        if layout == "zigzag" and x.shape[d] % 2:
            raise ValueError(f"a zigzag shard holds two equal chunks; received odd length {x.shape[d]} along dim {d}")
        return [d, dtype_code(x.dtype), layout_code(layout), x.dim(), *x.shape, *[0] * (_MAX_DIMS - x.dim())]

    dim = agree_on(group, "gather_sequence", check, 4 + _MAX_DIMS, "(dim, dtype, layout, ndim, shape)")[0]
    return _Gather.apply(x, dim, group, rank, size, layout)
