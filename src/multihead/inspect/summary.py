"""The screen `multihead inspect` prints by default: what a person reads in half a minute.

Per role, how many heads hold it and the strongest of them with their scores; the
induction heads (prefix matching on repeated random tokens) and, on a decoder LM, the
causal check beside them (the loss on the repeated half with those heads ablated, against
as many random heads); the files written; the next command to try. At most 30 lines
(`MAX_LINES`); the full table is `--all` (or `--table PATH`, as JSON).
"""

from __future__ import annotations

__all__ = ["MAX_LINES", "format_summary"]

MAX_LINES = 30
PER_ROLE = 3  # heads shown per role
INDUCTION = 4  # induction heads shown
SHOWN = 0.1  # without a causal check, a head below this prefix-matching score is not called one
# the roles in reading order: token-matching and positional first, the sink and the rest last
ORDER = ("induction", "prefix_matching", "duplicate_token", "previous_token", "next_token", "current_token",
         "delimiter", "first_token", "mixed", "broad")


def _cell(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def format_summary(summ, roles, written: dict, *, check: dict | str | None = None, long_page: bool = False,
                   model_arg: str = "minilm") -> str:
    """The summary as text (at most MAX_LINES lines). `summ` is the HeadSummaries, `roles`
    the ranked HeadRoles, `written` the files made ({"html", "png", "table": path}),
    `check` the causal check of the induction heads (None: not run; a str: why not)."""
    T = len(summ.tokens)
    lines = [f"{summ.model}: {summ.n_layers} layers x {summ.n_heads} heads; summarised {len(summ.layers)} x "
             f"{len(summ.heads)} on {T:,} tokens",
             "tokens: " + " ".join(summ.tokens[:40]) + (f" ... (+{T - 40})" if T > 40 else ""),
             f"roles of the {len(roles)} heads (count, then the strongest, score in [0, 1]):"]
    by_role: dict[str, list] = {}
    for r in roles:
        by_role.setdefault(r.role, []).append(r)
    for role in sorted(by_role, key=lambda x: (ORDER.index(x) if x in ORDER else len(ORDER), x)):
        rs = by_role[role]
        top = "  ".join(f"{_cell(r.layer, r.head)} {r.score:.2f}" for r in rs[:PER_ROLE])
        lines.append(f"  {role:<16}{len(rs):>4}  {top}")
    lines += _induction_lines(roles, check, summ.meta.get("causal", False))
    names = {"html": "HTML summaries page" if long_page else "HTML head view", "png": "PNG grid",
             "table": "full table (JSON)"}
    lines += [f"{names[k]}: {v}" for k, v in written.items() if k in names]
    lines.append(_next_command(check, model_arg))
    return "\n".join(lines[:MAX_LINES])


def _induction_lines(roles, check: dict | None, causal: bool) -> list[str]:
    """The top heads by prefix matching, and the causal check beside them."""
    scored = sorted((r for r in roles if "prefix_matching" in r.scores), key=lambda r: -r.scores["prefix_matching"])
    if not scored:
        return []
    shown = scored[:INDUCTION] if isinstance(check, dict) else [r for r in scored[:INDUCTION]
                                                            if r.scores["prefix_matching"] >= SHOWN]
    heads = ", ".join(f"{_cell(r.layer, r.head)} {r.scores['prefix_matching']:.2f}" for r in shown) or \
        f"none (the best, {_cell(scored[0].layer, scored[0].head)}, scores {scored[0].scores['prefix_matching']:.2f})"
    out = [f"induction heads (prefix matching on random tokens repeated once): {heads}"]
    if isinstance(check, str):
        return out + [f"  causal check: {check}"]
    if check is None:
        why = "needs a decoder LM's next-token loss" + ("" if causal else " (this model is an encoder)")
        return out + [f"  causal check: {why}; try --model smollm2"]
    out.append(f"  causal check: loss (nats) on the repeated half of {check['n']} x {check['length']} random tokens "
               f"repeated once, heads {check['how']}-ablated; intact {check['metric_intact']:.2f}")
    for row in check["by_k"]:
        top = " ".join(_cell(*h) for h in row["heads"][:INDUCTION]) + (" ..." if row["k"] > INDUCTION else "")
        out.append(f"  top {row['k']} ({top}): {row['ablated']:.2f}; {row['k']} random heads: "
                   f"{row['random_median']:.2f} (median of {len(row['random'])} draws)")
    return out


def _next_command(check: dict | str | None, model_arg: str) -> str:
    if check is not None:
        return (f"next: multihead heads scan --task ioi --model {model_arg}   (the heads that carry the indirect "
                "object, by patching; --all prints every head's row)")
    return ('next: multihead inspect "The cat sat on the mat. The cat sat on the mat." --model smollm2   (a '
            "decoder's induction heads, checked by ablation; --all prints every head's row)")
