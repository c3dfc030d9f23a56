"""What `multihead.heads` must know of transformers' attention modules beyond the
attention function: where the output projection is (per-head results, attribution,
pruning) and which projections carry a head's rows (pruning)."""

from __future__ import annotations

from torch import Tensor, nn

from multihead.heads.engine import parents_of


def _weight_out_in(lin: nn.Module) -> Tensor:
    """The weight as (out, in): nn.Linear stores it so, GPT-2's Conv1D transposed."""
    if isinstance(lin, nn.Linear):
        return lin.weight
    if type(lin).__name__ == "Conv1D":
        return lin.weight.t()
    raise TypeError(f"unexpected projection {type(lin).__name__}")


def hf_out_projection(model: nn.Module, module: nn.Module) -> Tensor:
    """The output projection `(C, H * Dv)` that follows transformers attention `module`:
    its `o_proj` / `out_proj` / `c_proj` / `dense` / `o`, or (BERT, ViT) the sibling
    `output.dense` of its parent."""
    for name in ("o_proj", "out_proj", "c_proj", "dense", "o"):
        lin = getattr(module, name, None)
        if isinstance(lin, nn.Module):
            return _weight_out_in(lin)
    parent = parents_of(model).get(id(module))
    out = getattr(parent, "output", None) if parent is not None else None
    if out is not None and isinstance(getattr(out, "dense", None), nn.Module):
        return _weight_out_in(out.dense)
    raise ValueError(f"cannot find the output projection of {type(module).__name__} (looked for o_proj, out_proj, "
                     "c_proj, dense, o and the parent's output.dense); per-head results need it")
