"""What `multihead plan` prints: the accounting of a model and the recommendation, as
aligned text tables for people and as dicts with a stable schema for `--json`.

Schemas (all sizes in bytes, counts exact integers, times in seconds):
- accounting: {"schema": "multihead.plan.account/1", "models": [ACCOUNT, ...]}
- recommendation: {"schema": "multihead.plan.recommend/1", ...} (see `recommendation_dict`)
docs/plan.md documents every field.
"""

from __future__ import annotations

from multihead.plan.devices import Device, fit, max_batch, max_context
from multihead.plan.geometry import (
    LatentGeometry,
    ModelGeometry,
    attention_flops,
    describe,
    kv_bytes_per_token,
    model_kv_cache_bytes,
    param_counts,
)
from multihead.plan.recommend import Candidate, Recommendation, head_dim_warnings, mha_warnings
from multihead.plan.text import recommendation_text  # noqa: F401  (re-exported: plan's public text formatter)
from multihead.plan.units import fmt_bytes, fmt_count, fmt_flops, fmt_tokens, table

ACCOUNT_SCHEMA = "multihead.plan.account/1"
RECOMMEND_SCHEMA = "multihead.plan.recommend/1"


def default_context(model: ModelGeometry) -> int:
    return model.context_length or 4096


def geometry_dict(model: ModelGeometry) -> dict:
    a = model.attention
    out = {
        "variant": a.kind,
        "label": a.label,
        "d_model": a.d_model,
        "n_layers": model.n_layers,
        "n_heads": a.n_heads,
        "n_kv_heads": a.n_kv_heads if a.kind != "MLA" else None,
        "head_dim": a.head_dim,
        "v_head_dim": a.v_head_dim,
        "mla": None,
        "moe": None,
        "window": None,
        "vocab_size": model.vocab_size,
        "tied_embeddings": model.tied_embeddings,
        "causal": model.causal,
        "max_positions": model.context_length,
    }
    if isinstance(a, LatentGeometry):
        out["mla"] = {"kv_rank": a.kv_rank, "q_rank": a.q_rank, "rope_dim": a.rope_dim,
                      "nope_head_dim": a.head_dim, "v_head_dim": a.v_head_dim}
    if model.moe is not None:
        e = model.moe
        out["moe"] = {"n_experts": e.n_experts, "top_k": e.top_k, "d_expert": e.d_expert,
                      "n_shared": e.n_shared, "moe_layers": model.n_moe_layers}
    if model.window is not None:
        out["window"] = {"size": model.window, "layers": model.n_window_layers}
    return out


def account(model: ModelGeometry, context: int | None = None, batch: int = 1, dtype="bf16",
            device: Device | None = None, weights_dtype="bf16", n_devices: int = 1) -> dict:
    """The full accounting of one model as a JSON-ready dict (one entry of "models")."""
    context = context or default_context(model)
    counts = param_counts(model)
    is_mla = isinstance(model.attention, LatentGeometry)
    kv = None
    if model.causal:
        kv = {
            "dtype": str(dtype),
            "context": context,
            "batch": batch,
            "bytes_per_token": kv_bytes_per_token(model, dtype),
            "bytes": model_kv_cache_bytes(model, context, batch, dtype),
            "decompressed_bytes_per_token": (kv_bytes_per_token(model, dtype, decompressed=True)
                                             if is_mla else None),
            "decompressed_bytes": (model_kv_cache_bytes(model, context, batch, dtype,
                                                        decompressed=True) if is_mla else None),
        }
    dev = None
    if device is not None:
        f = fit(model, device, context, batch, dtype, weights_dtype, n_devices)
        dev = {
            "name": device.name,
            "memory_bytes": device.memory,
            "bandwidth_bytes_per_s": device.bandwidth,
            "n_devices": n_devices,
            "weights_dtype": str(weights_dtype),
            "weights_bytes": f.weights_bytes,
            "usable_bytes": f.usable_bytes,
            "free_bytes": f.free_bytes,
            "fits": f.fits,
            "max_batch_at_context": max_batch(model, f),
            "max_context_at_batch": max_context(model, f),
            "decode_s_per_step": f.decode_s if model.causal else None,
            "tokens_per_s": f.tokens_per_s if model.causal else None,
        }
    warnings = head_dim_warnings(model) + mha_warnings(model, context, batch, dtype)
    if model.context_length and context > model.context_length:
        warnings.append(f"context {fmt_tokens(context)} is beyond the {model.context_length:,} "
                        f"positions {model.name} was built for")
    return {
        "name": model.name,
        "family": model.family,
        "summary": describe(model),
        "geometry": geometry_dict(model),
        "params": counts.as_dict(),
        "kv_cache": kv,
        "flops": attention_flops(model, context).as_dict(),
        "device": dev,
        "warnings": warnings,
        "notes": list(model.notes),
        "context": context,
        "batch": batch,
        "dtype": str(dtype),
    }


