"""The kernel against the NumPy float64 reference: reference == math == sdpa == chunked."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from conftest import assert_close
from multihead import masks
from multihead import reference as R

BACKENDS = ["math", "sdpa", "chunked"]


@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 4]))
    T = draw(st.integers(1, 9))
    S = draw(st.integers(1, 11))
    D = draw(st.sampled_from([1, 4, 8]))
    Dv = draw(st.sampled_from([2, 4, 5]))
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "bool_heads", "bool_empty_rows", "float_inf"]))
    causal = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return B, Hkv * G, Hkv, T, S, D, Dv, mask_kind, causal, seed


def make(B, H, Hkv, T, S, D, Dv, mask_kind, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, T, S, generator=g) > 0.3
    elif mask_kind == "bool_heads":
        mask = torch.rand(B, H, T, S, generator=g) > 0.4
    elif mask_kind == "bool_empty_rows":
        mask = torch.rand(B, 1, T, S, generator=g) > 0.3
        mask[:, :, 0] = False  # the first query of every sequence may attend nothing
    elif mask_kind == "float":
        mask = torch.randn(1, H, T, S, generator=g, dtype=torch.float64)
    elif mask_kind == "float_inf":
        mask = torch.where(torch.rand(B, 1, T, S, generator=g) > 0.3, 0.0, float("-inf")).double()
        mask[..., -1, :] = float("-inf")
    cast = (lambda t: t.to(dtype)) if dtype != torch.float64 else (lambda t: t)
    fmask = mask if mask is None or mask.dtype == torch.bool else cast(mask)
    return cast(q), cast(k), cast(v), fmask, (q, k, v, mask)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_backends_equal_reference_float64(p):
    B, H, Hkv, T, S, D, Dv, mask_kind, causal, seed = p
    q, k, v, mask, _ = make(B, H, Hkv, T, S, D, Dv, mask_kind, seed)
    ref_out, ref_w = R.attention(q.numpy(), k.numpy(), v.numpy(),
                                 mask=None if mask is None else mask.numpy(), causal=causal, return_weights=True)
    for backend in BACKENDS:
        out, w = mh.attend(q, k, v, mask, causal=causal, backend=backend,
                           return_weights=True)
        assert_close(out, ref_out, what=f"{backend} out {p}")
        assert_close(w, ref_w, what=f"{backend} weights {p}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind,causal", [("none", False), ("bool_empty_rows", True), ("float", False),
                                              ("bool_heads", True)])
def test_backends_low_precision(dtype, backend, mask_kind, causal):
    B, H, Hkv, T, S, D, Dv = 2, 8, 2, 7, 12, 16, 8
    q, k, v, mask, (q64, k64, v64, m64) = make(B, H, Hkv, T, S, D, Dv, mask_kind, 3, dtype=dtype)
    ref = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                      mask=None if m64 is None else (m64 if m64.dtype == torch.bool else mask.double()).numpy(),
                      causal=causal)
    out = mh.scaled_dot_product_attention(q, k, v, mask, causal=causal, backend=backend)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, what=f"{backend} {dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_bottom_right_with_more_keys(backend):
    # decoding: 3 new queries over 8 keys; query i sees keys j <= i + 5
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    _, w = mh.attend(q, k, v, causal=True, backend=backend, return_weights=True)
    allowed = torch.arange(8)[None, :] <= torch.arange(3)[:, None] + 5
    assert (w[0, 0][~allowed] == 0).all()
    assert torch.allclose(w.sum(-1), torch.ones(1, 2, 3))
    # torch's is_causal aligns top-left: it would hide keys 1..7 from query 0
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = mh.scaled_dot_product_attention(q, k, v, causal=True, backend=backend)
    assert (out - top_left).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_more_queries_than_keys_gives_zero_rows(backend):
    # T > S bottom-right: the first T - S queries have no key at all
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    out, w = mh.attend(q, k, v, causal=True, backend=backend, return_weights=True)
    assert (out[:, :, :2] == 0).all() and (w[:, :, :2] == 0).all()
    ref = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True)
    assert_close(out, ref, what=backend)


def test_weights_for_a_subset_of_heads():
    q, k, v = torch.randn(2, 8, 6, 4), torch.randn(2, 2, 9, 4), torch.randn(2, 2, 9, 4)
    mask = masks.causal()
    _, w_all = mh.attend(q, k, v, mask, return_weights=True)
    for backend in BACKENDS:
        out, w = mh.attend(q, k, v, mask, return_weights=[5, 1, -1], backend=backend)
        assert w.shape == (2, 3, 6, 9)
        assert_close(w, w_all[:, [5, 1, 7]], what=backend)
        assert_close(out, mh.scaled_dot_product_attention(q, k, v, mask), what=backend)


def test_weights_subset_does_not_compute_other_heads(monkeypatch):
    """Asking one head's weights runs the weight pass over that head only."""
    from multihead.kernels import math as explicit_math

    seen = []
    real = explicit_math.weights_pass

    def spy(q, k, mask, causal, scale, heads, **kw):
        seen.append(heads)
        result = real(q, k, mask, causal, scale, heads, **kw)
        seen.append(tuple(result.shape))
        return result

    monkeypatch.setattr(explicit_math, "weights_pass", spy)  # records the shape of each weights pass
    q, k, v = torch.randn(1, 8, 16, 4), torch.randn(1, 8, 16, 4), torch.randn(1, 8, 16, 4)
    mh.attend(q, k, v, return_weights=[3])
    assert seen == [(3,), (1, 1, 16, 16)]


