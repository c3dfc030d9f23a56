"""Heads you can intervene on: record, ablate, patch, scan, score and prune attention heads.

Works on (a) any transformers model running `attn_implementation="multihead"` (the
registry's attention function sees every layer's q/k/v and the heads' outputs), and (b)
any module built from multihead's `Attention` / `LatentAttention` (lab models included).
Layers are numbered in the order their attention runs; `heads` are `(layer, head)`
pairs of query heads unless a function says otherwise. Per-head tensors use
TransformerLens' layout: z `(B, T, H, Dv)`, k `(B, S, Hkv, D)`, v `(B, S, Hkv, Dv)`,
pattern `(B, H, T, S)`.

record, ablate, patch, patch_scan, attribution_scan, path_patch, path_patch_scan,
importance, prune, the edge tools (edges, edge_patch, edge_scores, faithfulness_curve) and
AtPositions: docs/heads.md.

Details: docs/heads.md, "The functions of `multihead.heads` at a glance".
"""

from __future__ import annotations

from multihead._lazy import lazy_exports

# Loaded on first use, so that `multihead heads --help` (which imports multihead.heads.cli,
# and with it this package) does not wait for torch.
_MODULES = {
    "multihead.heads.metrics": ("AtPositions",),
    "multihead.heads._importance": ("importance",),
    "multihead.heads._interventions": ("ablate", "patch"),
    "multihead.heads._prune": ("prune",),
    "multihead.heads._record": ("Recording", "record"),
    "multihead.heads.scan": ("attribution_scan", "patch_scan"),
    "multihead.heads.path_patching": ("path_patch", "path_patch_scan"),
    "multihead.heads.edge_patching": ("edges", "edge_patch"),
    "multihead.heads.edge_attribution": ("EdgeScores", "edge_scores"),
    "multihead.heads.faithfulness": ("faithfulness_curve",),
}

__all__ = ["AtPositions", "Recording", "ablate", "attribution_scan", "importance", "patch", "patch_scan", "path_patch",
           "path_patch_scan", "prune", "record"]
__all__ += ["EdgeScores", "edge_patch", "edge_scores", "edges", "faithfulness_curve"]

__getattr__, __dir__, _ = lazy_exports(__name__, _MODULES, globals())
