"""A self-contained HTML page of an AttentionCapture: a head view (lines from each token
to the tokens it attends to, as in bertviz's head_view) and a model view (every captured
layer x head as a small heatmap; click one to focus it).

The page needs no network: script, styles and data are inlined and a Content-Security-
Policy (`default-src 'none'`, the script allowed by its hash) forbids every fetch. Token
text only ever reaches the page through JSON and `textContent`.

Details: docs/inspect.md, "The attention page: no network, compact weights".
"""

from __future__ import annotations

import base64
import hashlib
import html as html_lib
import json
import math
import re
from importlib import resources
from pathlib import Path

import torch

from multihead.checks import check_positive_int
from multihead.inspect.capture_types import AttentionCapture, HeadRole

# Without top_k, rows keep every weight while L*H*T*T stays under this many entries, and
# otherwise the largest power of two k with L*H*T*k under it (at least _MIN_AUTO_K): about
# 3 bytes an entry after base64, so the weights of any default page stay under ~6.3 MB.
_AUTO_ENTRIES = 1 << 21
_MIN_AUTO_K = 8
_ASSETS = ("head_view.html", "head_view.css", "head_view.js")
TITLE_CHARS = 120  # the title (h1, <title>) beyond this is cut; the full text is on demand
META_CHARS = 80  # likewise each metadata value in the summary line


def render_html(
    capture: AttentionCapture,
    roles: list[HeadRole] | None = None,
    *,
    max_tokens: int = 512,
    top_k: int | None = None,
    title: str | None = None,
) -> str:
    """The head view + model view page of `capture`, as a string (`save_html` writes it).

    Args:
        capture: the per-head weights `(L, H, T, T)` and tokens to draw.
        roles: head-role scores; shown as badges on the heads they name (roles of heads
            that were not captured are ignored).
        max_tokens: show at most the first `max_tokens` tokens (queries and keys); the
            page says how many were cut.
        top_k: keep the top_k weights of each query row. None picks a k that bounds the
            page (every weight while L*H*T*T <= 2**21, else the largest power of two k
            with L*H*T*k <= 2**21, at least 8).
        title: the page title; defaults to the model name and the text.
    """
    max_tokens, top_k = _check_arguments(capture, max_tokens, top_k)
    T_all = len(capture.tokens)
    T = min(T_all, max_tokens)
    weights = _finite_weights(capture, T)  # (L, H, T, T)
    L, H = weights.shape[:2]
    payload, dropped = _encode(weights, _choose_k(L * H * T, T, top_k))
    dropped["truncated_tokens"] = T_all - T
    data = _page_data(capture, roles, title, T, payload, dropped)
    return offline_page(data["title"], data, _ASSETS)


def save_html(
    capture: AttentionCapture,
    path: str | Path,
    roles: list[HeadRole] | None = None,
    *,
    max_tokens: int = 512,
    top_k: int | None = None,
    title: str | None = None,
) -> Path:
    """Write the page of `render_html` (same arguments) to `path` as UTF-8; returns the path.

    The page is built and encoded in full before the file is touched, then moved into
    place: a bad argument, text that cannot be encoded, a full disk or Ctrl-C leave an
    existing page as it was, never truncated.
    """
    from multihead.files import write_text

    return write_text(path, render_html(capture, roles, max_tokens=max_tokens, top_k=top_k, title=title))


def _check_arguments(capture, max_tokens, top_k) -> tuple[int, int | None]:
    if not isinstance(capture, AttentionCapture):
        raise TypeError(f"capture must be an AttentionCapture; received {type(capture).__name__}")
    return check_positive_int("max_tokens", max_tokens), check_positive_int("top_k", top_k, allow_none=True)


def _finite_weights(capture: AttentionCapture, T: int) -> torch.Tensor:
    """The first T queries' and keys' weights `(L, H, T, T)` in float32 on the CPU; a weight
    that is not a finite number is named by its place."""
    weights = capture.weights.detach().to("cpu", torch.float32)[..., :T, :T]  # (L, H, T, T)
    if not torch.isfinite(weights).all():
        bad = [int(i) for i in torch.nonzero(~torch.isfinite(weights))[0]]
        value = weights[tuple(bad)].item()
        raise ValueError(f"capture.weights must be finite; received {value} at [layer, head, t, s] = {bad}")
    return weights


