"""Gradients: gradcheck on the explicit path, fused == explicit, no NaN for empty rows."""

import pytest
import torch

import multihead as mh
from conftest import assert_close


def _inputs(B=2, H=4, Hkv=2, T=3, S=5, D=3, Dv=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    make = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(B, H, T, D), make(B, Hkv, S, D), make(B, Hkv, S, Dv)


@pytest.mark.parametrize("backend", ["math", "chunked"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_explicit_paths(backend, causal):
    q, k, v = _inputs()
    mask = torch.rand(2, 1, 3, 5) > 0.3
    mask[0, 0, 1] = False  # an empty row

    def f(q, k, v):
        return mh.scaled_dot_product_attention(q, k, v, mask, causal=causal, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v)) if backend == "math" else True


def test_gradcheck_float_mask_and_weights():
    q, k, v = _inputs()
    fmask = torch.randn(1, 4, 3, 5, dtype=torch.float64)

    def f(q, k, v):
        out, w = mh.attend(q, k, v, fmask, backend="math", return_weights=[0, 2])
        return out, w

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["plain", "causal_decode", "causal_prefill_gqa", "mask_heads", "empty_rows"])
def test_sdpa_gradients_equal_math_gradients(dtype, case):
    B, H, Hkv, T, S = 2, 8, 2, (1 if case == "causal_decode" else 6), 6
    q, k, v = _inputs(B, H, Hkv, T, S, 8, 4, dtype)
    mask, causal = None, case.startswith("causal")
    if case == "mask_heads":
        mask = torch.rand(B, H, T, S) > 0.3
    if case == "empty_rows":
        mask = torch.rand(B, 1, T, S) > 0.3
        mask[:, :, 2] = False
    grads = {}
    for backend in ("math", "sdpa"):
        out = mh.scaled_dot_product_attention(q, k, v, mask, causal=causal, backend=backend)
        g_out = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
        grads[backend] = torch.autograd.grad(out, (q, k, v), g_out)
    for name, gm, gs in zip("qkv", grads["math"], grads["sdpa"]):
        assert_close(gs, gm, dtype, what=f"d{name} {case}")


@pytest.mark.parametrize("backend", ["math", "sdpa", "chunked"])
def test_no_nan_gradient_for_fully_masked_rows(backend):
    q, k, v = _inputs(dtype=torch.float32)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[:, :, 0] = False  # query 0 may attend nothing
    out = mh.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    out.square().sum().backward()
    for name, t in zip("qkv", (q, k, v)):
        assert torch.isfinite(t.grad).all(), f"d{name} has NaN/inf"
    assert (q.grad[:, :, 0] == 0).all()  # the empty row gets no gradient
    assert (out[:, :, 0] == 0).all()


def test_no_nan_gradient_for_all_minus_inf_float_mask():
    q, k, v = _inputs(dtype=torch.float32)
    fmask = torch.zeros(1, 1, 3, 5)
    fmask[..., 1, :] = float("-inf")
    for backend in ("math", "sdpa", "chunked"):
        for t in (q, k, v):
            t.grad = None
        out = mh.scaled_dot_product_attention(q, k, v, fmask, backend=backend)
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), backend
        assert (out[:, :, 1] == 0).all(), backend