def account_json(accounts: list[dict]) -> dict:
    return {"schema": ACCOUNT_SCHEMA, "models": accounts}


UNBOUNDED = 2**40  # max_context when the cache stops growing (all layers windowed, encoders)


def _row_values(acc: dict) -> list[tuple[str, str]]:
    """(label, value) rows, the same labels for every model ('-' where one does not apply),
    so `--compare` lines models up row by row."""
    g, p, kv, fl, dev = acc["geometry"], acc["params"], acc["kv_cache"], acc["flops"], acc["device"]
    na = "-"
    m = g["mla"]
    heads = f"{g['n_heads']} x {g['head_dim']}"
    if m:
        heads = f"{g['n_heads']} x ({m['nope_head_dim']}+{m['rope_dim']}), v {m['v_head_dim']}"
    window = na
    if g["window"]:
        window = f"{g['window']['size']} on {g['window']['layers']}/{g['n_layers']} layers"
    ctx = fmt_tokens(fl["context"])
    at = f"{ctx} x {acc['batch']}"
    rows = [
        ("family", acc["family"]),
        ("attention", g["label"]),
        ("d_model", str(g["d_model"])),
        ("layers", str(g["n_layers"])),
        ("heads", heads),
        ("KV heads", "latent" if m else str(g["n_kv_heads"])),
        ("kv_rank / q_rank", f"{m['kv_rank']} / {m['q_rank'] or 'none'}" if m else na),
        ("sliding window", window),
        ("experts", na if not g["moe"] else
         f"{g['moe']['n_experts']} x {g['moe']['d_expert']}, top {g['moe']['top_k']}"
         + (f" + {g['moe']['n_shared']} shared" if g["moe"]["n_shared"] else "")
         + f", {g['moe']['moe_layers']}/{g['n_layers']} layers"),
        ("params", f"{p['total']:,} ({fmt_count(p['total'])})"),
        ("attention / layer", f"{p['attention_per_layer']:,}"),
        ("active / token", f"{p['active']:,} ({fmt_count(p['active'])})"
         if p["active"] != p["total"] else na),
    ]
    if kv is None:
        rows += [(f"KV / token ({acc['dtype']})", "none (encoder)"), (f"KV @ {at}", na),
                 ("decompressed KV / token", na), (f"decompressed @ {at}", na)]
    else:
        per = kv["bytes_per_token"]
        dec = kv["decompressed_bytes_per_token"]
        rows += [
            (f"KV / token ({kv['dtype']})", f"{per:,} B ({fmt_bytes(per)})"),
            (f"KV @ {at}", fmt_bytes(kv["bytes"])),
            ("decompressed KV / token", f"{dec:,} B ({fmt_bytes(dec)})" if dec else na),
            (f"decompressed @ {at}", fmt_bytes(kv["decompressed_bytes"]) if dec else na),
        ]
    # Attention only (q/k/v/o projections and the scores), not the FFN or the LM head.
    rows.append((f"attention FLOPs/token, prefill @ {ctx}", fmt_flops(fl["prefill_per_token"])))
    rows.append((f"attention FLOPs/token, decode @ {ctx}", fmt_flops(fl["decode_per_token"])
                 if fl["decode_per_token"] is not None else na))
    if dev is not None:
        where = dev["name"] if dev["n_devices"] == 1 else f"{dev['n_devices']} x {dev['name']}"
        longest = dev["max_context_at_batch"]
        decode = dev["decode_s_per_step"]
        rows += [
            ("device", where),
            (f"weights ({dev['weights_dtype']})", fmt_bytes(dev["weights_bytes"])),
            ("free for KV", fmt_bytes(max(dev["free_bytes"], 0))),
            ("fits", "yes" if dev["fits"] else "NO"),
            ("max batch @ context", f"{dev['max_batch_at_context']:,}" if kv else na),
            ("max context @ batch", na if kv is None else _max_context_words(longest, g["max_positions"])),
            ("decode ms/step (mem-bound)", f"{decode * 1e3:.2f}" if decode else na),
            ("tokens/s", f"{dev['tokens_per_s']:,.0f}" if decode else na),
        ]
    return rows


