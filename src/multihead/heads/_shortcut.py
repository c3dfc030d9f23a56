"""The patched layer's attention, not run (`patch_scan` for what="z" and "pattern").

A variant of head h at layer l enters l with the corrupted run's input, so there it differs
from that run only in head h's z, and the attention output is linear in z: the variant's
attention output is the corrupted run's plus the head's change through its columns of the
output projection. What is left per variant is that block's MLP and the blocks above.
Checked on the corrupted run (output = z @ W_o.T + a constant, layer by layer) and by a
self-check forward; declined with the reason otherwise (k, v and latent patches change the
attention itself and keep running it)."""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.heads._batch import first_output, keep_rows
from multihead.heads._record import Recording, out_projection
from multihead.heads.engine import Layer


class Shortcut:
    """The patched layer's attention, not run. A variant of head h at layer l enters l with
    the corrupted run's input, so there it differs from that run only in head h's z; the
    attention module's output is its output projection of z plus a constant (checked on
    the corrupted run, `check`), so the variant's attention output is the corrupted run's
    plus (written z - corrupted z) through head h's columns of the projection. The module
    then runs on the other rows only (on one row when there are none: its output is
    dropped), and the rows of the variants joining there get that sum.

    Taken for what="z" and "pattern" (k, v and latent patches change the attention
    itself), on layers whose variants join at their own block, one attention layer to a
    block; declined (with the reason) where the check or the scan's self-check fails."""

    def __init__(self):
        self.layers: set[int] = set()  # the layers it is taken on
        self.early = ""  # why it was declined before the corrupted run (its memory), or ""
        self.out: dict[int, Tensor] = {}  # layer -> the corrupted run's attention output (B, T, C)
        self.W: dict[int, Tensor] = {}  # layer -> the output projection's weight (C, H * Dv)
        self.z: dict[int, Tensor] = {}
        self.src: dict[int, Tensor] = {}

    def check(self, model, layers: list[Layer]) -> str:
        """Keep the layers whose attention output is z @ W.T + a constant; "" or why none is."""
        why = ""
        for lay in layers:
            if lay.index not in self.layers:
                continue
            z, out = self.z.get(lay.index), self.out.get(lay.index)
            try:
                W = out_projection(model, lay).detach()
            except (ValueError, TypeError, AttributeError) as err:
                W, why = None, f"layer {lay.index}: {err}"
            if W is not None and (z is None or out is None or W.shape != (out.shape[-1], z.shape[2] * z.shape[3])):
                W, why = None, (f"layer {lay.index}'s attention output is not its output projection's "
                                f"({type(lay.module).__name__})")
            if W is not None:
                rest = out - z.flatten(2) @ W.t().to(z.dtype)  # a constant (the bias) when out = o_proj(z)
                scale = 1 + float(out.abs().max())
                if not torch.allclose(rest, rest[:1, :1].expand_as(rest), rtol=1e-5, atol=1e-5 * scale):
                    W, why = None, (f"layer {lay.index}'s attention output is not its output projection of the "
                                    f"heads' z ({type(lay.module).__name__} does more after it)")
            if W is None:
                self.layers.discard(lay.index)
            else:
                self.W[lay.index] = W.to(z.dtype)
        return "" if self.layers else why or "no layer it applies to"

    def hooks(self, joining: dict[int, tuple[Layer, list[int]]], B: int, positions: list[int] | None,
              cut: tuple[int, int] | None, zero: bool = False, last: int | None = None) -> list:
        """(module, pre, post) forward hooks for the layers in `joining` (layer -> (Layer, the
        heads of the variants joining at its block)): they cut the module's batch and append
        the variants' rows. `zero`: the variants write the corrupted z (the self-check).
        `last`: the layer whose block runs its output projection at the last position only
        (`multihead.heads._top`): its variants' rows are built there only."""
        out = []
        for index, (lay, hs) in joining.items():
            state = {}
            T = self.out[index].shape[1]
            off = T - 1 if index == last else 0 if cut is None else cut[1]
            kept = None if positions is None else [q % T - off for q in positions if q % T >= off]

            def pre(mod, args, kwargs, n=len(hs), state=state):  # noqa: B008 (bound per layer)
                x = args[0] if args else kwargs["hidden_states"]
                rows = x.shape[0]
                keep = rows - n * B
                state["keep"] = keep
                return (tuple(keep_rows(a, rows, keep or 1) for a in args),
                        {k: keep_rows(v, rows, keep or 1) for k, v in kwargs.items()})

            def post(mod, args, result, index=index, lay=lay, hs=hs, state=state, off=off, kept=kept):
                y = first_output(result)
                base = self.out[index][:, off:].to(y.dtype)
                parts = [y[:state["keep"]]]
                for h in hs:
                    if zero:
                        parts.append(base)
                        continue
                    sl = slice(h * lay.Dv, (h + 1) * lay.Dv)
                    d = (self.src[index][:, off:, h] - self.z[index][:, off:, h]).to(y.dtype)  # (B, T', Dv)
                    if kept is not None:
                        keep_pos = torch.zeros(d.shape[1], dtype=torch.bool)
                        keep_pos[kept] = True
                        d = d * keep_pos[None, :, None].to(d.device)
                    parts.append(base + d @ self.W[index][:, sl].t())
                full = torch.cat(parts)
                return full if isinstance(result, Tensor) else (full, *result[1:])
            out.append((lay.module, pre, post))
        return out


def too_big(short: Shortcut, rec: Recording, budget: int) -> str:
    """Why the shortcut is declined before the corrupted run would hold its tensors (each
    layer's attention output and z, about two of the clean z a layer), or ""."""
    held = 2 * sum(rec["z", i].numel() * rec["z", i].element_size() for i in short.layers if ("z", i) in rec)
    if held <= budget // 4:
        return ""
    short.layers = set()
    return (f"it would hold {held / 2**20:,.0f} MiB (each layer's attention output and z), over a quarter "
            f"of the memory budget ({budget / 2**20:,.0f} MiB)")
