"""The residual-decomposed forward behind `edge_patch`, `edge_scores` and `faithfulness_curve`.

Every receiver reads its own copy of the residual stream. In a patched run, receiver r's
copy is built from one of two bases, whichever needs fewer terms: the corrupted run's
residual at r plus the kept senders' differences, or this run's residual minus the
non-kept senders' differences, where a sender's difference is its output in this run
minus its output in the reference run (the corrupted inputs, or the mean over reference
inputs). Both are a `(receivers, senders)` matrix times the stack of differences, one
matmul per receiver group. Keeping no edge leaves every copy equal to the corrupted run's
residual and keeping all edges equal to this run's: the two ends are the corrupted and
the clean forward themselves, not sums that round differently.

Heads are batched: a layer's query receivers are one `(H, B, T, C)` tensor normalized and
projected head by head in one einsum (its own slice of the projection each), the KV
receivers likewise per KV head (GQA: a query head reads KV head h // G).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.heads._edge_model import Block, EdgeModel
from multihead.heads.metrics import AtPositions
from multihead.kernels.common import cap_scores, eager

GroupHook = Callable[[int, Tensor], None]  # (receiver group, its copies (n, B, T, C)) in a gradient run


@dataclass
class Plan:
    """Per receiver group (`group_slices`' order: per layer its attention receivers and its MLP; the logits):
    `coef` `(n, prefix)` over the senders' differences (None: no term) and `corrupted_base`
    `(n,)`, or None where the group reads this run's residual unchanged."""

    groups: list[tuple[Tensor | None, Tensor] | None]


@dataclass
class Reference:
    """The run the non-kept edges read: every sender's output `(N_s, B, T, C)` (or `(N_s, 1, 1, C)`
    for a mean) and the residual each receiver group read `[(B, T, C)]`, one per group."""

    out: Tensor
    resid: list[Tensor]


def group_slices(em: EdgeModel) -> list[tuple[int, int, int]]:
    """Per receiver group (layer by layer: its attention receivers, its MLP where it has one; then the
    logits): (first receiver, receivers, senders read)."""
    g, out, r = em.graph, [], 0
    n_attn = g.n_heads + 2 * g.n_kv_heads
    for layer in range(g.n_layers):
        out.append((r, n_attn, g.first_sender(layer)))
        if g.mlp:
            out.append((r + n_attn, 1, g.first_sender(layer) + g.n_heads))
        r += g.per_layer
    return out + [(r, 1, len(g.senders))]


def make_plan(em: EdgeModel, keep: Tensor) -> Plan:
    """A plan from a kept-edge mask `(N_r, N_s)` (only each receiver's prefix is read)."""
    groups: list = []
    dtype, device = em.dtype, em.device
    for r0, n, p in group_slices(em):
        k = keep[r0:r0 + n, :p]
        if bool(k.all()):
            groups.append(None)
            continue
        corrupted_base = k.sum(1) * 2 <= p  # the fewer terms: the kept senders on the corrupted base
        coef = torch.where(corrupted_base[:, None], k.to(dtype), -(~k).to(dtype))
        # no term at all (nothing kept on the corrupted base): the copy is the corrupted residual itself
        nothing = bool(corrupted_base.all()) and not bool(k.any())
        groups.append((None if nothing else coef.to(device), corrupted_base.to(device)))
    return Plan(groups)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def allowed_keys(T: int, mask: Tensor | None, window: int | None, device) -> Tensor:
    """(B or 1, 1, T, S) True where a query may attend: causal, the key not padding, within the window."""
    i = torch.arange(T, device=device)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok = ok & (i[:, None] - i[None, :] < window)
    ok = ok[None, None]
    return ok if mask is None else ok & mask[:, None, None, :]


class Run:
    """One forward of the decomposed model over one chunk of rows."""

    def __init__(self, em: EdgeModel, mask: Tensor | None, T: int, plan: Plan | None = None,
                 ref: Reference | None = None, record: bool = False, hook: GroupHook | None = None):
        self.em, self.plan, self.ref, self.hook = em, plan, ref, hook
        self.mask, self.T = mask, T
        self.record = record or plan is not None
        self.stack: Tensor | None = None  # this run's outputs (record) or differences from ref (plan)
        self.resid: list[Tensor] = []
        self.ropes: dict = {}  # layer type -> (cos, sin) (1, T, D)

    def _store(self, i: int, out: Tensor) -> None:
        if not self.record:
            return
        out = out.detach()  # a gradient run records values, not a graph
        if self.plan is not None:
            self.stack[i:i + out.shape[0]] = out - self.ref.out[i:i + out.shape[0]]
        else:
            self.stack[i:i + out.shape[0]] = out

    def _copies(self, group: int, n: int, p: int, resid: Tensor) -> tuple[Tensor, Tensor | None]:
        """The receivers' copies of the residual `(n, B, T, C)`, and the one `(B, T, C)` residual they
        all are where no receiver reads its own (None where one does, and in a gradient run, where
        each copy must be a node of its own for its gradient)."""
        entry = None if self.plan is None else self.plan.groups[group]
        shared = None
        if entry is None:
            x, shared = resid.unsqueeze(0).expand(n, *resid.shape), resid
        else:
            coef, corrupted_base = entry
            if coef is None:  # every copy is the reference's residual
                shared = self.ref.resid[group]
                x = shared.expand(n, *resid.shape)
            else:
                base = torch.where(corrupted_base[:, None, None, None], self.ref.resid[group], resid)
                x = base + (coef @ self.stack[:p].flatten(1)).view(n, *resid.shape)
        if self.record and self.plan is None:
            self.resid.append(resid)
        if self.hook is not None:
            self.hook(group, x)
            shared = None
        return x, shared

    def forward(self, emb: Tensor) -> Tensor:
        """The final residual (the logits receiver's copy) `(B, T, C)` from the input embedding."""
        em, g = self.em, self.em.graph
        B, T, C = emb.shape
        if self.record:
            self.stack = emb.new_empty(len(g.senders), B, T, C)
        self._store(0, emb[None])
        self.emb = emb
        resid = emb
        slices = group_slices(em)
        group = 0
        for block in em.blocks:
            r0, n, p = slices[group]
            x, shared = self._copies(group, n, p, resid)
            group += 1
            heads = self._attention(block, x, shared)  # (H, B, T, C)
            if block.post_norm is not None:  # each head's share of the normed sum (see edge_graph)
                heads = block.post_norm(heads)
            self._store(p, heads)
            resid = resid + heads.sum(0) + (0 if block.bo is None else block.bo)
            if block.mlp is None:  # an attention-only model
                continue
            r0, n, p = slices[group]
            x, _ = self._copies(group, 1, p, resid)
            group += 1
            out = block.mlp(block.ln2(x[0]))
            self._store(p, out[None])
            resid = resid + out
        r0, n, p = slices[group]
        return self._copies(group, 1, p, resid)[0][0]

    def _rope(self, b: Block):
        if self.em.rotary is None:
            return None
        if b.rope_type not in self.ropes:
            pos = torch.arange(self.T, device=self.emb.device)[None]
            self.ropes[b.rope_type] = self.em.rotary(self.emb, pos, b.rope_type)
        return self.ropes[b.rope_type]

    def _attention(self, b: Block, x: Tensor, shared: Tensor | None) -> Tensor:
        """Each query head's output `(H, B, T, C)` from the receivers' copies `(H + 2 Hkv, B, T, C)`
        (or the one residual `shared` they all are: normed once, each projection one matmul)."""
        H, Hkv = b.n_heads, b.n_kv_heads
        n = b.ln1(x) if shared is None else b.ln1(shared)
        if b.project is not None:  # latent attention: its queries, keys and values, RoPE included
            if shared is not None:
                n = n.unsqueeze(0).expand(x.shape)
            q, k, v = b.project(n[:H], n[H:H + Hkv], n[H + Hkv:])
            z, _ = eager(q, k, v, b.scaling, allowed_keys(q.shape[2], self.mask, b.window, q.device), cap=b.softcap)
            return torch.einsum("bhtd,hcd->hbtc", z, b.wo)  # z (B, H, T, Dv)
        if shared is not None:
            q = torch.einsum("btc,hdc->bhtd", n, b.wq)
            k = torch.einsum("btc,gdc->bgtd", n, b.wk)
            v = torch.einsum("btc,gdc->bgtd", n, b.wv)
        else:
            q = torch.einsum("hbtc,hdc->bhtd", n[:H], b.wq)
            k = torch.einsum("gbtc,gdc->bgtd", n[H:H + Hkv], b.wk)
            v = torch.einsum("gbtc,gdc->bgtd", n[H + Hkv:], b.wv)
        if b.bq is not None:
            q, k, v = q + b.bq[None, :, None], k + b.bk[None, :, None], v + b.bv[None, :, None]
        if b.q_norm is not None:
            q, k = b.q_norm(q), b.k_norm(k)
        if b.rotate is not None:  # the layer's own RoPE module (multihead's decoder)
            q, k = b.rotate(q, k)
        elif (rope := self._rope(b)) is not None:
            cos, sin = (t.unsqueeze(1) for t in rope)  # (1, 1, T, D)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # the formula itself (scores in float32 at least, as transformers' eager softmax); a row
        # that may attend to no key (left padding) gives zeros, never NaN
        z, _ = eager(q, k, v, b.scaling, allowed_keys(q.shape[2], self.mask, b.window, q.device), cap=b.softcap)
        return torch.einsum("bhtd,hcd->hbtc", z, b.wo)  # z (B, H, T, Dv)


class Readout:
    """What the metric reads from the final residual: the logits at its positions (an
    `AtPositions`, `(B, V)`), else all of them `(B, T, V)`."""

    def __init__(self, em: EdgeModel, metric, T: int):
        self.em, self.metric = em, metric
        self.positions = metric.absolute(T) if isinstance(metric, AtPositions) else None

    def logits(self, x: Tensor, rows: slice) -> Tensor:
        if self.positions is not None:
            pos = self.positions[rows].to(x.device)
            x = x[torch.arange(x.shape[0], device=x.device), pos]  # (B, C)
        out = self.em.final_norm(x) @ self.em.unembed.t()
        out = out if self.em.unembed_bias is None else out + self.em.unembed_bias
        cap = self.em.final_softcap
        return out if cap is None else cap_scores(out, cap)

    def value(self, logits: Tensor):
        """The metric of the whole batch's readout, unchecked."""
        if self.positions is not None:
            return self.metric.fn(logits)
        return self.metric(logits)


def scalar(value, where: str, grad: bool = False) -> Tensor | float:
    """The metric's value as a float (or the 0-d tensor, for a gradient); errors name what came back."""
    if value is None:
        raise TypeError(f"the metric returned None {where}; it must return a scalar (a 0-d tensor or a number)")
    if isinstance(value, Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"the metric returned a {value.dtype} tensor {where}; it must return a real scalar "
                            "(a 0-d float tensor or a number)")
        if value.numel() != 1:
            raise ValueError(f"the metric returned a tensor of shape {tuple(value.shape)} {where}; it must return "
                             "a scalar (reduce over the batch, e.g. .mean())")
        if grad and not value.requires_grad:
            raise ValueError(f"the metric's value {where} does not depend on the logits it was given (no gradient); "
                             "edge scores need a metric computed from them with torch operations")
        return value.reshape(()) if grad else float(value)
    if grad:
        raise TypeError(f"the metric returned {type(value).__name__} {where}; edge scores need a 0-d tensor "
                        "computed from the logits (gradients flow through it)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the metric returned {type(value).__name__} {where}; it must return a scalar")
    return float(value)
