"""A self-contained HTML page of `HeadSummaries`, usable at 8,192 tokens x 270 heads.

The head view of `render_html` draws weights and stops being usable past a few hundred
tokens. This page draws what `summaries` computed beside the fused kernel instead: the
grid of every head coloured by a chosen summary (entropy, mean distance, sink mass,
induction, ...), and for the head clicked its pattern as block sums of the exact weights
over at most 256 x 256 blocks, with the exact top-k row of the query under the pointer
(or typed in).

Details: docs/inspect.md, "What the summaries page stores".
"""

from __future__ import annotations

import base64
import math
from pathlib import Path

import numpy as np
import torch

from multihead.checks import check_positive_int
from multihead.inspect.capture_types import HeadRole

__all__ = ["COARSE", "DETAIL_HEADS", "PAGE_BYTES", "render_summaries_html", "save_summaries_html"]

COARSE = 64
#: The fewest detail heads a page gets when they are chosen by size.
DETAIL_HEADS = 16
#: The page's size when the detail heads are chosen by size (UTF-8 bytes).
PAGE_BYTES = 24_000_000
_ASSETS = ("summaries_view.html", "summaries_view.css", "summaries_view.js")
_FIELDS = ("entropy", "mean_distance", "first_token_mass", "previous_token", "duplicate_token", "induction",
           "beyond_1k", "beyond_4k", "normalized_entropy", "current_token", "first_token", "delimiter", "next_token")


