"""Shared checks for the lab tests (not a test module)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load_results(folder: Path, required=()) -> dict:
    from multihead.lab.results import check_results

    obj = json.loads((Path(folder) / "results.json").read_text(encoding="utf-8"))
    return check_results(obj, folder, required=required)


def assert_png(path: Path) -> None:
    """A real, non-blank PNG: the right signature and pixels that are not all one colour."""
    import matplotlib.image as mpimg

    path = Path(path)
    assert path.is_file(), f"missing plot {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    img = np.asarray(mpimg.imread(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, f"{path}: image shape {img.shape}"
    assert float(img[..., :3].var()) > 1e-4, f"{path}: blank image (pixel variance {img[..., :3].var():.2e})"


def numbers(obj, skip=("date", "elapsed_s", "seconds", "tokens_per_s", "machine")):
    """Every number of a results object except timings, for same-seed comparisons."""
    if isinstance(obj, dict):
        return {k: numbers(v, skip) for k, v in obj.items() if k not in skip}
    if isinstance(obj, list):
        return [numbers(v, skip) for v in obj]
    return obj
