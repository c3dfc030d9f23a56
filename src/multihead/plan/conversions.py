"""What converting a trained model's attention would save, before spending any compute.

For an MHA/GQA model, `conversions(model)` lists what `multihead.convert.to_gqa` (every
smaller count of key/value heads that divides the model's) and `to_mla` (latent ranks
whose cache equals each of those GQA caches, up to the rank where the conversion is
exact) give: KV-cache bytes per token and parameters, and how much each saves. The
numbers are this package's exact accounting of the converted geometry (pure Python).
The MLA rows have no decoupled RoPE key (rope_dim 0); the text says what a RoPE model's
`to_mla(model, R, rope_dim=r)` adds to them (the geometry does not record RoPE).

What each costs in quality is measured, at small scale, by `multihead lab uptrain`.
"""

from __future__ import annotations

from dataclasses import replace

from multihead.checks import divisors
from multihead.plan.geometry import (
    AttentionGeometry,
    LatentGeometry,
    ModelGeometry,
    kv_bytes_per_token,
    param_counts,
)
from multihead.plan.units import fmt_bytes, fmt_count

__all__ = ["conversions", "conversions_text"]


def conversions(model: ModelGeometry, dtype="bf16") -> list[dict]:
    """One dict per conversion: {"conversion", "n_kv_heads" | "kv_rank", "kv_bytes_per_token",
    "kv_saved", (a fraction of the model's), "params", "params_saved"}; [] for an encoder
    or a model that is already MLA."""
    a = model.attention
    if not isinstance(a, AttentionGeometry) or not model.causal:
        return []
    kv0, p0 = kv_bytes_per_token(model, dtype), param_counts(model).total
    D, hkv = a.head_dim, a.n_kv_heads

    def row(name: str, attention, **what) -> dict:
        m = replace(model, attention=attention)
        kv, p = kv_bytes_per_token(m, dtype), param_counts(m).total
        return {"conversion": name, **what, "kv_bytes_per_token": kv, "kv_saved": 1 - kv / kv0, "params": p,
                "params_saved": p0 - p}

    rows = []
    smaller = [k for k in reversed(divisors(hkv)) if k < hkv]
    for k in smaller:
        rows.append(row(f"to_gqa -> {'MQA' if k == 1 else f'GQA-{k}'}", replace(a, n_kv_heads=k), n_kv_heads=k))
    if a.context_dim is None or a.context_dim == a.d_model:
        exact = a.d_model + a.bias  # the rank of the stacked [W_k ; W_v] (the value bias is one more column)
        for r in sorted({min(2 * k * D, exact) for k in smaller}, reverse=True):
            latent = LatentGeometry(a.d_model, a.n_heads, r, head_dim=D, v_head_dim=D, rope_dim=0,
                                    latent_norm=False, bias=a.bias)
            rows.append(row(f"to_mla R={r}" + (" (exact)" if r == exact else ""), latent, kv_rank=r))
    return rows


def conversions_text(model: ModelGeometry, dtype="bf16") -> str:
    """The table `multihead plan --model` prints under the model's: what each conversion saves."""
    rows = conversions(model, dtype)
    if not rows:
        return ""
    kv0, p0 = kv_bytes_per_token(model, dtype), param_counts(model).total
    lines = [f"converting {model.name} (multihead.convert; quality: multihead lab uptrain): "
             f"KV / token ({dtype}) {kv0:,} B, params {fmt_count(p0)}"]
    width = max(len(r["conversion"]) for r in rows)
    for r in rows:
        lines.append(f"  {r['conversion']:<{width}}  KV / token {fmt_bytes(r['kv_bytes_per_token']):>10} "
                     f"(-{r['kv_saved']:.0%})  params {fmt_count(r['params']):>7} "
                     f"({'-' if r['params_saved'] >= 0 else '+'}{fmt_count(abs(r['params_saved']))})")
    lines += ["  to_mla R: the latent alone (rope_dim 0), exact at the top rank for layers without RoPE; a RoPE model",
              "  (multihead, lab or transformers Llama-family) converts with to_mla(model, R, rope_dim=r), MHA2MLA's",
              "  partial RoPE, and caches r more values per token per layer"]
    return "\n".join(lines)