def render_summaries_html(summaries, roles: list[HeadRole] | None = None, *,
                          detail: list[tuple[int, int]] | int | None = None, coarse: int = COARSE,
                          title: str | None = None, max_bytes: int = PAGE_BYTES) -> str:
    """The page of `summaries` (a `HeadSummaries` made with `patterns=True` or for the
    heads to draw), as a string (`save_summaries_html` writes it).

    Args:
        roles: the ranked role table (`head_roles(summaries)`): role badges, and the order
            in which detail heads are chosen.
        detail: (layer, head) pairs that get the full-grid pattern and top-k rows, or a
            count: that many heads, best-ranked first (among those with a pattern); None:
            every head whose detail fits in `max_bytes` with the rest of the page, best-ranked
            first, and at least DETAIL_HEADS.
        coarse: the grid of every head's pattern (blocks per side).
        title: the page title; defaults to the model name and the start of the text.
        max_bytes: the page's size when `detail` is None (UTF-8 bytes).
    """
    if not (hasattr(summaries, "scores") and hasattr(summaries, "patterns")):
        raise TypeError(f"render_summaries_html takes a HeadSummaries; received {type(summaries).__name__}")
    coarse, max_bytes = check_positive_int("coarse", coarse), check_positive_int("max_bytes", max_bytes)
    s = summaries
    T = len(s.tokens)
    have = [(layer, head) for layer in s.layers for head in s.heads if (layer, head) in s.patterns]
    order = [(r.layer, r.head) for r in roles] if roles else have
    chosen: list[tuple[int, int]] = []
    if detail is None:
        pass  # chosen below, by size
    elif isinstance(detail, int) and not isinstance(detail, bool):
        chosen = [p for p in order if p in s.patterns][:max(0, detail)]
    else:
        chosen = [(int(a), int(b)) for a, b in detail]
        missing = [p for p in chosen if p not in s.patterns]
        if missing:
            raise ValueError(f"detail heads {missing} have no pattern; these summaries have patterns for "
                             f"{len(have)} heads (summaries(..., patterns=True) keeps every head's)")
    g = next(iter(s.patterns.values())).shape[-1] if s.patterns else 0
    c = _coarse_size(g, coarse)
    coarse_q, coarse_max = [], []
    for layer, head in have:
        p = s.patterns[(layer, head)].double()
        small = p.reshape(c, g // c, c, g // c).sum((1, 3)) if c else p
        q, m = _quantise(small)
        coarse_q.append(q)
        coarse_max.append(m)
    data = {
        "model": s.model, "T": T, "layers": s.layers, "heads": s.heads, "tokens": list(s.tokens),
        "fields": [f for f in _FIELDS if f in s.scores],
        "values": {f: [[_num(s.scores[f][li, hi]) for hi in range(len(s.heads))] for li in range(len(s.layers))]
                   for f in _FIELDS if f in s.scores},
        "roles": {f"{r.layer},{r.head}": {"role": r.role, "score": round(r.score, 4), "rank": i + 1}
                  for i, r in enumerate(roles or [])},
        "grid": g, "coarse": {"g": c, "heads": [f"{a},{b}" for a, b in have],
                              "data": _b64(np.concatenate(coarse_q)) if coarse_q else "", "max": coarse_max},
    }
    if title is None:
        text = s.meta.get("text", "")
        title = f"{s.model}: {T:,} tokens" + (f" \u2014 {text[:80]}" + ("\u2026" if len(text) > 80 else "")
                                              if isinstance(text, str) and text else "")
    patterned = chosen
    if detail is None:  # as many best-ranked heads as the size allows: top-k rows first, then full patterns
        ranked = [p for p in order if p in s.patterns]
        data["detail"], data["notes"] = _detail(s, [], [], T), _notes(s, have, [], [], g, c, T)
        room = max_bytes - len(_page(title, data).encode("utf-8")) - 512  # 512: the notes' longer text
        rows, pattern = _detail_bytes(s, g, T)
        least = min(DETAIL_HEADS, len(ranked))
        n_rows = len(ranked) if not rows else min(len(ranked), max(least, (room - least * pattern) // rows))
        n_pattern = min(len(ranked), max(least, (room - n_rows * rows) // pattern))
        chosen = ranked[:n_rows] if rows else []
        patterned = ranked[:n_pattern]
    data["detail"] = _detail(s, chosen, patterned, T)
    data["notes"] = _notes(s, have, chosen, patterned, g, c, T)
    return _page(title, data)


def save_summaries_html(summaries, path: str | Path, roles: list[HeadRole] | None = None, *,
                        detail: list[tuple[int, int]] | int | None = None, coarse: int = COARSE,
                        title: str | None = None, max_bytes: int = PAGE_BYTES) -> Path:
    """Write the page of `render_summaries_html` (same arguments) to `path` as UTF-8;
    returns the path.

    As with `save_html`, the page is built and encoded in full before the file is touched,
    then moved into place: a bad argument, a full disk or Ctrl-C leave an existing page as
    it was, never truncated.
    """
    from multihead.files import write_text

    page = render_summaries_html(summaries, roles, detail=detail, coarse=coarse, title=title, max_bytes=max_bytes)
    return write_text(path, page)


def _coarse_size(g: int, coarse: int) -> int:
    """The largest divisor of g that is at most `coarse` (block sums of whole blocks)."""
    if not g:
        return 0
    return max(d for d in range(1, min(g, coarse) + 1) if g % d == 0)


def _quantise(p: torch.Tensor) -> tuple[np.ndarray, float]:
    m = float(p.max()) if p.numel() else 0.0
    if m <= 0:
        return np.zeros(p.numel(), dtype=np.uint8), 0.0
    q = torch.round(255 * torch.sqrt((p / m).clamp(0, 1))).to(torch.uint8)
    return q.reshape(-1).numpy(), m


def _num(x) -> float | None:
    v = float(x)
    return round(v, 6) if math.isfinite(v) else None


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _detail(s, chosen: list[tuple[int, int]], patterned: list[tuple[int, int]], T: int) -> dict:
    """The top-k rows of the heads `chosen` and the full-grid patterns of the heads `patterned`."""
    wide = T >= 0xFFFF
    none = 0xFFFFFFFF if wide else 0xFFFF
    heads = list(dict.fromkeys(list(chosen) + list(patterned)))
    out = {"heads": [f"{a},{b}" for a, b in heads], "pattern": {}, "max": {}, "k": 0,
           "index_bytes": 4 if wide else 2, "none": none, "top_index": {}, "top_weight": {}}
    for layer, head in patterned:
        key = f"{layer},{head}"
        q, m = _quantise(s.patterns[(layer, head)].double())
        out["pattern"][key], out["max"][key] = _b64(q), m
    for layer, head in chosen:
        key = f"{layer},{head}"
        if s.top_index is not None:
            li, hi = s.layers.index(layer), s.heads.index(head)
            idx = s.top_index[li, hi].numpy().astype(np.int64)  # (T, k)
            out["k"] = int(idx.shape[-1])
            idx = np.where(idx < 0, none, idx).astype("<u4" if wide else "<u2")
            w = np.round(s.top_weight[li, hi].float().numpy().clip(0, 1) * 65535).astype("<u2")
            out["top_index"][key], out["top_weight"][key] = _b64(idx), _b64(w)
    return out


def _detail_bytes(s, g: int, T: int) -> tuple[int, int]:
    """One head's share of the page (base64 and JSON keys): its top-k rows (0 without
    top-k), its full-grid pattern."""
    b64 = lambda n: 4 * -(-n // 3)  # noqa: E731
    rows = 0
    if s.top_index is not None:
        k = s.top_index.shape[-1]
        rows = b64(T * k * (4 if T >= 0xFFFF else 2)) + b64(T * k * 2) + 80
    return rows, b64(g * g) + 80


def _notes(s, have, chosen, patterned, g: int, c: int, T: int) -> list[str]:
    notes = []
    if not have:
        notes.append("no patterns were kept (summaries(..., patterns=True) keeps every head's): the grid only")
    else:
        per = T / g if g else 0
        which = "every head" if len(patterned) == len(have) else f"the {len(patterned)} best-ranked heads"
        notes.append(f"patterns: block sums of the exact weights, {g} x {g} blocks of ~{per:.0f} tokens for "
                     f"{which}, {c} x {c} for every head; square-root colour scale")
    if chosen and s.top_index is not None:
        which = "every head" if len(chosen) == len(have) else \
            f"the {len(chosen)} best-ranked heads, marked \u2022: all {len(have)} would not fit the page"
        notes.append(f"hover a pattern (or type a position) for the query's top {s.top_index.shape[-1]} keys and "
                     f"weights (exact to 1.5e-5; {which})")
    if "truncated" in s.meta:
        t = s.meta["truncated"]
        notes.append(f"the text was cut to its first {t.get('kept')} of {t.get('tokens')} tokens ({t.get('reason')})")
    return notes


def _page(title: str, data: dict) -> str:
    from multihead.inspect.html import offline_page

    return offline_page(title, data, _ASSETS)