def test_each_kernel_function_returns_one_type():
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    out = mh.scaled_dot_product_attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    for asked in (False, True, [1]):
        pair = mh.attend(q, k, v, causal=True, return_weights=asked)
        assert type(pair) is tuple and len(pair) == 2 and torch.equal(pair[0], out)
        assert (pair[1] is None) == (asked is False)
    with pytest.raises(TypeError, match="return_weights"):
        mh.scaled_dot_product_attention(q, k, v, return_weights=True)  # the weights come from attend


def test_attention_weights_function_matches_reference():
    q, k = torch.randn(2, 4, 5, 8, dtype=torch.float64), torch.randn(2, 2, 7, 8, dtype=torch.float64)
    m = torch.rand(2, 1, 5, 7) > 0.2
    w = mh.attention_weights(q, k, m, causal=True, heads=[0, 3])
    _, ref_w = R.attention(q.numpy(), k.numpy(), np.zeros((2, 2, 7, 1)), mask=m.numpy(), causal=True,
                           return_weights=True)
    assert_close(w, ref_w[:, [0, 3]])


def test_mask_predicates_equal_dense_masks():
    B, H, T, S = 2, 4, 5, 9
    q, k, v = torch.randn(B, H, T, 8, dtype=torch.float64), torch.randn(B, 2, S, 8, dtype=torch.float64), \
        torch.randn(B, 2, S, 3, dtype=torch.float64)
    lengths = torch.tensor([9, 6])
    mod = masks.sliding_window(3) & masks.padding(lengths)
    dense = mod.to_dense(B, H, T, S)
    out = mh.scaled_dot_product_attention(q, k, v, mod)
    qpos = np.arange(T)[:, None] + S - T
    kv = np.arange(S)[None, :]
    ref_mask = ((kv <= qpos) & (qpos - kv < 3))[None, None] & (kv < lengths.numpy()[:, None, None, None])
    assert (dense.numpy() == ref_mask).all()
    assert_close(out, R.attention(q.numpy(), k.numpy(), v.numpy(), mask=ref_mask))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_is_applied_and_unbiased(backend):
    q, k, v = torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 2000, 4), torch.ones(1, 1, 2000, 4)
    out = mh.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
    # uniform weights 1/S; half the keys dropped, the rest scaled by 2: the mean stays ~1
    assert 0.9 < out.mean().item() < 1.1
    assert out.std().item() < 0.2
    out0 = mh.scaled_dot_product_attention(q, k, v, dropout_p=0.0, backend=backend)
    assert torch.allclose(out0, torch.ones_like(out0), atol=1e-4)


