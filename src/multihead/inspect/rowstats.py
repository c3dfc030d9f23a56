"""Every per-head number inspect reports, as running sums over blocks of query rows.

One definition of each statistic, used two ways: `summaries` feeds it the probabilities
it recomputes a block of rows at a time beside the fused kernel (any length, one block's
`(h, t, w)` in memory), and `role_scores` / `head_roles` feed it the rows of a capture's
weights. Either way a block is `P (h, t, w)`: heads h, query rows t0..t0+t, keys
k0..k0+w, each row a probability distribution over its keys (keys outside the block have
probability 0, which is why a caller may crop a causal or windowed block to the keys it
can see). Sums are kept in float64; every statistic is a sum over rows of a row quantity.

Positions: query row i is at position pos_i = i + S - T among the S keys (bottom-right,
as `multihead.masks`); the role patterns need S == T (a text read once, no cache).

Details: docs/inspect.md, "The statistics `rowstats` sums".
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BEYOND", "RowSums", "TextContext", "duplicate_token_block", "induction_block"]

#: The distances (tokens back) whose share of attention mass is reported as beyond_1k / beyond_4k.
BEYOND = {"beyond_1k": 1024, "beyond_4k": 4096}
#: Token-match pairs kept for reuse across layers (one int64 each).
PAIR_CACHE = 1 << 22
#: The row quantities `RowSums` sums (each `(h, t)` per block), in the order of its sums.
ROW_VALUES = ("entropy", "distance", "first", *BEYOND, "previous", "current", "next", "delimiter", "mass",
              "matched")
#: The most keys per chunk in the two-stage top-k (`RowSums._keep_top`).
TOP_CHUNK = 64


# --------------------------------------------------------------------- patterns


def _grid(t0: int, t1: int, k0: int, k1: int, device) -> tuple[Tensor, Tensor]:
    return (torch.arange(t0, t1, device=device)[:, None], torch.arange(k0, k1, device=device)[None, :])


def duplicate_token_block(ids: Tensor, t0: int, t1: int, k0: int, k1: int, causal: bool = True,
                          plain: Tensor | None = None) -> Tensor:
    """TransformerLens' duplicate-token pattern, rows t0..t1 x keys k0..k1 (bool `(t, w)`):
    ids[j] == ids[i], j != i, and j < i when causal. With `plain` (bool `(T,)`), only
    pairs of plain (non-special) tokens."""
    i, j = _grid(t0, t1, k0, k1, ids.device)
    out = (ids[t0:t1, None] == ids[None, k0:k1]) & (i != j)
    if causal:
        out &= j < i
    if plain is not None:
        out &= plain[t0:t1, None] & plain[None, k0:k1]
    return out


def induction_block(ids: Tensor, t0: int, t1: int, k0: int, k1: int, plain: Tensor | None = None) -> Tensor:
    """TransformerLens' induction pattern, rows t0..t1 x keys k0..k1 (bool `(t, w)`):
    ids[j - 1] == ids[i], 1 <= j <= i (the token after an earlier occurrence of the
    current one; j = i counts, as in its pattern). With `plain`, only plain query tokens."""
    i, j = _grid(t0, t1, k0, k1, ids.device)
    prev = ids[(j - 1).clamp_min(0)]  # (1, w): the token before key j
    out = (ids[t0:t1, None] == prev) & (j >= 1) & (j <= i)
    if plain is not None:
        out &= plain[t0:t1, None]
    return out


# --------------------------------------------------------------------- context


@dataclass
class TextContext:
    """What the row statistics need of the text: token ids `(T,)`, which tokens are plain
    (not special) and which are delimiters (bool `(T,)`), and whether the model is causal."""

    ids: Tensor
    plain: Tensor
    delimiter: Tensor
    causal: bool

    @property
    def T(self) -> int:
        return int(self.ids.shape[0])

    @property
    def first_row(self) -> int:
        """The first row of Q: row 0 of a causal model can attend only to itself."""
        return 1 if self.causal and self.T > 1 else 0

    def to(self, device) -> TextContext:
        """The context on `device` (itself when it is there already, so its caches are shared)."""
        if self.ids.device == torch.device(device):
            return self
        return TextContext(self.ids.to(device), self.plain.to(device), self.delimiter.to(device), self.causal)

    def match_rows(self) -> dict[str, int]:
        """Query rows with a match in the duplicate-token and induction patterns (as scored)."""
        return {name: int(rows.sum()) for name, rows in self.pattern_rows().items()}

    def pattern_rows(self) -> dict[str, Tensor]:
        """{"duplicate_token", "induction": bool `(T,)`}: the rows that have a match."""
        cached = self.__dict__.get("_rows")
        if cached is not None:
            return cached
        T, out = self.T, {"duplicate_token": [], "induction": []}
        step = max(1, (1 << 22) // max(1, T))
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            out["duplicate_token"].append(
                duplicate_token_block(self.ids, t0, t1, 0, T, self.causal, self.plain).any(-1))
            out["induction"].append(induction_block(self.ids, t0, t1, 0, T, self.plain).any(-1))
        rows = {k: torch.cat(v) if v else torch.zeros(0, dtype=torch.bool, device=self.ids.device)
                for k, v in out.items()}
        self.__dict__["_rows"] = rows
        return rows

    def pair_index(self, name: str, t0: int, t1: int, k0: int, k1: int) -> Tensor:
        """The (row, key) pairs, as flat indices `row * (k1 - k0) + key` into the block, where
        pattern `name` has a 1 and A' keeps the weight (not the first key, not the diagonal);
        the TransformerLens patterns ("tl_duplicate_token", "tl_induction") keep every pair.
        Token matches are sparse and the same block geometry recurs in every layer, so the
        indices are kept (up to PAIR_CACHE of them in all)."""
        key = (name, t0, t1, k0, k1)
        cache = self.__dict__.setdefault("_pairs", {})
        if key in cache:
            return cache[key]
        if name == "duplicate_token":
            pat = duplicate_token_block(self.ids, t0, t1, k0, k1, self.causal, self.plain)
        elif name == "induction":
            pat = induction_block(self.ids, t0, t1, k0, k1, self.plain)
        elif name == "tl_duplicate_token":
            pat = duplicate_token_block(self.ids, t0, t1, k0, k1, True)
        else:
            pat = induction_block(self.ids, t0, t1, k0, k1)
        if not name.startswith("tl_"):
            i, j = _grid(t0, t1, k0, k1, pat.device)
            pat &= (j != i) & (j != 0)
        out = pat.reshape(-1).nonzero()[:, 0]  # (pairs,)
        held = self.__dict__.get("_held", 0)
        if held + out.numel() <= PAIR_CACHE:
            cache[key] = out
            self.__dict__["_held"] = held + out.numel()
        return out


# --------------------------------------------------------------------- sums


class RowSums:
    """Running sums of every statistic of `h` heads over blocks of query rows.

    `add(P, t0, k0)` takes one block; `result()` gives {name: `(h,)` float32 tensor}
    (roles the text cannot show are absent, see `result`). `top_k` > 0 also keeps each
    row's top-k keys (`top_index` int32, `top_weight` float16, `(h, T, k)`; -1 and 0 past the
    keys with nonzero weight); `grid` > 0
    keeps the pattern summed over a grid x grid of row and key bins (`pattern`, float32).

    Every statistic but the token-match numerators is a weighted sum over rows of a row
    quantity (`ROW_VALUES`) with a weight per row that depends only on the text (`_weights`:
    which rows a mean runs over, 1 / log n_i for the normalized entropy), so one block's
    sums are one `(values x h, t) @ (t, weights)` product: a few operations per block,
    whatever the number of statistics.
    """

    def __init__(self, n_heads: int, context: TextContext, S: int | None = None, *, top_k: int = 0,
                 grid: int = 0, transformer_lens: bool = False, device=None):
        self.h = int(n_heads)
        self.ctx = context if device is None else context.to(device)
        self.T = context.T
        self.S = self.T if S is None else int(S)
        self.shift = self.S - self.T
        self.transformer_lens = bool(transformer_lens)
        dev = self.ctx.ids.device
        self.top_k = int(top_k)
        self.top_index = self.top_weight = None
        if self.top_k:
            self.top_index = torch.full((self.h, self.T, self.top_k), -1, dtype=torch.int32, device=dev)
            self.top_weight = torch.zeros(self.h, self.T, self.top_k, dtype=torch.float16, device=dev)
        self.grid = min(int(grid), self.T, self.S) if grid else 0
        self.pattern = torch.zeros(self.h, self.grid, self.grid, device=dev) if self.grid else None
        self._matches = [name for name, n in self.ctx.match_rows().items() if n]  # token-match roles scored
        self._W, self._weight_names = self._weights()  # (T, m) float64
        self._sums = torch.zeros(len(ROW_VALUES), self.h, len(self._weight_names), dtype=torch.float64,
                                 device=dev)  # (values, h, weights)
        self._num = {name: torch.zeros(self.h, dtype=torch.float64, device=dev)
                     for name in self._matches + (["tl_duplicate_token", "tl_induction"]
                                                  if self.transformer_lens else [])}
        self._rows = torch.arange(self.T, device=dev)
        self._offsets = torch.tensor([-1, 0, 1], device=dev)
        self._cols = torch.arange(self.S, device=dev)

    def fork(self) -> RowSums:
        """Empty sums over the same text and geometry, for a worker folding in other blocks:
        the top-k arrays are shared (each row is written by the one block that holds it), the
        sums and the pattern are its own; `merge` adds them back."""
        other = copy.copy(self)
        other._sums = torch.zeros_like(self._sums)
        other._num = {name: torch.zeros_like(v) for name, v in self._num.items()}
        other.pattern = torch.zeros_like(self.pattern) if self.pattern is not None else None
        return other

    def merge(self, other: RowSums) -> None:
        """Add the sums of a `fork` (whose blocks were not folded in here)."""
        self._sums += other._sums
        for name, v in other._num.items():
            self._num[name] += v
        if self.pattern is not None:
            self.pattern += other.pattern

    def _weights(self) -> tuple[Tensor, list[str]]:
        """Each row's weight in each mean, `(T, m)` float64, and the m weights' names."""
        ctx, T, dev = self.ctx, self.T, self.ctx.ids.device
        i = torch.arange(T, device=dev)
        pos = i + self.shift
        n = (i + 1).double() if ctx.causal else torch.full((T,), float(T), dtype=torch.float64, device=dev)
        w = {"all": torch.ones(T, dtype=torch.float64, device=dev),
             "query": (i >= ctx.first_row).double(),
             "after_first": (i >= 1).double(),
             "before_last": (i <= T - 2).double(),
             "normalized": torch.where(n > 1, 1 / torch.log(n.clamp_min(2)), torch.zeros_like(n))}
        for name, d in BEYOND.items():
            w[name] = (pos >= d).double()
        rows = ctx.pattern_rows()
        for name in self._matches:
            w[name] = rows[name].double()
        return torch.stack(list(w.values()), dim=-1), list(w)

    def add(self, P: Tensor, t0: int, k0: int = 0, entropy: Tensor | None = None) -> None:
        """Fold in one block: P `(h, t, w)`, rows t0..t0+t, keys k0..k0+w (others have 0).
        `entropy`: the rows' -sum p log p `(h, t)` when the caller has it already."""
        h, t, w = P.shape
        assert h == self.h and t0 + t <= self.T and k0 + w <= self.S, "block outside the attention"
        P = P.float()
        dev, ctx = P.device, self.ctx
        t1, k1 = t0 + t, k0 + w
        pos = self._rows[t0:t1] + self.shift  # the rows' positions among the keys
        cols = self._cols[:w]

        # The statistics linear in a row (sums of P against a vector of keys), in one pass:
        # the row sum, the distance (from the block's last row: no cancellation in float32),
        # the delimiter mass and the keys every row counts as far back (the band where rows
        # differ, at most t keys wide, is added below).
        ref = t1 - 1 + self.shift
        counts = {name: (pos - d - k0 + 1).clamp(0, w) for name, d in BEYOND.items()}  # keys 0..n_i-1 count
        lows = {name: max(0, min(w, t0 + self.shift - d - k0 + 1)) for name, d in BEYOND.items()}
        V = torch.stack([torch.ones(w, dtype=P.dtype, device=dev), (ref - k0 - cols).to(P.dtype),
                         ctx.delimiter[k0:k1].to(P.dtype)]
                        + [(cols < lows[name]).to(P.dtype) for name in BEYOND], dim=-1)  # (w, 3 + len(BEYOND))
        lin = P @ V  # (h, t, 3 + len(BEYOND))
        r = lin[..., 0]  # 1, or 0 for a row that may attend nothing
        values = dict.fromkeys(ROW_VALUES)
        values["entropy"] = torch.special.entr(P).sum(-1) if entropy is None else entropy.to(P.dtype)  # nats
        values["distance"] = lin[..., 1] - (ref - pos).to(P.dtype) * r
        values["first"] = P[..., 0] if k0 == 0 else torch.zeros_like(r)
        for c, name in enumerate(BEYOND):
            mass = lin[..., 3 + c]
            lo, hi = lows[name], max(0, min(w, t1 - 1 + self.shift - BEYOND[name] - k0 + 1))
            if hi > lo:
                band = cols[lo:hi][None, :] < counts[name][:, None]  # (t, hi - lo)
                mass = mass + (P[..., lo:hi] * band).sum(-1)
            values[name] = mass
        diag = self._diagonals(P, t0, k0)  # (h, t, 3): keys i - 1, i, i + 1
        values["previous"], values["current"], values["next"] = diag.unbind(-1)
        values["delimiter"] = lin[..., 2]
        values["mass"] = r
        # A' = A without the first key and the diagonal (TransformerLens' exclude_bos and
        # exclude_current_token): at [0, 0] both are one weight, taken out once.
        values["matched"] = r - values["first"] - values["current"] + \
            (values["current"] * (pos == self.shift)).to(P.dtype)
        V = torch.stack(list(values.values())).double().view(len(ROW_VALUES) * h, t)  # (values x h, t)
        self._sums += (V @ self._W[t0:t1]).view(len(ROW_VALUES), h, -1)
        if self._num:
            flat = P.reshape(h, t * w)
            for name, acc in self._num.items():
                idx = ctx.pair_index(name, t0, t1, k0, k1)
                if idx.numel():
                    acc += flat.index_select(1, idx).double().sum(-1)
        if self.top_k:
            self._keep_top(P, t0, k0)
        if self.grid:
            self._bin(P, t0, k0)

    def _diagonals(self, P: Tensor, t0: int, k0: int) -> Tensor:
        """P[:, i, i + o] for the block's rows and o = -1, 0, 1: `(h, t, 3)`, 0 where that key is outside."""
        h, t, w = P.shape
        cols = self._rows[t0:t0 + t, None] + self._offsets - k0  # (t, 3)
        inside = (cols >= 0) & (cols < w)
        got = P.gather(-1, cols.clamp(0, max(0, w - 1))[None].expand(h, t, 3))
        return got * inside

    def _keep_top(self, P: Tensor, t0: int, k0: int) -> None:
        """Each row's k largest weights. A row's k largest lie in the k chunks (of TOP_CHUNK keys)
        with the largest maxima: were one outside them, those k maxima would be k larger
        weights. So the top-k runs on k chunks (and the tail) instead of the whole row."""
        h, t, w = P.shape
        k = min(self.top_k, w)
        # The work is about w / c chunk maxima plus k * c candidates per row: least near
        # c = sqrt(w / k), as a power of two between 16 and TOP_CHUNK.
        c = max(16, min(TOP_CHUNK, 1 << max(0, round(math.log2(max(1.0, w / k)) / 2))))
        n = w // c
        if n >= 4 * k:
            body = P[..., :n * c].view(h, t, n, c)
            chunk = body.amax(-1).topk(k, dim=-1)[1]  # (h, t, k): the chunks with the k largest maxima
            tail = w - n * c  # the keys after the last whole chunk are candidates too
            cand = P.new_empty(h, t, k * c + tail)
            torch.gather(body, 2, chunk[..., None].expand(h, t, k, c), out=cand[..., :k * c].view(h, t, k, c))
            cand[..., k * c:] = P[..., n * c:]
            vals, j = torch.topk(cand, k, dim=-1)  # (h, t, k)
            idx = torch.where(j < k * c, chunk.gather(-1, (j // c).clamp_max(k - 1)) * c + j % c,
                              j - k * c + n * c)  # the candidates' keys
        else:
            vals, idx = torch.topk(P, k, dim=-1)  # (h, t, k)
        self.top_weight[:, t0:t0 + t, :k] = vals.to(torch.float16)
        idx = (idx + k0).to(torch.int32).masked_fill(vals == 0, -1)  # -1: no more keys with weight
        self.top_index[:, t0:t0 + t, :k] = idx

    def _bin(self, P: Tensor, t0: int, k0: int) -> None:
        """Block sums over a grid x grid of row and key bins (bin of row i: i * grid // T)."""
        h, t, w = P.shape
        g = self.grid
        row_bin = self._rows[t0:t0 + t] * g // self.T
        if self.S % g == 0:  # bins of equal width: whole bins by a reshape, the two cut ones by a sum
            width, k1 = self.S // g, k0 + w
            a, b = -(-k0 // width) * width, k1 // width * width  # the whole bins' keys: a..b
            by_key = P.new_zeros(h, t, g)  # (h, t, g)
            if a > k0:
                by_key[..., k0 // width] += P[..., :min(a, k1) - k0].sum(-1)
            if b > a:
                by_key[..., a // width:b // width] = P[..., a - k0:b - k0].reshape(h, t, -1, width).sum(-1)
            if k1 > max(a, b):
                by_key[..., b // width] += P[..., b - k0:].sum(-1)
        else:
            key_bin = self._cols[k0:k0 + w] * g // self.S
            by_key = P.new_zeros(h, t, g).index_add_(2, key_bin, P)  # (h, t, g)
        self.pattern.index_add_(1, row_bin, by_key)

    # ------------------------------------------------------------------ results

    def result(self) -> dict[str, Tensor]:
        """{name: `(h,)` float32}. Absent: next_token for a causal model, delimiter when the
        text has none, duplicate_token / induction when no row has a match, beyond_* when no
        row reaches that far back."""
        ctx, T = self.ctx, self.T
        out: dict[str, Tensor] = {}
        v, m = ROW_VALUES.index, self._weight_names.index

        def s(value: str, weight: str) -> Tensor:
            return self._sums[v(value), :, m(weight)]

        zeros = torch.zeros(self.h, dtype=torch.float64, device=ctx.ids.device)
        out["entropy"] = s("entropy", "all") / T
        out["mean_distance"] = s("distance", "all") / T
        out["first_token_mass"] = s("first", "all") / T
        for name, d in BEYOND.items():
            rows = max(0, T - max(0, d - self.shift))
            if rows:
                out[name] = s(name, name) / rows
        rows = int(((torch.arange(1, T + 1) if ctx.causal else torch.full((T,), T)) > 1).sum())
        out["normalized_entropy"] = (s("entropy", "normalized") / rows).clamp(0, 1) if rows else zeros
        if T > 1:
            out["previous_token"] = s("previous", "after_first") / (T - 1)
            if not ctx.causal:
                out["next_token"] = s("next", "before_last") / (T - 1)
        q = T - ctx.first_row
        out["current_token"] = s("current", "query") / q
        out["first_token"] = s("first", "query") / q
        if bool(ctx.delimiter.any()):
            out["delimiter"] = s("delimiter", "query") / q
        for name in self._matches:
            den = s("matched", name)
            out[name] = torch.where(den > 0, self._num[name] / den.clamp_min(1e-300), zeros)
        if self.transformer_lens:
            den = s("mass", "all")
            nums = {"tl_previous_token": s("previous", "after_first"), "tl_duplicate_token":
                    self._num["tl_duplicate_token"], "tl_induction": self._num["tl_induction"]}
            for name, num in nums.items():
                out[name] = torch.where(den > 0, num / den.clamp_min(1e-300), zeros)
        return {k: v.float().cpu() for k, v in out.items()}
