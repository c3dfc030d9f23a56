"""The text `multihead plan` prints for a recommendation (`print(rec)` gives the same).

Its own module so that `Recommendation.__str__` can use it without `recommend` and `report`
importing each other.
"""

from __future__ import annotations

from multihead.plan.geometry import describe
from multihead.plan.units import fmt_bytes, fmt_count, fmt_tokens, table

__all__ = ["recommendation_text"]


def _init_lines(init: dict) -> list[str]:
    """Projections with the same rule share a line: 'q, k, v  N(0, 0.0156) = 1/sqrt(d_model)'."""
    groups: dict[tuple, list[str]] = {}
    for name, v in init.items():
        groups.setdefault((v["std"], v["rule"]), []).append(name)
    lines = [f"{', '.join(names)}: N(0, {std:.4g}), std = {rule}"
             for (std, rule), names in groups.items()]
    return [f"{'init' if i == 0 else '':<10}{line}" for i, line in enumerate(lines)]


def _wrapped(label: str, text: str, width: int = 100) -> list[str]:
    """'why       text...' wrapped at `width`, continuation lines under the text."""
    import textwrap

    return textwrap.wrap(text, width, initial_indent=f"{label:<10}", subsequent_indent=" " * 10,
                         break_on_hyphens=False) or [label]


def recommendation_text(rec) -> str:
    """The text of a `plan.Recommendation` (`recommend(...)`'s result), as the CLI prints it."""
    r, p, f = rec.request, rec.pick, rec.pick.fit
    where = r.device.name if r.n_devices == 1 else f"{r.n_devices} x {r.device.name}"
    lines = [
        f"multihead plan: {fmt_count(r.params)} parameters, {fmt_tokens(r.context)} context x "
        f"batch {r.batch}, {where} ({fmt_bytes(r.device.memory)}, "
        f"{r.device.bandwidth / 1e12:.2f} TB/s), {r.dtype} cache, {r.priority}",
        "",
        f"pick      {describe(p.model)}" + (f" ({rec.pick_note})" if rec.pick_note else ""),
        f"          {p.params.total:,} parameters ({fmt_count(p.params.total)}), "
        f"{p.params.attention_per_layer:,} in attention per layer",
        *_wrapped("why", rec.reason),
        f"KV cache  {p.kv_bytes_per_token:,} B/token; {fmt_bytes(p.kv_bytes)} at "
        f"{fmt_tokens(r.context)} x {r.batch} ({'fits' if f.fits else 'DOES NOT FIT'}: with "
        f"{fmt_bytes(f.weights_bytes)} of weights {fmt_bytes(p.kv_bytes + f.weights_bytes)} of the "
        f"{fmt_bytes(f.usable_bytes)} usable)",
        f"decode    {f.decode_s * 1e3:.2f} ms/step memory-bound, {f.tokens_per_s:,.0f} tokens/s "
        f"at batch {r.batch}",
        *_init_lines(rec.init),
        *_wrapped("biases", f"{'yes' if rec.bias['use'] else 'none'}: {rec.bias['reason']}"),
        f"check     {rec.check['command']}",
        *_wrapped("", f"({rec.check['expect']}; {rec.check['takes']})"),
        "",
        "alternatives, ranked:",
    ]
    headers = ["#", "variant", "H", "Hkv", "D", "params", "attn/layer", "KV/token",
               f"KV@{fmt_tokens(r.context)}x{r.batch}", "fits", "ms/step", "tok/s"]
    rows = []
    for i, c in enumerate(rec.alternatives, 1):
        a = c.model.attention
        rows.append([
            str(i), c.label, str(a.n_heads), "latent" if a.kind == "MLA" else str(a.n_kv_heads),
            str(a.head_dim) if a.kind != "MLA" else f"{a.head_dim}+{a.rope_dim}",
            fmt_count(c.params.total), f"{c.params.attention_per_layer:,}",
            fmt_bytes(c.kv_bytes_per_token), fmt_bytes(c.kv_bytes),
            "yes" if c.fit.fits else "no", f"{c.fit.decode_s * 1e3:.2f}",
            f"{c.fit.tokens_per_s:,.0f}",
        ])
    lines.append(table(headers, rows, right={0, 2, 3, 5, 6, 7, 8, 10, 11}))
    if rec.warnings:
        lines.append("")
        lines += [f"warning: {w}" for w in rec.warnings]
    if rec.notes:
        lines.append("")
        lines += [f"note: {n}" for n in rec.notes]
    return "\n".join(lines)
