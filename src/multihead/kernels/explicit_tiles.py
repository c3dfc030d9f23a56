"""The explicit tile engine: any score mod (softcap) and dropout, tile by tile with an
online softmax (FlashAttention-2, Dao 2023). A custom autograd Function saves only q, k, v,
the output and the per-row log-sum-exp, and its backward recomputes each kept tile's
probabilities from the log-sum-exp (and returns the gradient of a float mask that requires
grad); dropout keeps are regenerated from a per-tile seed. Training memory: O(N) plus one
tile. Under create_graph=True the backward is the forward written with differentiable ops
(`twice`), so second derivatives are exact. GQA never copies K/V: the G query heads
sharing a K/V head are folded into the query rows, `(B, H, t, D) -> (B, Hkv, G*t, D)`."""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.kernels.common import (
    acc_dtype,
    backward_lse,
    fold_values,
    index,
    masked_scores,
    online_result,
    online_softmax,
    probs_from_lse,
    softmax,
)
from multihead.kernels.machine import machine_plan
from multihead.kernels.planner import combine, slice_dense, tile_plan, tile_sizes

__all__ = ["EXPLICIT_TILE", "Tiles", "default_tile", "explicit", "needs_grad", "refuse_trainable", "twice"]

# None: the machine's edge (`MachinePlan.explicit_tile`: 256 on a 2 MiB L2, the fastest edge for
# softcap at length there, its (B, H, t, t) temporaries staying in cache). An int here overrides it.
EXPLICIT_TILE: int | None = None


def default_tile() -> int:
    """The explicit engine's tile edge: `EXPLICIT_TILE`, else the machine plan's."""
    return machine_plan().explicit_tile if EXPLICIT_TILE is None else EXPLICIT_TILE


def refuse_trainable(score_mod, q: Tensor, S: int, engine: str) -> None:
    """Raise when autograd records the call and the mod captures tensors that require grad
    (a learned bias, ALiBi slopes being trained), or cannot be probed for them: `engine`
    (which applies the mod outside autograd) would silently leave them without a gradient."""
    if not torch.is_grad_enabled():
        return
    trainable = score_mod.trainable(q.device, q.shape, S)
    if trainable is False:
        return
    why = "holds tensors that require grad" if trainable else \
        "raised on a probe of its first 2 x 2 scores, so whether it holds tensors that require grad is unknown"
    raise ValueError(f"score mod {score_mod.name} {why}; {engine} would not train them; backends that can: "
                     f"'chunked', 'math' (what 'auto' picks for such a mod)")


def needs_grad(dense: Tensor | None) -> bool:
    """A float mask autograd must differentiate (a learned bias), in a call that records grads."""
    return dense is not None and dense.is_floating_point() and dense.requires_grad and torch.is_grad_enabled()


def twice(needs, saved, d_out, recompute):
    """The backward when autograd records it (create_graph=True: a gradient penalty, double
    backward): the attention recomputed with differentiable ops (`Tiles.recompute`) from the
    saved inputs, and its gradient taken with the graph, so the second-order terms are exact.
    The fast backwards write into buffers with no graph, which would drop them silently.

    `needs[i]`: whether `saved[i]` (q, k, v, then a float mask) wants a gradient. Each slot is
    recomputed from an alias of its own (a view, no copy) and differentiated with respect to
    that alias: the partial derivative of that slot alone, which autograd then sums over the
    slots a tensor fills. Differentiating with respect to the saved tensors themselves would
    give a tensor in several slots its total derivative once per slot (3x for q is k is v, 2x
    for k is v), and a slot computed from another (k a view of q, MLA's v = k[..., :R]) the
    other's partial as well. The aliases keep the graph to the saved inputs, so the gradient
    stays differentiable."""
    wanted = [i for i, x in enumerate(saved) if x is not None and needs[i]]
    slots = [None if x is None else x.view_as(x) for x in saved]
    out = recompute(*slots)
    if not out.requires_grad:  # every row empty: no gradient anywhere
        return [None] * len(saved)
    grads = torch.autograd.grad(out, [slots[i] for i in wanted], d_out, create_graph=True, allow_unused=True)
    result = [None] * len(saved)
    for i, g in zip(wanted, grads):
        result[i] = g
    return result


