"""Synthetic AttentionCaptures and a Python decoder of the HTML view's data, shared by the
inspect view tests (test_inspect_html, test_inspect_png, test_inspect_browser)."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import torch

from multihead.inspect.capture_types import AttentionCapture


def previous_token(T: int) -> torch.Tensor:
    """`(T, T)` weights of a perfect previous-token head (token 0 attends to itself)."""
    w = torch.zeros(T, T)
    w[0, 0] = 1.0
    w[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    return w


def synthetic_capture(
    L: int = 2,
    H: int = 3,
    T: int = 8,
    *,
    tokens: list[str] | None = None,
    seed: int = 0,
    sharpness: float = 2.0,
    prev_head: tuple[int, int] | None = (0, 1),
    model: str = "synthetic",
) -> AttentionCapture:
    """Softmax of random scores, `(L, H, T, T)`; head `prev_head` (by position) is a
    previous-token head."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(L, H, T, T, generator=g) * sharpness, dim=-1)  # (L, H, T, T)
    if prev_head is not None:
        weights[prev_head] = previous_token(T)
    tokens = tokens if tokens is not None else [f"tok{i}" for i in range(T)]
    return AttentionCapture(
        tokens=tokens,
        token_ids=list(range(100, 100 + T)),
        layers=list(range(L)),
        heads=list(range(H)),
        weights=weights,
        n_layers=L,
        n_heads=H,
        model=model,
    )


def page_data(page: str) -> dict:
    """The JSON embedded in a rendered page."""
    m = re.search(r'<script id="mh-data" type="application/json">(.*?)</script>', page, re.S)
    assert m, "no data block in the page"
    return json.loads(m.group(1))


def decode_weights(data: dict) -> np.ndarray:
    """`(L, H, T, T)` float64 weights from the page data, written from the documented format
    (html._encode), independently of the encoder."""
    L, H, T, K = len(data["layers"]), len(data["heads"]), data["T"], data["k"]
    q = np.frombuffer(base64.b64decode(data["q"]), dtype=np.uint8).reshape(L, H, T, K)
    scale = np.frombuffer(base64.b64decode(data["scale"]), dtype="<f4").reshape(L, H, T)
    values = q.astype(np.float64) / 255.0 * scale[..., None].astype(np.float64)  # (L, H, T, K)
    if data["dense"]:
        assert data["idx"] is None and K == T
        return values
    dtype = {1: np.uint8, 2: "<u2"}[data["idx_bytes"]]
    idx = np.frombuffer(base64.b64decode(data["idx"]), dtype=dtype).reshape(L, H, T, K).astype(np.int64)
    out = np.zeros((L, H, T, T))
    np.put_along_axis(out, idx, values, axis=-1)
    return out


def decode_indices(data: dict) -> np.ndarray | None:
    """`(L, H, T, K)` key indices of the kept entries, None for a dense page."""
    if data["dense"]:
        return None
    L, H, T, K = len(data["layers"]), len(data["heads"]), data["T"], data["k"]
    dtype = {1: np.uint8, 2: "<u2"}[data["idx_bytes"]]
    return np.frombuffer(base64.b64decode(data["idx"]), dtype=dtype).reshape(L, H, T, K).astype(np.int64)