def _page_data(capture: AttentionCapture, roles: list[HeadRole] | None, title: str | None, T: int,
               payload: dict, dropped: dict) -> dict:
    """What the page's script reads (version 1): the first T tokens, the encoded weights, the
    roles of captured heads (the top one is where the page opens), notes and metadata."""
    T_all = len(capture.tokens)
    tokens = [str(t) for t in capture.tokens[:T]]
    if title is None:
        text = str(capture.meta.get("text") or " ".join(tokens[:12]) + (" ..." if T > 12 else ""))
        title = f"{capture.model or 'attention'}: {text}"
    title = str(title)
    captured = {(layer, head) for layer in capture.layers for head in capture.heads}
    ranked = [r for r in roles or () if (r.layer, r.head) in captured]
    top = ranked[0] if ranked else None
    return {
        "version": 1,
        "title": _cut(" ".join(title.split()), TITLE_CHARS),
        "title_full": title,
        "start": ({"l": capture.layers.index(top.layer), "h": capture.heads.index(top.head)}
                  if top is not None else {"l": 0, "h": 0}),
        "model": capture.model,
        "tokens": tokens,
        "token_ids": [int(i) for i in capture.token_ids[:T]],
        "layers": [int(x) for x in capture.layers],
        "heads": [int(x) for x in capture.heads],
        "n_layers": int(capture.n_layers),
        "n_heads": int(capture.n_heads),
        "T": T,
        "T_captured": T_all,
        **payload,
        "roles": [_role_json(r) for r in ranked],
        "dropped": dropped,
        "note": _notes(dropped, tokens, capture.layers, capture.heads, T, T_all),
        "meta": {str(key): _meta_text(value) for key, value in capture.meta.items()},
        "meta_short": {str(key): _cut(" ".join(_meta_text(value).split()), META_CHARS)
                       for key, value in capture.meta.items()},
    }


def notebook_html(capture: AttentionCapture, roles: list[HeadRole] | None = None, *, height: int = 780,
                  **kwargs) -> str:
    """The page of `render_html` in an iframe, for a Jupyter cell (`_repr_html_`).

    The page goes in `srcdoc`, so it stays self-contained and offline (its CSP applies
    inside the frame) and its styles and element ids cannot clash with the notebook's.
    `sandbox="allow-scripts"` runs the page's one script in an opaque origin: it reads
    no cookie or storage of the notebook. roles default to `head_roles(capture)`.
    """
    if roles is None:
        from multihead.inspect.roles import head_roles

        roles = head_roles(capture)
    page = render_html(capture, roles, **kwargs)
    return (f'<iframe srcdoc="{html_lib.escape(page, quote=True)}" sandbox="allow-scripts" '
            f'title="multihead head view" style="width: 100%; height: {int(height)}px; border: 0"></iframe>')


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "\u2026"


