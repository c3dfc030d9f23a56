"""Block-sparse attention: time and memory follow the pairs a mask allows, not T x S.

The code lives in `multihead.kernels`: `planner` (tiles, their classes, causal squares,
block masks), `fused_tiles` (`fused`) and `explicit_tiles` (`explicit`); this module is
their old name, kept for its callers.

The score matrix `(T, S)` is cut into tiles of bq queries x bk keys. A mask predicate
(`multihead.masks`) classifies every tile as empty (skipped), full (run without a mask)
or partial (run with the dense mask of that tile only), analytically for the built-in
predicates and by evaluating one strip of rows at a time for any other. Nothing of
size `(T, S)` is ever built. Two engines run the kept tiles:

- `fused`: per block of queries, the contiguous range of key tiles it keeps goes to
  torch's fused `F.scaled_dot_product_attention` in one call, with a small dense mask
  (rows x kept keys) only when a tile in the range is not full; an additive score mod
  (ALiBi) rides along as that call's float mask. Autograd goes through the fused
  calls, so training memory stays O(N). Rows that attend exactly causally among
  themselves (plain causal; each packed document of `document & causal`) are found
  first and run as one call of torch's causal kernel each ("causal squares"), which
  skips the upper triangle itself: no pieces, no merges.
- `explicit`: any score mod (softcap) and dropout, tile by tile with an online softmax
  (FlashAttention-2, Dao 2023). A custom autograd Function saves only q, k, v, the
  output and the per-row log-sum-exp, and its backward recomputes each kept tile's
  probabilities from the log-sum-exp; dropout keeps are regenerated from a per-tile
  seed. Training memory: O(N) plus one tile.

GQA never copies K/V: the G query heads sharing a K/V head are folded into the query
rows of a block, `(B, H, t, D) -> (B, Hkv, G*t, D)`.
"""

from __future__ import annotations

from multihead.kernels.explicit_tiles import explicit, refuse_trainable
from multihead.kernels.fused_tiles import fused
from multihead.kernels.planner import tile_plan, tile_sizes

__all__ = ["explicit", "fused", "refuse_trainable", "tile_plan", "tile_sizes"]
