"""PNG heatmaps of an AttentionCapture: a layer x head grid and one head with its tokens.

matplotlib is imported inside the functions, and figures are drawn on their own Agg
canvas (no pyplot), so neither `import multihead` nor a notebook's backend is touched.
Colour is viridis of sqrt(weight) on a fixed 0..1 range, the same as the HTML view: a
sharp head shows bright cells, a broad one stays visible without rescaling each tile.
"""

from __future__ import annotations

import math
from pathlib import Path

from multihead.inspect.capture_types import AttentionCapture, HeadRole

_CMAP = "viridis"
_DPI = 100


def save_grid(capture: AttentionCapture, path: str | Path, roles: list[HeadRole] | None = None) -> Path:
    """Draw every captured layer (rows) x head (columns) as a heatmap and save it as PNG.

    Each tile is the head's `(T, T)` weights: rows are queries, columns are keys. Heads
    named in `roles` get their strongest role and score under the tile's title.
    """
    _check(capture)
    Figure, FigureCanvasAgg, PowerNorm = _mpl()
    import numpy as np

    L, H, T, _ = capture.weights.shape
    tile = min(1.6, 22.0 / max(H, 1), 28.0 / max(L, 1))  # inches
    # One mosaic image with NaN (white) gaps instead of L*H axes: 72 axes cost seconds to lay
    # out. Long texts are max-pooled to the tile's pixels so sharp cells stay visible.
    w = _max_pool(capture.weights.detach().float().cpu().numpy(), int(tile * _DPI))  # (L, H, P, P)
    P = w.shape[-1]
    by_head = {(r.layer, r.head): r for r in roles or ()}
    lines = 2 if any((layer, head) in by_head for layer in capture.layers for head in capture.heads) else 1
    gap = max(1, math.ceil(P * 0.08 / tile))  # ~0.08 in, in cells
    band = math.ceil((lines * 7 * 1.3 / 72 + 0.04) * P / tile)  # room for the tile titles
    step_x, step_y = P + gap, band + P + gap
    mosaic = np.full((L * step_y + gap, H * step_x + gap), np.nan, dtype=np.float32)
    for i in range(L):
        for j in range(H):
            y0, x0 = i * step_y + band, gap + j * step_x
            mosaic[y0 : y0 + P, x0 : x0 + P] = w[i, j]

    top = 0.4  # inches for the title
    width, height = mosaic.shape[1] * tile / P, mosaic.shape[0] * tile / P
    fig = Figure(figsize=(width, height + top), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, height / (height + top)))
    ax.set_axis_off()
    cmap = _cmap()
    ax.imshow(mosaic, cmap=cmap, norm=PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0), interpolation="nearest", aspect="auto")
    for i, layer in enumerate(capture.layers):
        for j, head in enumerate(capture.heads):
            label = f"L{layer} H{head}"
            role = by_head.get((layer, head))
            if role is not None:
                label += f"\n{role.role.replace('_', ' ')} {role.score:.2f}"
            ax.text(gap + j * step_x + P / 2, i * step_y + band - 0.5, label, ha="center", va="bottom", fontsize=7)
    fig.suptitle(
        f"{capture.model or 'attention'}: {T} tokens; rows query, columns key; colour sqrt(weight)",
        fontsize=9,
        y=1 - 0.08 / (height + top),
        va="top",
    )
    # Big grids (many layers or heads) are saved at a lower resolution: at most 2400 px a side.
    return _save(fig, path, dpi=min(_DPI, 2400 / max(width, height + top)))


def save_head(capture: AttentionCapture, layer: int, head: int, path: str | Path) -> Path:
    """Draw one head's weights with token labels (queries down, keys across) and save it as PNG.

    `layer` and `head` are model indices, as in `capture.layers` / `capture.heads`.
    """
    _check(capture)
    Figure, FigureCanvasAgg, PowerNorm = _mpl()
    w = capture.head(layer, head).detach().float().cpu().numpy()  # (T, T)
    T = w.shape[0]
    side = min(16.0, max(5.0, 1.8 + 0.16 * T))
    fig = Figure(figsize=(side + 1.2, side), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(w, cmap=_cmap(), norm=PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0), interpolation="nearest")
    step = max(1, math.ceil(T / 80))  # at most ~80 labels an axis stay readable
    ticks = list(range(0, T, step))
    labels = [_label(capture.tokens[t]) for t in ticks]
    fontsize = 8 if T <= 40 else 6
    ax.set_xticks(ticks, labels, rotation=90, fontsize=fontsize)
    ax.set_yticks(ticks, labels, fontsize=fontsize)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(f"{capture.model or 'attention'}: layer {layer} head {head}", fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8, label="weight (sqrt scale)")
    return _save(fig, path)


def _max_pool(w, size: int):
    """`(..., T, T)` -> `(..., P, P)` with P = ceil(T / ceil(T / size)): each cell the max of its block."""
    import numpy as np

    T = w.shape[-1]
    b = max(1, math.ceil(T / max(size, 1)))
    if b == 1:
        return w
    P = math.ceil(T / b)
    pad = P * b - T
    w = np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, pad), (0, pad)])  # (..., P*b, P*b)
    w = w.reshape(*w.shape[:-2], P, b, P, b)  # (..., P, b, P, b)
    return w.max(axis=(-3, -1))


def _cmap():
    import matplotlib

    return matplotlib.colormaps[_CMAP].with_extremes(bad="white")  # bad: the gaps between tiles


def _mpl():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import PowerNorm
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("PNG output needs matplotlib: pip install 'multihead[viz]' (from a checkout of the "
                          "repository: pip install -e '.[viz]')") from e
    return Figure, FigureCanvasAgg, PowerNorm


def _check(capture) -> None:
    if not isinstance(capture, AttentionCapture):
        raise TypeError(f"capture must be an AttentionCapture; received {type(capture).__name__}")
    if len(capture.tokens) == 0:
        raise ValueError("capture has no tokens; nothing to draw")


def _label(token: str) -> str:
    # `$` would start matplotlib mathtext; control characters would break the layout.
    text = str(token).replace("$", r"\$").replace("\n", "\\n").replace("\t", "\\t")
    text = text or "\u2205"
    return text if len(text) <= 16 else text[:15] + "\u2026"


def _save(fig, path: str | Path, dpi: float = _DPI) -> Path:
    """Write atomically (a temporary file moved over `path`), so a failed draw never leaves a
    truncated PNG, with the usual file mode."""
    from multihead.files import atomic_path

    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path
