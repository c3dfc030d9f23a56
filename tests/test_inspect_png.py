"""PNG heatmaps: the files exist, have a sensible size, are not blank, and their colours
follow the weights (a diagonal head draws a bright diagonal, an anti-diagonal the other)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from inspect_synthetic import previous_token, synthetic_capture
from multihead.inspect import AttentionCapture, HeadRole

pytest.importorskip("matplotlib", reason="PNG output needs matplotlib (pip install 'multihead[viz]')")
from matplotlib.image import imread  # noqa: E402

from multihead.inspect.png import save_grid, save_head  # noqa: E402


def _one_head(w: torch.Tensor, tokens=None) -> AttentionCapture:
    T = w.shape[-1]
    return AttentionCapture(
        tokens=tokens or [f"t{i}" for i in range(T)],
        token_ids=list(range(T)),
        layers=[0],
        heads=[0],
        weights=w.reshape(1, 1, T, T),
        n_layers=1,
        n_heads=1,
        model="synthetic",
    )


def _read(path) -> np.ndarray:
    image = imread(path)  # (height, width, 3 or 4) floats in [0, 1]
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    return image[..., :3]


def _bright(image: np.ndarray) -> np.ndarray:
    """Pixels near the top of viridis (yellow: high red and green, low blue)."""
    r, g, b = image[..., 0], image[..., 1], image[..., 2]
    return (r > 0.8) & (g > 0.75) & (b < 0.4)


def _slope_sign(mask: np.ndarray) -> float:
    """Correlation of x and y over the bright pixels: +1 for a top-left to bottom-right line."""
    ys, xs = np.nonzero(mask)
    assert len(xs) > 20, f"only {len(xs)} bright pixels"
    return float(np.corrcoef(xs, ys)[0, 1])


def _without_colorbar(mask: np.ndarray) -> np.ndarray:
    """Drop the rightmost run of columns that hold bright pixels: the colourbar's top."""
    cols = np.flatnonzero(mask.any(axis=0))
    runs = np.split(cols, np.flatnonzero(np.diff(cols) > 1) + 1)
    out = mask.copy()
    out[:, runs[-1]] = False
    return out


def test_grid_png(tmp_path):
    cap = synthetic_capture(L=2, H=3, T=10)
    roles = [HeadRole(0, 1, {"previous_token": 1.0}, "previous_token", 1.0)]
    path = save_grid(cap, tmp_path / "grid.png", roles=roles)
    image = _read(path)
    height, width = image.shape[:2]
    assert 300 <= width <= 2500 and 250 <= height <= 2500, f"grid is {width}x{height}"
    assert image.var() > 0.01, "grid looks blank"


@pytest.mark.parametrize("flip, sign", [(False, 1), (True, -1)])
def test_grid_colours_follow_the_weights(tmp_path, flip, sign):
    w = torch.eye(12).flip(1) if flip else torch.eye(12)
    image = _read(save_grid(_one_head(w), tmp_path / "diag.png"))
    bright = _bright(image)
    assert sign * _slope_sign(bright) > 0.95, "the bright cells do not lie on the weights' diagonal"
    # The bright cells cover about 12 of the 144 cells of the tile, nothing else is bright.
    tile = bright.any(axis=0).sum() * bright.any(axis=1).sum()
    assert 0.04 < bright.sum() / tile < 0.15


def test_grid_of_a_long_text_keeps_a_sharp_head_visible(tmp_path):
    cap = synthetic_capture(L=2, H=4, T=512, sharpness=3.0, prev_head=(0, 0))
    image = _read(save_grid(cap, tmp_path / "long.png"))
    height, width = image.shape[:2]
    assert width <= 2500 and height <= 2500
    first_tile = image[: height // 2, : width // 4]  # layer 0 head 0: the previous-token head
    assert _slope_sign(_bright(first_tile)) > 0.95, "the max-pooled previous-token line is not visible"


def test_head_png(tmp_path):
    w = previous_token(10)
    tokens = ["[CLS]", "$x$", "cat", "a\\$", "<b>", "\n", "", "sat", "on", "[SEP]"]  # mathtext and odd text
    path = save_head(_one_head(w, tokens), 0, 0, tmp_path / "head.png")
    image = _read(path)
    height, width = image.shape[:2]
    assert 400 <= width <= 1800 and 400 <= height <= 1800, f"head is {width}x{height}"
    assert image.var() > 0.01
    assert _slope_sign(_without_colorbar(_bright(image))) > 0.95


def test_head_png_grows_with_the_text(tmp_path):
    small = _read(save_head(synthetic_capture(L=1, H=1, T=8, prev_head=None), 0, 0, tmp_path / "a.png"))
    big = _read(save_head(synthetic_capture(L=1, H=1, T=60, prev_head=None), 0, 0, tmp_path / "b.png"))
    assert big.shape[0] > small.shape[0] and big.shape[1] > small.shape[1]
    assert big.shape[0] <= 1800


def test_head_png_bad_head(tmp_path):
    with pytest.raises(ValueError, match=r"head 7 was not captured; captured: \[0, 1, 2\]"):
        save_head(synthetic_capture(), 0, 7, tmp_path / "x.png")


def test_views_import_no_matplotlib():
    code = "import sys, multihead.inspect.png, multihead.inspect.html; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