def _meta_text(value) -> str:
    """Metadata as a person writes it, not a Python repr: lists comma-separated, mappings
    as 'key value' pairs, booleans yes/no."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(_meta_text(v) for v in value) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_meta_text(v)}" for k, v in value.items()) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _choose_k(n_rows: int, T: int, top_k: int | None) -> int:
    if T == 0:
        return 0
    if top_k is not None:
        return min(top_k, T)
    if n_rows * T <= _AUTO_ENTRIES:
        return T
    k = 1 << int(math.log2(max(1, _AUTO_ENTRIES // n_rows)))
    return min(T, max(_MIN_AUTO_K, k))


def _encode(weights: torch.Tensor, k: int) -> tuple[dict, dict]:
    """Pack `(L, H, T, T)` weights into base64 arrays, row r = (l * H + h) * T + t:

    - `scale`: float32 little-endian, one per row: the row's largest weight.
    - `q`: uint8, k per row: round(weight / scale * 255); decode as q / 255 * scale, off by
      at most 0.5 / 255 * scale (a row of zeros has scale 0).
    - `idx`: the key index of each q entry, uint8 when T <= 256 else uint16 little-endian
      (`idx_bytes`); absent (`dense`: true) when k == T and q lists the keys in order.
      When k < T the entries of a row are its top k, largest first; the others are 0.
    """
    L, H, T, _ = weights.shape
    dense = k == T
    if dense:
        values = weights  # (L, H, T, T)
        scale = weights.amax(dim=-1) if T else weights.sum(dim=-1)  # (L, H, T)
        largest_dropped = 0.0
    else:
        top, index = torch.topk(weights, min(k + 1, T), dim=-1, sorted=True)  # (L, H, T, k+1)
        values, index = top[..., :k], index[..., :k]  # (L, H, T, k)
        scale = values[..., 0]  # (L, H, T)
        largest_dropped = float(top[..., k].max()) if k < T and top.numel() else 0.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(values / safe[..., None] * 255).clamp_(0, 255).to(torch.uint8)  # (L, H, T, k)

    total = weights.double().sum(dim=-1)  # (L, H, T)
    kept = values.double().sum(dim=-1)
    mass = torch.where(total > 0, kept / total.clamp_min(1e-300), torch.ones_like(total))  # (L, H, T)
    payload = {
        "k": k,
        "dense": dense,
        "idx_bytes": 0 if dense else (1 if T <= 256 else 2),
        "idx": None if dense else (_b64(index.to(torch.uint8)) if T <= 256 else _b64_u16(index)),
        "q": _b64(q),
        "scale": _b64(scale.to(torch.float32)),
    }
    dropped = {"top_k": k, "of": T, "largest_dropped_weight": largest_dropped}
    if mass.numel():
        flat = int(torch.argmin(mass))
        li, hi, ti = (int(v) for v in torch.unravel_index(torch.tensor(flat), mass.shape))
        dropped.update(mean_mass=float(mass.mean()), min_mass=float(mass.min()), min_at=[li, hi, ti])
    else:
        dropped.update(mean_mass=1.0, min_mass=1.0, min_at=None)
    return payload, dropped


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")


def _b64_u16(index: torch.Tensor) -> str:
    if index.numel() and int(index.max()) > 0xFFFF:
        raise ValueError(f"at most 65536 tokens can be drawn; received {int(index.max()) + 1} (lower max_tokens)")
    return base64.b64encode(index.contiguous().numpy().astype("<u2").tobytes()).decode("ascii")


def _role_json(role: HeadRole) -> dict:
    return {
        "layer": int(role.layer),
        "head": int(role.head),
        "role": str(role.role),
        "score": float(role.score),
        "scores": {str(name): float(value) for name, value in role.scores.items()},
    }


def _floor_pct(x: float) -> str:
    return f"{math.floor(x * 1000) / 10:.1f}%"  # rounded down, so "covers >= x%" stays true


def _notes(dropped: dict, tokens: list[str], layers: list[int], heads: list[int], T: int, T_all: int) -> list[str]:
    notes = []
    if T < T_all:
        notes.append(
            f"Showing the first {T} of {T_all} tokens: the rows and columns of the last {T_all - T} are dropped "
            f"(raise max_tokens to see them)."
        )
    k = dropped["top_k"]
    if k < T:
        note = (
            f"Kept the top {k} of {T} weights of each row (dropped {T - k} per row, drawn as 0), covering "
            f">= {_floor_pct(dropped['min_mass'])} of each row's mass (mean {_floor_pct(dropped['mean_mass'])})"
        )
        if dropped["min_at"] is not None:
            li, hi, ti = dropped["min_at"]
            note += f"; min row mass kept at layer {layers[li]} head {heads[hi]} token {ti} {tokens[ti]!r}"
        note += f"; the largest dropped weight is {dropped['largest_dropped_weight']:.4f}."
        notes.append(note)
    else:
        notes.append(f"All {T} weights of each row are kept.")
    notes.append("Weights are stored in 8 bits, scaled to their row's largest weight (error <= 0.5/255 of it).")
    return notes


def _json_for_script(data: dict) -> str:
    # `<` as \u003c means no `</script>` or `<!--` can end or confuse the data block; the
    # other replacements keep the text valid in any HTML or JS context.
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


# A line that is only `<!-- include: NAME -->` or `/* include: NAME */` in an asset is
# replaced by the asset NAME, each of its lines indented as the marker is: the pages share
# one skeleton (page_open.html, page_close.html), base styles (page.css) and script helpers
# (page.js), and each view's files hold only what is its own.
_INCLUDE = re.compile(r"^([ \t]*)(?:<!--|/\*) include: ([\w.-]+) (?:-->|\*/)[ \t]*\n", re.M)


def _asset(name: str, within: tuple[str, ...] = ()) -> str:
    """The text of the asset `name` in this package, its includes resolved."""
    assert name not in within, f"assets include each other: {' -> '.join(within + (name,))}"
    text = resources.files("multihead.inspect").joinpath(name).read_text(encoding="utf-8")

    def include(m: re.Match) -> str:
        indent, lines = m.group(1), _asset(m.group(2), within + (name,)).splitlines(keepends=True)
        return "".join(indent + line if line.strip() else line for line in lines)

    return _INCLUDE.sub(include, text)


def offline_page(title: str, data: dict, assets: tuple[str, str, str]) -> str:
    """A page from its (template, css, js) assets in this package (includes resolved by
    `_asset`), `data` as JSON in a script block and a Content-Security-Policy that allows no
    fetch and only that script (by its hash). The head view and the summaries page are both
    built here."""
    template, css, js = (_asset(name) for name in assets)
    assert "</script" not in js.lower() and "</style" not in css.lower(), "asset would end its own tag"
    digest = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    csp = (
        "default-src 'none'; "
        f"script-src 'sha256-{digest}'; "
        "style-src 'unsafe-inline'; img-src data:; "
        "base-uri 'none'; form-action 'none'"
    )
    fills = {
        "TITLE": html_lib.escape(title),
        "CSP": html_lib.escape(csp),
        "CSS": css,
        "DATA": _json_for_script(data),
        "JS": js,
    }
    # One pass, so a placeholder spelled inside the data or title is never filled.
    return re.sub(r"__MH_([A-Z]+)__", lambda m: fills[m.group(1)], template)