def _max_context_words(longest: int, positions: int | None) -> str:
    """The longest context that fits, capped at the model's positions (and saying so)."""
    memory = "unbounded" if longest >= UNBOUNDED else f"{longest:,}"
    if positions and longest > positions:
        return f"{positions:,} (its positions; memory: {memory})"
    return memory


def account_text(accounts: list[dict]) -> str:
    """One column per model: a single config, or `--compare` side by side."""
    per = [_row_values(a) for a in accounts]
    keys = [k for k, _ in per[0]]
    values = [[v for _, v in rows] for rows in per]
    body = [[k, *[vals[i] for vals in values]] for i, k in enumerate(keys)
            if any(vals[i] != "-" for vals in values)]
    headers = ["", *[a["name"] for a in accounts]]
    out = [table(headers, body, right=set(range(1, len(headers))))]
    for a in accounts:
        prefix = f"{a['name']}: " if len(accounts) > 1 else ""
        out += [f"warning: {prefix}{w}" for w in a["warnings"]]
        out += [f"note: {prefix}{n}" for n in a["notes"]]
    return "\n".join(out)


# --- the recommendation ------------------------------------------------------------


def candidate_dict(c: Candidate, rank: int) -> dict:
    f = c.fit
    return {
        "rank": rank,
        "label": c.label,
        "summary": describe(c.model),
        "geometry": geometry_dict(c.model),
        "params": c.params.total,
        "attention_params_per_layer": c.params.attention_per_layer,
        "kv_bytes_per_token": c.kv_bytes_per_token,
        "kv_bytes": c.kv_bytes,
        "fits": f.fits,
        "max_batch_at_context": c.max_batch,
        "max_context_at_batch": c.max_context,
        "decode_s_per_step": f.decode_s,
        "tokens_per_s": f.tokens_per_s,
    }


def recommendation_dict(rec: Recommendation) -> dict:
    r = rec.request
    f = rec.pick.fit
    return {
        "schema": RECOMMEND_SCHEMA,
        "request": {
            "params": r.params, "context": r.context, "batch": r.batch,
            "priority": r.priority, "dtype": r.dtype, "weights_dtype": r.weights_dtype,
            "d_model": r.d_model, "n_layers": r.n_layers, "n_heads": r.n_heads,
            "n_kv_heads": r.n_kv_heads, "head_dim": r.head_dim, "variant": r.variant,
            "kv_rank": r.kv_rank, "vocab_size": r.vocab_size,
            "device": r.device.name, "n_devices": r.n_devices,
        },
        "device": {"name": r.device.name, "memory_bytes": r.device.memory,
                   "bandwidth_bytes_per_s": r.device.bandwidth, "n_devices": r.n_devices,
                   "usable_bytes": f.usable_bytes},
        "pick": candidate_dict(rec.pick, 1),
        "pick_note": rec.pick_note or None,
        "reason": rec.reason,
        "weights_bytes": f.weights_bytes,
        "init": rec.init,
        "bias": rec.bias,
        "check": rec.check,
        "alternatives": [candidate_dict(c, i + 1) for i, c in enumerate(rec.alternatives)],
        "warnings": list(rec.warnings),
        "notes": list(rec.notes),
    }  # fmt: skip