def test_auto_resolution_is_visible():
    assert mh.resolve_backend(want_weights=False, dropout_p=0.0) == "sdpa"
    assert mh.resolve_backend(want_weights=True, dropout_p=0.0) == "sdpa"
    assert mh.resolve_backend(want_weights=True, dropout_p=0.1) == "math"
    # torch's CPU kernel has no fused dropout (it falls back to O(N^2) math): the tile engine
    assert mh.resolve_backend(want_weights=False, dropout_p=0.1, device="cpu") == "tiles"
    assert mh.resolve_backend(want_weights=False, dropout_p=0.1, device="cuda") == "sdpa"
    assert set(mh.available_backends()) >= {"math", "sdpa", "chunked"}


def test_chunked_bounds_memory_by_blocks(monkeypatch):
    from multihead.kernels import math as kmath

    monkeypatch.setattr(kmath, "BLOCK_ELEMENTS", 2 * 4 * 16)  # two query rows per block
    q, k, v = torch.randn(1, 4, 7, 8, dtype=torch.float64), torch.randn(1, 4, 16, 8, dtype=torch.float64), \
        torch.randn(1, 4, 16, 8, dtype=torch.float64)
    assert kmath.block_rows(1, 4, 16) == 2
    out, w = mh.attend(q, k, v, causal=True, backend="chunked", return_weights=True)
    ref, ref_w = R.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, return_weights=True)
    assert_close(out, ref)
    assert_close(w, ref_w)


