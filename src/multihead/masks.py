"""Attention masks as predicates, the way torch.nn.attention.flex_attention writes them.

A mask is a function `mask_mod(b, h, q_idx, kv_idx) -> bool tensor`, True where query
`q_idx` of batch `b`, head `h` may attend key `kv_idx`. Predicates combine with `&`,
`|` (or `and_masks` / `or_masks`) and are evaluated only at the shape they are used
with, broadcasting over the dimensions they ignore: `causal()` becomes `(1, 1, T, S)`,
`padding(lengths)` becomes `(B, 1, 1, S)`.

multihead's own predicates read `q_idx` bottom-right aligned (the query's position among
the S keys); a plain flex callable is read top-left, as flex reads it. nn.MultiheadAttention's
masks (True = ignore) are converted here and nowhere else.

Details: docs/kernel.md, "Masks: two index conventions, and the tiles".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from multihead.checks import check_nonnegative_int, check_positive_int, divisors
from multihead.named_mod import NamedMod

__all__ = [
    "MaskMod",
    "and_masks",
    "causal",
    "document",
    "from_flex",
    "from_key_padding_mask",
    "from_torch_attn_mask",
    "local_chunks",
    "or_masks",
    "padding",
    "prefix_lm",
    "sliding_window",
    "tile_classes",
    "to_dense",
]

# Pairs evaluated at once when a predicate has no analytic tile classes (x the batches
# and heads it depends on). Small, so that its temporaries are reused by the allocator:
# glibc keeps freed multi-MiB blocks in the heap, and 16 MiB patches grew RSS by 1.4 GiB.
_STRIP_ELEMENTS = 1 << 17


class MaskMod(NamedMod):
    """A named mask predicate `(b, h, q_idx, kv_idx) -> bool tensor` (True = may attend).

    `top_left=False` (multihead's predicates): `q_idx` is the bottom-right aligned
    position `i + S - T`; `top_left=True` (flex callables): `q_idx` is the row `i`.
    `tiles`, when given, is the analytic tile classifier (see `tile_classes`); `check`
    validates the predicate against the attention's `(B, H, T, S)` before any work.
    """

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], name: str, *,
                 top_left: bool = False, tiles: Callable | None = None, check: Callable | None = None,
                 parts: tuple[MaskMod, ...] = (), op: str | None = None, relative: bool = False,
                 segments: Callable | None = None):
        super().__init__(fn, name, top_left=top_left, check=check,
                         signature="a mask predicate must be callable (b, h, q_idx, kv_idx) -> bool tensor")
        self._tiles = tiles
        self._parts = parts
        self._op = op
        # segments(T, S) -> [(start, end), ...] or None: runs of positions that attend within
        # themselves and nowhere else (documents), for the kernel's one-call-per-document path
        self._segments = segments
        # a function of q - kv only (causal, sliding_window): equal tiles along a diagonal
        self.relative = all(p.relative for p in parts) if parts else relative

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx)

    @property
    def op(self) -> str | None:
        """"and" or "or" for a combination of predicates (`parts`), None for a leaf."""
        return self._op

    @property
    def parts(self) -> tuple[MaskMod, ...]:
        """The predicates a combination is made of (empty for a leaf)."""
        return self._parts

    @property
    def segments(self) -> Callable | None:
        """`segments(T, S) -> [(start, end), ...] or None`, when the predicate has them: runs of
        positions that attend within themselves and nowhere else (documents)."""
        return self._segments

    @property
    def analytic(self) -> bool:
        """Whether `tiles` classifies without evaluating the predicate pair by pair (every
        leaf knows its tile classes): then planning costs O(tiles), and can be repeated."""
        return self._tiles is not None if self._op is None else all(p.analytic for p in self._parts)

    def __and__(self, other: MaskMod | Callable) -> MaskMod:
        return and_masks(self, other)

    def __rand__(self, other: Callable) -> MaskMod:
        return and_masks(other, self)

    def __or__(self, other: MaskMod | Callable) -> MaskMod:
        return or_masks(self, other)

    def __ror__(self, other: Callable) -> MaskMod:
        return or_masks(other, self)

    def __repr__(self) -> str:
        return f"MaskMod({self.name})"

    def to_dense(self, B: int, H: int, T: int, S: int, device=None) -> Tensor:
        return to_dense(self, B, H, T, S, device=device)

    # -- what the kernel uses

    def check(self, B: int, H: int, T: int, S: int) -> None:
        """Raise ValueError if the predicate does not fit an attention of this shape."""
        for part in self._parts:
            part.check(B, H, T, S)
        super().check(B, H, T, S)

    def evaluate(self, b: Tensor, h: Tensor, rows: Tensor, kv: Tensor, shift: int) -> Tensor:
        """The predicate at query rows `rows` (row indices 0..T-1), keys `kv`; shift = S - T.

        Each leaf converts rows to its own convention, so a bottom-right predicate and a
        top-left flex callable combine correctly for any T and S.
        """
        if self._op is not None:
            out = self._parts[0].evaluate(b, h, rows, kv, shift)
            for part in self._parts[1:]:
                nxt = part.evaluate(b, h, rows, kv, shift)
                out = out & nxt if self._op == "and" else out | nxt
            return out
        out = self.fn(b, h, rows if self.top_left else rows + shift, kv)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            got = f"a {out.dtype} tensor" if isinstance(out, Tensor) else f"{type(out).__name__} {out!r}"
            raise TypeError(f"mask predicate {self.name} must return a bool tensor (True = may attend); "
                            f"it returned {got}")
        want = [max(sizes) for sizes in zip(*(t.shape for t in (b, h, rows, kv)))]
        got = (1,) * (4 - out.dim()) + tuple(out.shape)
        if len(got) != 4 or any(g not in (1, w) for g, w in zip(got, want)):
            raise ValueError(f"mask predicate {self.name} returned shape {tuple(out.shape)}, not broadcastable "
                             f"to the shape of its index tensors {tuple(want)}")
        return out

    def tiles(self, B: int, H: int, T: int, S: int, bq: int, bk: int, device=None) -> tuple[Tensor, Tensor]:
        """(any, all) bool tensors broadcastable to `(B, H, nq, nk)` over tiles of bq x bk.

        `any` may over-approximate (a tile reported non-empty may turn out empty) and
        `all` may under-approximate; both errors only cost speed, since a tile that is
        neither empty nor full runs with its dense mask.
        """
        if self._op is not None:
            res = [p.tiles(B, H, T, S, bq, bk, device) for p in self._parts]
            any_, all_ = res[0]
            for a, f in res[1:]:
                if self._op == "and":
                    any_, all_ = any_ & a, all_ & f
                else:
                    any_, all_ = any_ | a, all_ | f
            return any_, all_
        if self._tiles is not None:
            q_lo, q_hi, k_lo, k_hi = _tile_bounds(T, S, bq, bk, device)
            shift = 0 if self.top_left else S - T
            any_, all_ = self._tiles(q_lo + shift, q_hi + shift, k_lo, k_hi, T, S, bq, bk, device)
            return _as4d(any_), _as4d(all_)
        return _tiles_by_evaluation(self, B, H, T, S, bq, bk, device)


def _as4d(t: Tensor) -> Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def _tile_bounds(T: int, S: int, bq: int, bk: int, device):
    """First and last row `(nq, 1)` and key `(1, nk)` of each tile (inclusive)."""
    q_lo = torch.arange(0, T, bq, device=device)
    k_lo = torch.arange(0, S, bk, device=device)
    q_hi = (q_lo + bq).clamp(max=T) - 1
    k_hi = (k_lo + bk).clamp(max=S) - 1
    return q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :]


def _tiles_by_evaluation(mod: MaskMod, B, H, T, S, bq, bk, device) -> tuple[Tensor, Tensor]:
    """Classify tiles by evaluating the predicate one patch of whole tiles at a time (at most
    `_STRIP_ELEMENTS` pairs, so a few MiB of temporaries), never all of (T, S)."""
    nq, nk = -(-T // bq), -(-S // bk)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    kt = max(1, min(nk, _STRIP_ELEMENTS // max(1, bq * bk)))  # key tiles per patch
    qt = max(1, min(nq, _STRIP_ELEMENTS // max(1, bq * kt * bk)))  # query tiles per patch
    any_rows, all_rows = [], []
    for i0 in range(0, nq, qt):
        i1 = min(nq, i0 + qt)
        # rows and keys padded to whole tiles by repeating the last one: changes neither any nor all
        rows = torch.arange(i0 * bq, i1 * bq, device=device).clamp(max=T - 1).view(1, 1, -1, 1)
        anys, alls = [], []
        for j0 in range(0, nk, kt):
            j1 = min(nk, j0 + kt)
            kv = torch.arange(j0 * bk, j1 * bk, device=device).clamp(max=S - 1).view(1, 1, 1, -1)
            m = _as4d(mod.evaluate(b, h, rows, kv, S - T))
            m = m.expand(-1, -1, rows.shape[2], kv.shape[3])
            m = m.reshape(m.shape[0], m.shape[1], i1 - i0, bq, j1 - j0, bk)  # (Bm, Hm, nq', bq, nk', bk)
            anys.append(m.any(dim=5).any(dim=3))
            alls.append(m.all(dim=5).all(dim=3))
        any_rows.append(torch.cat(anys, dim=3))
        all_rows.append(torch.cat(alls, dim=3))
    return torch.cat(any_rows, dim=2), torch.cat(all_rows, dim=2)


def tile_classes(mask_mod: MaskMod, B: int, H: int, T: int, S: int, bq: int, bk: int,
                 device=None) -> Tensor:
    """Tile classes of a predicate: int8 `(Bm, Hm, nq, nk)`, 0 empty, 1 full, 2 partial.

    Bm is 1 or B and Hm is 1 or H, whichever the predicate depends on.
    """
    mask_mod = _as_mod(mask_mod, "tile_classes")
    for name, n in (("B", B), ("H", H), ("T", T), ("S", S), ("bq", bq), ("bk", bk)):
        _bounded(check_positive_int(name, n), name)
    mask_mod.check(B, H, T, S)
    any_, all_ = mask_mod.tiles(B, H, T, S, bq, bk, device)
    any_, all_ = torch.broadcast_tensors(any_, all_)
    any_, all_ = (t.expand(-1, -1, -(-T // bq), -(-S // bk)) for t in (any_, all_))
    return torch.where(all_, 1, torch.where(any_, 2, 0)).to(torch.int8)


# ------------------------------------------------------------------- combining


def from_flex(fn: Callable, name: str | None = None) -> MaskMod:
    """A flex_attention `mask_mod` (top-left `q_idx`, as flex calls it) as a MaskMod."""
    if isinstance(fn, MaskMod):
        return fn
    if not callable(fn):
        raise TypeError(f"from_flex takes a callable mask_mod(b, h, q_idx, kv_idx) -> bool tensor; "
                        f"received {type(fn).__name__}")
    return MaskMod(fn, name or getattr(fn, "__name__", "mask_mod"), top_left=True)


def _as_mod(m, what: str) -> MaskMod:
    if isinstance(m, MaskMod):
        return m
    if callable(m) and not isinstance(m, Tensor):
        return from_flex(m)
    raise TypeError(f"{what} combines multihead.masks predicates or flex mask_mod callables; "
                    f"received {type(m).__name__}")


def _combine(mods, op: str, what: str) -> MaskMod:
    if not mods:
        raise ValueError(f"{what} needs at least one mask; received none")
    mods = tuple(_as_mod(m, what) for m in mods)
    if len(mods) == 1:
        return mods[0]

    def fn(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out & m(b, h, q, kv) if op == "and" else out | m(b, h, q, kv)
        return out

    name = " & ".join(m.name for m in mods) if op == "and" else "(" + " | ".join(m.name for m in mods) + ")"
    return MaskMod(fn, name, parts=mods, op=op)


def and_masks(*mods: MaskMod | Callable) -> MaskMod:
    """May attend where every mask allows."""
    return _combine(mods, "and", "and_masks")


def or_masks(*mods: MaskMod | Callable) -> MaskMod:
    """May attend where any mask allows."""
    return _combine(mods, "or", "or_masks")


# ------------------------------------------------------------------ the predicates


# The largest int a predicate takes (window, chunk size, prefix length): positions are int64
# tensors, and the predicates add and subtract them (q - kv, window - 1), so a bound with room
# to spare. Any window or prefix beyond the sequence means the same mask as this one.
_MAX_INT = 2**62


def _bounded(n: int, name: str) -> int:
    """A checked int that also fits the int64 position arithmetic of the predicates."""
    if n > _MAX_INT:
        raise ValueError(f"{name} must be at most 2**62 = {_MAX_INT}; received {n} (positions are int64; any "
                         f"larger value means the same mask as 2**62)")
    return n


def causal() -> MaskMod:
    """Query at position p sees keys at positions <= p (bottom-right aligned)."""

    def tiles(q_lo, q_hi, k_lo, k_hi, *_):
        return k_lo <= q_hi, k_hi <= q_lo

    return MaskMod(lambda b, h, q, kv: kv <= q, "causal", tiles=tiles, relative=True)


def sliding_window(window: int) -> MaskMod:
    """Causal, and at most `window` keys back including the query's own position
    (Mistral / Gemma-2 local layers): 0 <= q - kv < window."""
    window = _bounded(check_positive_int("window", window), "window")

    def tiles(q_lo, q_hi, k_lo, k_hi, *_):
        # q - kv over a tile spans [q_lo - k_hi, q_hi - k_lo]; allowed: [0, window - 1]
        return (q_hi - k_lo >= 0) & (q_lo - k_hi <= window - 1), (q_lo - k_hi >= 0) & (q_hi - k_lo <= window - 1)

    return MaskMod(lambda b, h, q, kv: (kv <= q) & (q - kv < window), f"sliding_window({window})", tiles=tiles,
                   relative=True)


def local_chunks(size: int) -> MaskMod:
    """Local chunks (Llama 4's chunked attention): attend within the same chunk of `size`
    positions, q // size == kv // size. Not causal by itself: use `causal() & local_chunks(n)`.
    (Not the "chunked" backend, which computes any mask over blocks of queries.)"""
    size = _bounded(check_positive_int("chunk size", size), "chunk size")

    def tiles(q_lo, q_hi, k_lo, k_hi, *_):
        ql, qh, kl, kh = q_lo.div(size, rounding_mode="floor"), q_hi.div(size, rounding_mode="floor"), \
            k_lo.div(size, rounding_mode="floor"), k_hi.div(size, rounding_mode="floor")
        return (ql <= kh) & (kl <= qh), (ql == qh) & (kl == kh) & (ql == kl)

    return MaskMod(lambda b, h, q, kv: q.div(size, rounding_mode="floor") == kv.div(size, rounding_mode="floor"),
                   f"local_chunks({size})", tiles=tiles)


def _int_tensor(x, what: str, shape_hint: str) -> Tensor:
    if not isinstance(x, Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        got = f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{what} must be an integer tensor {shape_hint}; received {got}")
    return x


def _check_batch(n: int, what: str):
    def check(B, H, T, S):
        if n != B:
            raise ValueError(f"{what} has {n} entries but the batch has B = {B}; give one per sequence")
    return check


def document(doc_ids: Tensor) -> MaskMod:
    """Packed sequences: attend only within the same document.

    `doc_ids` is an integer tensor `(S,)` or `(B, S)` giving each key position's document
    (query positions are read from the same ids, bottom-right aligned). Not causal by
    itself: packed causal training uses `causal() & document(doc_ids)`. Ids need not be
    sorted, but sorted ids (the packed layout) give the most empty and full tiles.
    """
    doc_ids = _int_tensor(doc_ids, "doc_ids", "(S,) or (B, S)")
    if doc_ids.dim() not in (1, 2):
        raise ValueError(f"doc_ids must be 1-D (S,) or 2-D (B, S); received shape {tuple(doc_ids.shape)}")
    ids = doc_ids if doc_ids.dim() == 2 else doc_ids[None]  # (Bd, S)

    def check(B, H, T, S):
        if ids.shape[1] != S:
            raise ValueError(f"doc_ids has {ids.shape[1]} positions but attention has S = {S} keys; "
                             f"give one document id per key position")
        if ids.shape[0] not in (1, B):
            raise ValueError(f"doc_ids has batch size {ids.shape[0]} but the attention has B = {B}; valid: 1 or {B}")

    def fn(b, h, q, kv):
        S = ids.shape[1]
        bb = b if ids.shape[0] > 1 else torch.zeros_like(b)
        inside = (q >= 0) & (q < S)
        return inside & (ids[bb, q.clamp(0, S - 1)] == ids[bb, kv])

    def tiles(q_lo, q_hi, k_lo, k_hi, T, S, bq, bk, device):
        d = ids.to(device)
        nq, nk = q_lo.shape[0], k_lo.shape[1]
        shift = int(q_lo[0, 0])  # position of row 0
        pos = (torch.arange(nq * bq, device=device).clamp(max=T - 1) + shift)  # query positions, rows padded
        valid = (pos >= 0).view(nq, bq)
        dq = d[:, pos.clamp(min=0)].view(-1, nq, bq)  # (Bd, nq, bq)
        big = torch.iinfo(d.dtype).max
        qmin = torch.where(valid, dq, big).amin(-1)
        qmax = torch.where(valid, dq, -big).amax(-1)
        dk = d[:, torch.arange(nk * bk, device=device).clamp(max=S - 1)].view(-1, nk, bk)
        kmin, kmax = dk.amin(-1), dk.amax(-1)  # (Bd, nk)
        qmin, qmax, kmin, kmax = qmin[:, :, None], qmax[:, :, None], kmin[:, None, :], kmax[:, None, :]
        any_ = (qmin <= kmax) & (kmin <= qmax)
        all_ = (qmin == qmax) & (kmin == kmax) & (qmin == kmin) & valid.all(-1)[None, :, None]
        return any_[:, None], all_[:, None]  # (Bd, 1, nq, nk)

    def segments(T, S):
        if T != S or (ids.shape[0] > 1 and not bool((ids == ids[:1]).all())):
            return None
        row = ids[0]
        starts = [0] + (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        if len(set(row[starts].tolist())) != len(starts):
            return None  # an id in two runs: those runs see each other
        return list(zip(starts, starts[1:] + [S]))

    return MaskMod(fn, "document", tiles=tiles, check=check, segments=segments)


def prefix_lm(prefix_len: int | Tensor) -> MaskMod:
    """Prefix-LM (T5/PaLI/UL2): every query sees the first `prefix_len` positions
    (bidirectional over the prefix), and the positions up to its own (causal after).

    `prefix_len` is an int or an integer tensor `(B,)`, one prefix per sequence.
    """
    if isinstance(prefix_len, Tensor):
        p = _int_tensor(prefix_len, "prefix_len", "(B,) or an int")
        if p.dim() != 1:
            raise ValueError(f"prefix_len must be an int or a 1-D tensor (B,); received shape {tuple(p.shape)}")
        if (p < 0).any():
            raise ValueError(f"prefix_len must be >= 0; received {p.tolist()}")
        check = _check_batch(p.shape[0], "prefix_len")
        P = p.view(-1, 1, 1, 1)

        def fn(b, h, q, kv):
            return (kv < p[b]) | (kv <= q)

        def tiles(q_lo, q_hi, k_lo, k_hi, *rest):
            PP = P.to(k_lo.device)
            return (k_lo < PP) | (k_lo <= q_hi), (k_hi < PP) | (k_hi <= q_lo)

        return MaskMod(fn, "prefix_lm(tensor)", tiles=tiles, check=check)
    n = _bounded(check_nonnegative_int("prefix_len", prefix_len), "prefix_len")

    def tiles_int(q_lo, q_hi, k_lo, k_hi, *rest):
        return (k_lo < n) | (k_lo <= q_hi), (k_hi < n) | (k_hi <= q_lo)

    return MaskMod(lambda b, h, q, kv: (kv < n) | (kv <= q), f"prefix_lm({n})", tiles=tiles_int)


def padding(lengths: Tensor | None = None, *, keep: Tensor | None = None) -> MaskMod:
    """Key padding: batch b attends only keys `kv < lengths[b]`, or where `keep[b, kv]`.

    Give exactly one of `lengths` (int tensor `(B,)`) or `keep` (bool tensor `(B, S)`,
    True = a real token). For nn.MultiheadAttention's inverted `key_padding_mask`
    use `from_key_padding_mask`. The batch size is checked against the attention's
    when the mask is used.
    """
    if (lengths is None) == (keep is None):
        raise ValueError("padding takes exactly one of lengths=(B,) or keep=(B, S); "
                         f"received lengths={'set' if lengths is not None else None}, "
                         f"keep={'set' if keep is not None else None}")
    if lengths is not None:
        lengths = _int_tensor(lengths, "lengths", "(B,)")
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be a 1-D integer tensor (B,); received shape {tuple(lengths.shape)} "
                             f"{lengths.dtype}")
        if (lengths < 0).any():
            raise ValueError(f"lengths must be >= 0; received {lengths.tolist()}")
        L = lengths.view(-1, 1, 1, 1)

        def tiles_len(q_lo, q_hi, k_lo, k_hi, *rest):
            LL = L.to(k_lo.device)
            return k_lo < LL, k_hi < LL  # (B, 1, 1, nk)

        return MaskMod(lambda b, h, q, kv: kv < lengths[b], "padding(lengths)", tiles=tiles_len,
                       check=_check_batch(lengths.shape[0], "padding lengths"))
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
        got = f"shape {tuple(keep.shape)} {keep.dtype}" if isinstance(keep, Tensor) else type(keep).__name__
        wrong_type = not isinstance(keep, Tensor) or keep.dtype != torch.bool
        raise (TypeError if wrong_type else ValueError)(
            f"keep must be a 2-D bool tensor (B, S), True = real token; received {got}")

    def check(B, H, T, S):
        if keep.shape[1] != S:
            raise ValueError(f"keep-mask has S = {keep.shape[1]} keys but attention has {S}")
        if keep.shape[0] != B:
            raise ValueError(f"keep-mask has {keep.shape[0]} rows but the batch has B = {B}; give one per sequence")

    def tiles_keep(q_lo, q_hi, k_lo, k_hi, T, S, bq, bk, device):
        nk = k_lo.shape[1]
        kp = keep.to(device)[:, torch.arange(nk * bk, device=device).clamp(max=S - 1)].view(-1, nk, bk)
        return kp.any(-1)[:, None, None], kp.all(-1)[:, None, None]  # (B, 1, 1, nk)

    return MaskMod(lambda b, h, q, kv: keep[b, kv], "padding(keep)", tiles=tiles_keep, check=check)


def to_dense(mask_mod: MaskMod | Callable, B: int, H: int, T: int, S: int, device=None) -> Tensor:
    """Materialise a predicate as a bool tensor broadcastable to `(B, H, T, S)`.

    Dimensions the predicate ignores stay of size 1: `causal()` gives `(1, 1, T, S)`.
    A plain callable is read with flex's top-left `q_idx`.
    """
    mask_mod = _as_mod(mask_mod, "to_dense")
    for name, n in (("B", B), ("H", H), ("T", T), ("S", S)):
        check_positive_int(name, n)
    mask_mod.check(B, H, T, S)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    rows = torch.arange(T, device=device).view(1, 1, T, 1)
    kv = torch.arange(S, device=device).view(1, 1, 1, S)
    return _as4d(mask_mod.evaluate(b, h, rows, kv, S - T))


def from_key_padding_mask(key_padding_mask: Tensor) -> Tensor:
    """nn.MultiheadAttention's `key_padding_mask` `(B, S)` -> a multihead mask `(B, 1, 1, S)`.

    torch's bool form means True = *ignore*; multihead's means True = may attend, so the
    bool form is inverted. A float form is added to the scores in both, so it is kept.
    """
    kpm = key_padding_mask
    if not isinstance(kpm, Tensor) or kpm.dim() != 2:
        got = f"shape {tuple(kpm.shape)}" if isinstance(kpm, Tensor) else type(kpm).__name__
        raise (ValueError if isinstance(kpm, Tensor) else TypeError)(
            f"key_padding_mask must be a 2-D tensor (B, S); received {got}")
    if kpm.dtype == torch.bool:
        return (~kpm)[:, None, None, :]
    if kpm.is_floating_point():
        return kpm[:, None, None, :]
    raise TypeError(f"key_padding_mask must be bool (True = ignore) or float; received {kpm.dtype}")


def from_torch_attn_mask(attn_mask: Tensor, n_heads: int | None = None) -> Tensor:
    """nn.MultiheadAttention's `attn_mask` -> a multihead mask.

    `(T, S)` becomes `(1, 1, T, S)`; the 3-D `(B * n_heads, T, S)` form becomes
    `(B, n_heads, T, S)` (pass n_heads). Bool is inverted (torch: True = ignore).
    """
    m = attn_mask
    if not isinstance(m, Tensor):
        raise TypeError(f"attn_mask must be a tensor; received {type(m).__name__}")
    if m.dtype == torch.bool:
        m = ~m
    elif not m.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = ignore) or float; received {m.dtype}")
    if m.dim() == 2:
        return m[None, None]
    if m.dim() == 3:
        if n_heads is None or m.shape[0] % n_heads:
            raise ValueError(f"a 3-D attn_mask {tuple(m.shape)} is (B * n_heads, T, S): its dim 0 ({m.shape[0]}) "
                             f"must be divisible by n_heads ({n_heads}); valid: "
                             f"{', '.join(map(str, divisors(m.shape[0])))}")
        return m.view(m.shape[0] // n_heads, n_heads, *m.shape[1:])
    raise ValueError(f"attn_mask must be 2-D (T, S) or 3-D (B * n_heads, T, S); received {tuple(m.shape)}")