class Tiles:
    """What both directions of the explicit engine share: shapes, the plan, tile buffers.

    Queries are folded as in the fused engine, `(B*Hkv, G*t, D)`, so a tile's scores are one
    batched matmul `(B*Hkv, G*t, s)`, seen as `(B, H, t, s)` by masks and score mods. The
    tile temporaries live in buffers allocated once per call: a fresh multi-MiB tensor per
    tile costs page faults that matter as much as the arithmetic (measured 2x on q k^T).
    """

    def __init__(self, q, k, v, pred, dense, score_mod, scale, dropout_p, tile, seed):
        self.B, self.H, self.T, self.D = q.shape
        self.Hkv, self.S, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = self.H // self.Hkv
        self.pred, self.dense, self.score_mod = pred, dense, score_mod
        self.scale, self.dropout_p, self.seed = scale, dropout_p, seed
        self.bq, self.bk = tile_sizes(self.T, self.S, tile)
        if self.bq < tile:  # few queries (decoding): longer key tiles of the same area, fewer steps
            self.bk = min(self.S, tile * tile // self.bq)
        self.kept, self.full = tile_plan(pred, self.B, self.H, self.T, self.S, self.bq, self.bk, q.device)
        self.acc = acc_dtype(q.dtype)
        self.device = q.device
        # a mod with an in-place form takes its scores times `input_scale`, folded into q
        self.inplace = score_mod is not None and score_mod.inplace is not None
        self.q_scale = scale * (score_mod.input_scale if self.inplace else 1.0)
        self._buffers = {}

    def tiles(self):
        """(i, r0, r1, [(j, c0, c1, full), ...]) for every query block."""
        nq, nk = self.kept.shape
        for i in range(nq):
            r0, r1 = i * self.bq, min(self.T, (i + 1) * self.bq)
            cols = [(j, j * self.bk, min(self.S, (j + 1) * self.bk), bool(self.full[i, j]))
                    for j in range(nk) if self.kept[i, j]]
            yield i, r0, r1, cols

    def buffer(self, name: str, t: int, s: int) -> Tensor:
        """A `(B*Hkv, G*t, s)` scratch tensor, reusing one allocation per name."""
        n = self.B * self.H * t * s
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n:
            buf = self._buffers[name] = torch.empty(self.B * self.H * self.bq * max(self.bk, self.Dv),
                                                    dtype=self.acc, device=self.device)
        return buf[:n].view(self.B * self.Hkv, self.G * t, s)

    def fold_q(self, x: Tensor, r0: int, r1: int, times: float = 1.0) -> Tensor:
        """Rows r0..r1 of a `(B, H, T, X)` tensor as `(B*Hkv, G*t, X)` in the accumulation dtype."""
        x = x[:, :, r0:r1].to(self.acc)
        x = x * times if times != 1.0 else x
        return x.reshape(self.B * self.Hkv, self.G * (r1 - r0), x.shape[-1])

    def kv(self, x: Tensor, c0: int, c1: int) -> Tensor:
        """Keys c0..c1 of a `(B, Hkv, S, X)` tensor as `(B*Hkv, s, X)` (a view when x is acc-typed)."""
        return x[:, :, c0:c1].to(self.acc).reshape(self.B * self.Hkv, c1 - c0, x.shape[-1])

    def indices(self, r0, r1, c0, c1):
        return (index(self.B, 0, self.device), index(self.H, 1, self.device),
                index(r1 - r0, 2, self.device, r0), index(c1 - c0, 3, self.device, c0))

    def modded(self, s: Tensor, r0, r1, c0, c1) -> Tensor:
        """The score mod on a tile of `(B, H, t, s)` raw scores (times q_scale / scale): in place
        when the mod has an in-place form, else a new tensor (autograd may record it)."""
        if self.score_mod is None:
            return s
        if self.inplace and not s.requires_grad:
            return self.score_mod.inplace(s)
        return self.score_mod.apply(s, *self.indices(r0, r1, c0, c1), self.S - self.T)

    def dense_tile(self, r0, r1, c0, c1, dense: Tensor | None = None) -> Tensor | None:
        dense = self.dense if dense is None else dense
        return None if dense is None else slice_dense(dense, r0, r1, c0, c1)

    def recompute(self, q: Tensor, k: Tensor, v: Tensor, dense: Tensor | None) -> Tensor:
        """The forward written with differentiable ops, one query block of kept tiles at a time
        (memory: one block's scores), the same dropout keeps: what autograd differentiates
        twice (see `twice`). The fast paths never run it."""
        B, H, Dv, acc = self.B, self.H, self.Dv, self.acc
        outs = []
        for i, r0, r1, cols in self.tiles():
            t = r1 - r0
            if not cols:
                outs.append(q.new_zeros(B, H, t, Dv))
                continue
            # scores as the fast paths compute them, one bmm per tile on the folded block: through
            # common.fold_scores (a reshape per tile) the second derivatives round differently (1 ulp)
            qf = self.fold_q(q, r0, r1)  # (B*Hkv, G*t, D)
            parts = []
            for _, c0, c1, full in cols:
                x = torch.bmm(qf, self.kv(k, c0, c1).mT).view(B, H, t, c1 - c0) * self.scale
                if self.score_mod is not None:
                    x = self.score_mod.apply(x, *self.indices(r0, r1, c0, c1), self.S - self.T)
                d = self.dense_tile(r0, r1, c0, c1, dense)
                bias = d.to(acc) if d is not None and d.dtype != torch.bool else None
                parts.append(masked_scores(x, self.allowed(r0, r1, c0, c1, full), bias))
            x = torch.cat(parts, -1)  # (B, H, t, kept keys)
            p = softmax(x, hidden=True)  # the hidden pairs are -inf already; nothing to attend: zeros, not NaN
            if self.dropout_p > 0:
                p = p * torch.cat([self.keep(i, j, torch.empty(B, H, t, c1 - c0, dtype=acc, device=self.device))
                                   for j, c0, c1, _ in cols], -1)
            vs = torch.cat([v[:, :, c0:c1] for _, c0, c1, _ in cols], 2)  # (B, Hkv, kept keys, Dv)
            outs.append(fold_values(p, vs).to(q.dtype))  # (B, H, t, Dv)
        return torch.cat(outs, 2)

    def allowed(self, r0, r1, c0, c1, full) -> Tensor | None:
        """Bool `(.., t, s)`, True where the mask lets a pair of the tile attend; None: every pair."""
        ok = None
        d = self.dense_tile(r0, r1, c0, c1)
        if d is not None and d.dtype == torch.bool:
            ok = d
        if self.pred is not None and not full:
            allowed = self.pred.evaluate(*self.indices(r0, r1, c0, c1), self.S - self.T)
            ok = allowed if ok is None else ok & allowed
        return ok

    def keep(self, i, j, out: Tensor) -> Tensor:
        """Tile (i, j)'s dropout keep-mask as 0 or 1 / (1 - p), written into `out`; the same
        in forward and backward (a generator seeded per tile)."""
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 1_000_003 + i * 65_537 + j) % (2 ** 63))
        torch.rand(out.shape, generator=g, device=self.device, dtype=out.dtype, out=out)
        return out.ge_(self.dropout_p).mul_(1.0 / (1.0 - self.dropout_p))