def test_gqa_fast_path_does_not_copy_kv(monkeypatch):
    """The sdpa backend hands K/V to torch's kernel as they are (same storage), never repeated
    (the decode step on torch's kernel: the native engine reads them in place by its strides)."""
    from multihead.kernels import machine_plan, set_machine_plan

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((tuple(q.shape), k.data_ptr(), tuple(k.shape), v.data_ptr()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    before = set_machine_plan(machine_plan().with_choices(decode_engine="flash"))
    try:
        q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
        mh.scaled_dot_product_attention(q, k, v, causal=True)  # decode: 8 heads fold onto 2 KV heads
        assert seen == [((2, 2, 4, 16), k.data_ptr(), (2, 2, 50, 16), v.data_ptr())]
        seen.clear()
        q = torch.randn(2, 8, 50, 16)
        mh.scaled_dot_product_attention(q, k, v, causal=True)  # prefill: one call, torch's own GQA
        assert seen == [((2, 8, 50, 16), k.data_ptr(), (2, 2, 50, 16), v.data_ptr())]
        seen.clear()
        mh.scaled_dot_product_attention(q.requires_grad_(), k, v, causal=True)  # with a graph: one per group position
        assert len(seen) == 4 and all(s[1] == k.data_ptr() and s[2] == (2, 2, 50, 16) for s in seen)
    finally:
        set_machine_plan(before)


# ------------------------------------------------------------------ NaN rule


def _rule_reference(q, k, v, mask, causal):
    """The documented NaN rule, from the float64 reference on NaN-free inputs: a row with no
    key is 0; otherwise NaN iff its query, or a key/value it may attend, holds a NaN."""
    clean = [np.nan_to_num(t.numpy(), nan=0.0) for t in (q, k, v)]
    m = None if mask is None else mask.numpy()
    out = R.attention(*clean, mask=m, causal=causal)
    B, H, T, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    allowed = np.ones((B, H, T, S), bool)
    if m is not None:
        allowed &= m if m.dtype == bool else ~np.isneginf(np.broadcast_to(m, allowed.shape))
    if causal:
        allowed &= R.causal_mask(T, S)
    nan_k = np.repeat(np.isnan(k.numpy()).any(-1), H // Hkv, 1)[:, :, None, :]  # (B, H, 1, S)
    nan_v = np.repeat(np.isnan(v.numpy()).any(-1), H // Hkv, 1)[:, :, None, :]
    nan_rows = np.isnan(q.numpy()).any(-1) | (allowed & (nan_k | nan_v)).any(-1)
    out[nan_rows & allowed.any(-1)] = np.nan
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.lists(st.tuples(st.sampled_from("qkv"), st.integers(0, 10**6)), min_size=1, max_size=3))
def test_nan_rule_is_the_same_in_every_backend(p, nans):
    B, H, Hkv, T, S, D, Dv, mask_kind, causal, seed = p
    q, k, v, mask, _ = make(B, H, Hkv, T, S, D, Dv, mask_kind, seed)
    tensors = {"q": q, "k": k, "v": v}
    for name, where in nans:
        t = tensors[name].view(-1)
        t[where % t.numel()] = float("nan")
    expect = _rule_reference(q, k, v, mask, causal)
    for backend in [*BACKENDS, "tiles"]:
        out = mh.scaled_dot_product_attention(q, k, v, mask, causal=causal, backend=backend).numpy()
        assert (np.isnan(out) == np.isnan(expect)).all(), (backend, p, nans, np.isnan(out).sum(),
                                                           np.isnan(expect).sum())
        ok = ~np.isnan(expect)
        assert np.allclose(out[ok], expect[ok], atol=1e-10), backend


def test_nan_in_a_hidden_key_or_value_has_no_effect():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    k[0, 0, 5, 0] = float("nan")  # key 5 is hidden from queries 0..2 by causality (positions 2..5)
    v[0, 1, 4, 0] = float("nan")  # value 4 is hidden from queries 0..1
    for backend in [*BACKENDS, "tiles"]:
        out = mh.scaled_dot_product_attention(q, k, v, causal=True, backend=backend)
        assert torch.isfinite(out[0, 0, :3]).all() and torch.isnan(out[0, 0, 3]).all(), backend
        assert torch.isfinite(out[0, 1, :2]).all() and torch.isnan(out[0, 1, 2:]).all(), backend
        clean = mh.scaled_dot_product_attention(q, k.nan_to_num(), v.nan_to_num(), causal=True, backend="math")
        assert_close(out[0, 0, :3], clean[0, 0, :3], what=backend)


# ----------------------------------------------------------- empty problems


@pytest.mark.parametrize("backend", [*BACKENDS, "tiles"])
@pytest.mark.parametrize("shape", [(0, 4, 3, 5), (2, 4, 0, 5), (2, 4, 3, 0)])
def test_empty_batch_queries_or_keys(backend, shape):
    B, H, T, S = shape
    q = torch.randn(B, H, T, 8, requires_grad=True)
    k, v = torch.randn(B, 2, S, 8, requires_grad=True), torch.randn(B, 2, S, 3, requires_grad=True)
    for mask in (None, masks.causal(), masks.sliding_window(2)):
        out, w = mh.attend(q, k, v, mask, causal=True, backend=backend, return_weights=True)
        assert out.shape == (B, H, T, 3) and w.shape == (B, H, T, S)
        assert (out == 0).all() and (w == 0).all()  # S = 0: no key to attend, rows are zero
        out.sum().backward()
        assert q.grad.shape == q.shape and (q.grad == 0).all()


# ------------------------------------------------------------------- scale


@pytest.mark.parametrize("scale", [np.float64(0.3), np.float32(0.3), np.array(0.3), torch.tensor(0.3),
                                   torch.tensor([0.3], dtype=torch.float64), 0.3])
def test_scale_accepts_numpy_and_tensor_scalars(scale):
    q, k, v = torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64), \
        torch.randn(1, 2, 5, 4, dtype=torch.float64)
    out = mh.scaled_dot_product_attention(q, k, v, scale=scale)
    assert_close(out, R.attention(q.numpy(), k.numpy(), v.numpy(), scale=float(scale)), torch.float32)


def test_weights_carry_gradients_on_the_explicit_backends_only_as_documented():
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 8, dtype=torch.float64)
    for backend, differentiable in [("math", True), ("chunked", True), ("sdpa", False), ("auto", False)]:
        _, w = mh.attend(q, k, v, return_weights=True, backend=backend)
        assert w.requires_grad is differentiable, backend
    _, w = mh.attend(q, k, v, return_weights=True, backend="math")
    (g,) = torch.autograd.grad(w[..., 0].sum(), q)
    ref = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 8 ** 0.5, -1)[..., 0].sum()
    (g_ref,) = torch.autograd.grad(ref, q)
    assert torch.allclose(g, g_ref, atol=1e-12)


def test_attention_weights_needs_no_values():
    q, k = torch.randn(2, 4, 3, 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64)
    w = mh.attention_weights(q, k, causal=True, heads=[1, 3])
    ref = R.attention(q.numpy(), k.numpy(), k.numpy(), causal=True, return_weights=True)[1][:, [1, 3]]
    assert_close(w, ref)
