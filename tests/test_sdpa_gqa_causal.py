"""The "sdpa" backend's causal GQA call without a mask or gradient: one fused call with
torch's own GQA (no copy of K/V), bit-equal to the per-group calls a recorded graph keeps,
and equal to the NumPy float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multihead import reference as R
from multihead.kernels import sdpa as S


@pytest.mark.parametrize("H, Hkv", [(9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("T", [2, 33, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_equals_the_per_group_calls_bit_for_bit_and_the_reference(H, Hkv, T, dtype, monkeypatch):
    g = torch.Generator().manual_seed(T + H)
    q, k, v = (torch.randn(2, n, T, 16, generator=g).to(dtype) for n in (H, Hkv, Hkv))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw.get("enable_gqa", False)) or real(*a, **kw))
    fast, _ = S.sdpa(q, k, v, None, causal=True, scale=0.25, dropout_p=0.0, weight_heads=None)
    assert calls == [True]
    calls.clear()
    looped, _ = S.sdpa(q.requires_grad_(), k, v, None, causal=True, scale=0.25, dropout_p=0.0, weight_heads=None)
    assert calls == [False] * (H // Hkv)  # a recorded graph keeps the per-group calls (their backward)
    assert torch.equal(fast, looped.detach())
    ref = R.attention(*(t.detach().double().numpy() for t in (q, k, v)), causal=True, scale=0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    np.testing.assert_allclose(fast.double().numpy(), ref, rtol=tol, atol=tol)
