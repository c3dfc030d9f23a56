"""The (layers, heads) table of a scan as text, as a heat map PNG (matplotlib) and as a
self-contained HTML table coloured by each cell's distance from a baseline (the corrupted
metric). One home for `multihead heads scan` and `multihead heads path`."""

from __future__ import annotations

from html import escape
from pathlib import Path

from multihead.files import atomic_path, write_text

__all__ = ["heat_html", "heat_png", "text_table"]


def text_table(table: list[list]) -> str:
    """The table as aligned text: a header of head indices, one row per layer, blanks for None."""
    n = max(len(row) for row in table)
    lines = ["layer " + "".join(f"{h:>9}" for h in range(n))]
    for i, row in enumerate(table):
        lines.append(f"{i:>5} " + "".join(f"{'':>9}" if x is None else f"{x:>9.3f}" for x in row))
    return "\n".join(lines)


def heat_png(path: Path, table: list[list], center: float, title: str, *, xlabel: str = "head",
             ylabel: str = "layer") -> None:
    """`table` (rows of floats or None) minus `center`, red above and blue below, as a PNG."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    a = np.array([[np.nan if x is None else x for x in row] for row in table], dtype=float) - center
    lim = float(np.nanmax(np.abs(a))) or 1.0
    fig = Figure(figsize=(1.5 + 0.45 * a.shape[1], 1 + 0.4 * a.shape[0]))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(a, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="metric - corrupted")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")


def heat_html(path: Path, table: list[list], center: float, page_title: str, caption: str) -> None:
    """The table as HTML cells shaded by |value - center|; `caption` is escaped here."""
    vals = [abs(x - center) for row in table for x in row if x is not None]
    lim = max(vals) if vals and max(vals) > 0 else 1.0
    rows = []
    for i, row in enumerate(table):
        tds = []
        for x in row:
            if x is None:
                tds.append("<td></td>")
                continue
            t = (x - center) / lim
            color = f"rgba(178,24,43,{t:.3f})" if t > 0 else f"rgba(33,102,172,{-t:.3f})"
            tds.append(f'<td style="background:{color}">{x:.3f}</td>')
        rows.append(f"<tr><th>{i}</th>{''.join(tds)}</tr>")
    head = "".join(f"<th>{h}</th>" for h in range(max(len(row) for row in table)))
    doc = (f"<!doctype html><meta charset=utf-8><title>{escape(page_title)}</title>"
           f"<style>td,th{{padding:3px 6px;font:12px monospace;text-align:right}}</style>"
           f"<p>{escape(caption)}</p><table><tr><th>layer \\ head</th>{head}</tr>{''.join(rows)}</table>")
    write_text(path, doc)