class _ExplicitTiles(torch.autograd.Function):
    """Online-softmax forward over kept tiles; backward recomputes tiles from the LSE."""

    @staticmethod
    def forward(ctx, q, k, v, dense, tiles: Tiles):
        """`dense`: the float mask when it requires grad (its gradient is returned), else None."""
        B, H, T, Dv, G, Hkv = tiles.B, tiles.H, tiles.T, tiles.Dv, tiles.G, tiles.Hkv
        acc = tiles.acc
        out = q.new_zeros(B, H, T, Dv)
        lse = torch.full((B, H, T), float("-inf"), dtype=acc, device=q.device)
        with torch.no_grad():
            for i, r0, r1, cols in tiles.tiles():
                if not cols:
                    continue
                t = r1 - r0
                qf = tiles.fold_q(q, r0, r1, tiles.q_scale)  # (B*Hkv, G*t, D)
                m = torch.full((B, H, t, 1), float("-inf"), dtype=acc, device=q.device)
                l_ = torch.zeros(B, H, t, 1, dtype=acc, device=q.device)
                o = torch.zeros(B * Hkv, G * t, Dv, dtype=acc, device=q.device)
                for j, c0, c1, full in cols:
                    s_ = c1 - c0
                    s = torch.bmm(qf, tiles.kv(k, c0, c1).mT, out=tiles.buffer("s", t, s_))  # (B*Hkv, G*t, s)
                    s4 = tiles.modded(s.view(B, H, t, s_), r0, r1, c0, c1)  # (B, H, t, s)
                    d = tiles.dense_tile(r0, r1, c0, c1)
                    bias = d.to(acc) if d is not None and d.dtype != torch.bool else None
                    s4 = masked_scores(s4, tiles.allowed(r0, r1, c0, c1, full), bias, inplace=True)
                    p, alpha, m, l_ = online_softmax(s4, m, l_)  # p: s4's buffer, exp(s4 - the new max)
                    if tiles.dropout_p > 0:
                        p = p.mul_(tiles.keep(i, j, tiles.buffer("r", t, s_).view(B, H, t, s_)))
                    pv = torch.bmm(p.view(B * Hkv, G * t, s_), tiles.kv(v, c0, c1), out=tiles.buffer("pv", t, Dv))
                    o = o.view(B, H, t, Dv).mul_(alpha).add_(pv.view(B, H, t, Dv))
                o, lse[:, :, r0:r1] = online_result(o.view(B, H, t, Dv), m, l_)
                out[:, :, r0:r1] = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, dense)
        ctx.tiles = tiles
        return out

    @staticmethod
    def backward(ctx, d_out):
        """Per tile (FlashAttention-2): z = mod(q k^T * scale), P = exp(z + bias - lse) on the
        allowed pairs, dV += P_drop^T dO, dS = P (dP - rowsum(dO O)) with dP = (dO V^T) * keep,
        dS *= dz/dx (the mod's derivative), dQ += dS K * scale, dK += dS^T Q * scale."""
        q, k, v, out, lse, dense = ctx.saved_tensors
        tiles: Tiles = ctx.tiles
        if torch.is_grad_enabled():  # create_graph: differentiable recomputation (see `twice`)
            return (*twice(ctx.needs_input_grad, (q, k, v, dense), d_out, tiles.recompute), None)
        B, H, G, Hkv, Dv = tiles.B, tiles.H, tiles.G, tiles.Hkv, tiles.Dv
        acc, mod = tiles.acc, tiles.score_mod
        d_dense = None if dense is None else torch.zeros(dense.shape, dtype=acc, device=q.device)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        delta = (d_out.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # (B, H, T, 1): rowsum(dO * O)
        for i, r0, r1, cols in tiles.tiles():
            if not cols:
                continue
            t = r1 - r0
            qf = tiles.fold_q(q, r0, r1, tiles.q_scale)  # (B*Hkv, G*t, D), as in the forward
            q_raw = tiles.fold_q(q, r0, r1)
            do = tiles.fold_q(d_out, r0, r1)  # (B*Hkv, G*t, Dv)
            dq_i = torch.zeros_like(q_raw)
            lse_i = backward_lse(lse[:, :, r0:r1, None])  # empty rows: p = 0
            delta_i = delta[:, :, r0:r1]
            for j, c0, c1, full in cols:
                s_ = c1 - c0
                kj, vj = tiles.kv(k, c0, c1), tiles.kv(v, c0, c1)
                x = torch.bmm(qf, kj.mT, out=tiles.buffer("s", t, s_)).view(B, H, t, s_)
                if mod is not None and not tiles.inplace:
                    x = x.clone().requires_grad_()  # a mod without a derivative: autograd's, on this tile
                    with torch.enable_grad():
                        z = tiles.modded(x, r0, r1, c0, c1)
                else:
                    z = tiles.modded(x, r0, r1, c0, c1)
                p = tiles.buffer("p", t, s_).view(B, H, t, s_)
                d = tiles.dense_tile(r0, r1, c0, c1)
                x_ = torch.add(z.detach(), d.to(acc), out=p) if d is not None and d.dtype != torch.bool else z.detach()
                p = probs_from_lse(x_, lse_i, out=p)  # the forward's probabilities
                ok = tiles.allowed(r0, r1, c0, c1, full)
                if ok is not None:
                    p = p.masked_fill_(~ok, 0.0)
                dp = torch.bmm(do, vj.mT, out=tiles.buffer("dp", t, s_)).view(B, H, t, s_)
                p_drop = p
                if tiles.dropout_p > 0:
                    keep = tiles.keep(i, j, tiles.buffer("r", t, s_).view(B, H, t, s_))
                    dp = dp.mul_(keep)
                    p_drop = keep.mul_(p)
                dv[:, :, c0:c1].view(B * Hkv, s_, Dv).baddbmm_(p_drop.view(B * Hkv, G * t, s_).mT, do)
                ds = dp.sub_(delta_i).mul_(p)  # (B, H, t, s): d loss / d z, and / d of the float mask
                if d_dense is not None:  # summed over the dims the mask broadcasts along
                    dims = [a for a in range(4) if dense.shape[a] == 1 and ds.shape[a] != 1]
                    g = ds.sum(dims, keepdim=True) if dims else ds
                    slice_dense(d_dense, r0, r1, c0, c1).add_(g)
                if mod is not None and tiles.inplace:
                    ds = mod.inplace_grad(z, ds)  # dz/dx from z (overwritten)
                elif mod is not None:
                    ds = torch.autograd.grad(z, x, ds)[0]
                ds = ds.reshape(B * Hkv, G * t, s_)
                dq_i.baddbmm_(ds, kj, alpha=tiles.scale)
                dk[:, :, c0:c1].view(B * Hkv, s_, -1).baddbmm_(ds.mT, q_raw, alpha=tiles.scale)
            dq[:, :, r0:r1] = dq_i.view(B, H, t, -1)
        d_dense = None if d_dense is None else d_dense.to(dense.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_dense, None


def explicit(q: Tensor, k: Tensor, v: Tensor, mask, *, causal: bool, scale: float, dropout_p: float,
             score_mod=None, tile: int | None = None) -> Tensor:
    """softmax(score_mod(q k^T * scale) + mask) v over kept tiles, O(N) memory in training."""
    if score_mod is not None:
        refuse_trainable(score_mod, q, k.shape[2], "the 'tiles' backend's recomputing backward")
    pred, dense = combine(mask, causal)
    seed = int(torch.randint(0, 2 ** 62, (1,)).item()) if dropout_p > 0 else 0
    tiles = Tiles(q, k, v, pred, dense, score_mod, scale, dropout_p, tile or default_tile(), seed)
    return _ExplicitTiles.apply(q, k, v, dense if needs_grad(dense) else None, tiles)
