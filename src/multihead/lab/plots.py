"""matplotlib for the lab, optional: imported lazily on the Agg backend; without it the
plots are skipped with a note in results.json and the numbers and checkpoint are kept."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from multihead.files import atomic_path

__all__ = ["PlotsUnavailable", "distinct_colours", "draw_plots", "pyplot", "save_figure"]


class PlotsUnavailable(ImportError):
    """matplotlib cannot be imported: the plots are skipped, the numbers are kept."""


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (imported lazily)."""
    try:
        import matplotlib
    except ImportError as err:
        raise PlotsUnavailable("plots skipped: matplotlib is not installed (pip install matplotlib; in a multihead "
                               "checkout, pip install -e '.[lab]')") from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 110, "axes.grid": True, "grid.alpha": 0.3,
                         "axes.spines.top": False, "axes.spines.right": False, "font.size": 10})
    return plt


def distinct_colours(n: int) -> list[tuple]:
    """n colours no two of which are the same: tab10 up to 10, tab20 up to 20 (16 heads
    drawn from tab10 repeated 6 of its colours), then evenly spaced hues of turbo."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        # tab20 orders dark/light pairs; all the dark ones first keeps the first 10 as tab10's
        return [colormaps["tab20"](2 * i if i < 10 else 2 * (i - 10) + 1) for i in range(n)]
    return [colormaps["turbo"](i / (n - 1)) for i in range(n)]


def save_figure(fig, path: Path) -> str:
    """Save (atomically, like results.json) and close; return the file name."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", bbox_inches="tight")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path.name


def draw_plots(res: dict, makers: Iterable[Callable[[], str]]) -> None:
    """Draw each plot (a function returning its file name) into res["plots"].

    Called after results.json and the checkpoint are written, so a missing matplotlib
    costs the plots only: they are skipped with one note in res["notes"] (which the
    command prints).
    """
    plots = []
    try:
        for make in makers:
            plots.append(make())
    except PlotsUnavailable as err:
        res.setdefault("notes", []).append(str(err))
    res["plots"] = plots
