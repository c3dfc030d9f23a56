"""`kernels.common.eager`, the formula written out once (fold the G query heads, scores,
masked softmax, values): the NumPy float64 reference equals it, and every backend equals it
in float64 over masks, GQA, causal with S > T and rows with nothing to attend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multihead import attend, reference
from multihead.kernels import common


def _case(B=2, H=4, Hkv=2, T=5, S=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, 6, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, 6, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, 3, generator=g, dtype=torch.float64)
    allowed = torch.rand(B, 1, T, S, generator=g) > 0.4
    allowed[0, 0, 1] = False  # a row with nothing to attend
    return q, k, v, allowed


@pytest.mark.parametrize("backend", ["math", "sdpa", "chunked", "tiles"])
@pytest.mark.parametrize("causal", [False, True])
def test_every_backend_equals_the_eager_twin(backend, causal):
    q, k, v, allowed = _case()
    T, S = q.shape[2], k.shape[2]
    if causal:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril(S - T)
    want, probs = common.eager(q, k, v, 0.5, allowed)
    out, w = attend(q, k, v, allowed, scale=0.5, return_weights=True, backend=backend)
    assert (out - want).abs().max() < 1e-10 and (w - probs).abs().max() < 1e-10
    assert bool((want[0, :, 1] == 0).all()), "a row with nothing to attend is zeros"


def test_the_eager_twin_equals_the_numpy_reference():
    q, k, v, allowed = _case()
    allowed[0, 0, 1] = True  # the reference's empty row is NaN (the textbook's); the kernel's 0
    want, wants = reference.attention(q.numpy(), k.numpy(), v.numpy(), mask=allowed.numpy(), scale=0.5,
                                      return_weights=True)
    out, probs = common.eager(q, k, v, 0.5, allowed)
    assert np.abs(out.numpy() - want).max() < 1e-10 and np.abs(probs.numpy() - wants).max() < 1e-10
