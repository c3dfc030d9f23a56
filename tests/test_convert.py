"""multihead.convert: MHA -> GQA by mean-pooling, MHA -> MLA by truncated SVD, torch interop."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import multihead as mh
from conftest import assert_close
from multihead import convert
from multihead import reference as R

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def params(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _randomize_biases(attn, scale=1.0):
    with torch.no_grad():
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            if lin.bias is not None:
                lin.bias.normal_(0.0, scale)
    return attn


# ----------------------------------------------------------------------- GQA


@pytest.mark.parametrize("n_kv_heads", [8, 2])
@pytest.mark.parametrize("rope", [False, True])
def test_to_gqa_keeping_the_heads_is_identical(n_kv_heads, rope):
    attn = _randomize_biases(mh.Attention(32, 8, n_kv_heads, causal=True, rope=rope).double())
    gqa = convert.to_gqa(attn, n_kv_heads)
    assert gqa is not attn and gqa.n_kv_heads == n_kv_heads
    for name, p in attn.state_dict().items():
        assert torch.equal(gqa.state_dict()[name], p), name
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    assert torch.equal(gqa(x), attn(x))


@pytest.mark.parametrize("n_heads,n_kv_from,n_kv_to", [(8, 8, 2), (8, 8, 1), (6, 6, 3), (8, 4, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_to_gqa_mean_pools_each_group(n_heads, n_kv_from, n_kv_to, bias):
    attn = mh.Attention(24, n_heads, n_kv_from, bias=bias, causal=True).double()
    if bias:
        _randomize_biases(attn)
    before = params(attn)
    gqa = convert.to_gqa(attn, n_kv_to)
    D, m = attn.head_dim, n_kv_from // n_kv_to

    def pooled(w):  # (Hkv*D, ...) -> mean over each group of m consecutive heads
        w = w.detach().double().numpy()
        return w.reshape(n_kv_to, m, D, *w.shape[1:]).mean(axis=1).reshape(n_kv_to * D, *w.shape[1:])

    wk, wv = pooled(attn.k_proj.weight), pooled(attn.v_proj.weight)
    bk = pooled(attn.k_proj.bias) if bias else None
    bv = pooled(attn.v_proj.bias) if bias else None
    T = lambda lin: lin.weight.detach().double().numpy().T  # noqa: E731
    b = lambda lin: None if lin.bias is None else lin.bias.detach().double().numpy()  # noqa: E731
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    ref = R.gqa_forward(x.numpy(), T(attn.q_proj), wk.T, wv.T, T(attn.o_proj), n_heads, n_kv_to, causal=True,
                        b_q=b(attn.q_proj), b_k=bk, b_v=bv, b_o=b(attn.o_proj))
    assert_close(gqa(x), ref, what=f"to_gqa {n_kv_from} -> {n_kv_to} vs NumPy with pooled K/V")
    for name, p in before.items():  # the source layer is untouched
        assert torch.equal(attn.state_dict()[name], p), name


def test_to_gqa_result_decodes_with_its_cache():
    attn = mh.Attention(32, 8, causal=True, rope=True).double()
    gqa = convert.to_gqa(attn, 2)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    cache = gqa.new_cache(2, 9)
    assert cache.n_kv_heads == 2
    steps = torch.cat([gqa(x[:, t : t + 1], cache=cache) for t in range(9)], dim=1)
    assert_close(steps, gqa(x), what="converted GQA, cached decode vs full")


def test_to_gqa_keeps_dtype_device_and_mode():
    attn = mh.Attention(16, 4).to(torch.float64).train()
    gqa = convert.to_gqa(attn, 1)
    assert gqa.q_proj.weight.dtype == torch.float64 and gqa.training
    assert not convert.to_gqa(attn.eval(), 2).training


# ----------------------------------------------------------------------- MLA


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_to_mla_at_full_rank_equals_the_original(n_heads, n_kv_heads, bias, causal):
    attn = mh.Attention(16, n_heads, n_kv_heads, bias=bias, causal=causal).double()
    if bias:
        _randomize_biases(attn, scale=3.0)  # a large key bias: dropped exactly, not approximately
    rank = convert.mla_report(attn).max_rank
    mla, report = convert.to_mla(attn, rank, return_report=True)
    assert isinstance(mla, mh.LatentAttention) and mla.kv_rank == rank and report.error == 0.0
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    mask = torch.rand(2, n_heads, 7, 7) > 0.3
    ref, ref_w = attn(x, mask=mask, return_weights=True)
    for absorb in (False, True):
        out, w = mla(x, mask=mask, absorb=absorb, return_weights=True)
        assert_close(out, ref, atol=1e-12, rtol=1e-10, what=f"to_mla full rank, absorb={absorb}")
        assert_close(w, ref_w, atol=1e-12, rtol=1e-10, what="weights")


def test_to_mla_float32_and_fully_masked_rows():
    attn = _randomize_biases(mh.Attention(32, 4))
    mla = convert.to_mla(attn, convert.mla_report(attn).max_rank)
    assert mla.kv_a_proj.weight.dtype == torch.float32
    x = torch.randn(2, 5, 32)
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    keep[1, :, 2] = False  # a query row with no key: zeros before o_proj, in both layers
    assert_close(mla(x, mask=keep), attn(x, mask=keep), what="float32 full rank with an empty row")


def test_to_mla_error_falls_as_rank_grows():
    attn = mh.Attention(32, 4, causal=True, bias=False).double()
    report = convert.mla_report(attn)
    errors = report.errors
    assert report.max_rank == 32 and errors[0] == 1.0 and errors[-1] == 0.0
    assert all(a >= b for a, b in zip(errors, errors[1:])), errors
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    ref = attn(x)
    out_err = []
    for r in (2, 8, 16, 24, 32):
        mla = convert.to_mla(attn, r)
        out_err.append(((mla(x) - ref).norm() / ref.norm()).item())
    assert all(a > b for a, b in zip(out_err, out_err[1:])), out_err
    assert out_err[-1] < 1e-12


@pytest.mark.parametrize("bias", [True, False])
def test_reported_error_is_the_reconstruction_error(bias):
    attn = _randomize_biases(mh.Attention(24, 4, 2, bias=bias)).double()
    for r in (1, 5, 12):
        mla, report = convert.to_mla(attn, r, return_report=True)
        # rebuild [W_k | 0 ; W_v | b_v] from the factors: up (2*Hkv*D, R) @ [down | down_bias]
        D, G = attn.head_dim, attn.n_groups
        up = mla.kv_b_proj.weight.detach().view(attn.n_heads, 2 * D, r)[::G]  # one query head per KV head
        up = torch.cat([up[:, :D], up[:, D:]]).reshape(-1, r)  # keys of every KV head, then values
        down = mla.kv_a_proj.weight.detach()
        if bias:
            down = torch.cat([down, mla.kv_a_proj.bias.detach()[:, None]], dim=1)
        M = torch.cat([attn.k_proj.weight, attn.v_proj.weight]).detach()
        if bias:
            col = torch.cat([torch.zeros_like(attn.k_proj.bias), attn.v_proj.bias]).detach()[:, None]
            M = torch.cat([M, col], dim=1)
        actual = ((up @ down - M).norm() / M.norm()).item()
        assert actual == pytest.approx(report.error, rel=1e-9), (r, actual, report.error)
        assert report.errors[r] == report.error and report.kv_rank == r


def test_report_text_lists_ranks():
    attn = mh.Attention(16, 4, bias=False).double()
    text = str(convert.mla_report(attn, 5))
    assert "rank  rel. error" in text and "<- kv_rank" in text and "\n   5  " in text


def test_to_mla_result_decodes_with_its_cache():
    attn = _randomize_biases(mh.Attention(32, 4, 2, causal=True)).double()
    mla = convert.to_mla(attn, 12)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    cache = mla.new_cache(2, 9)
    assert cache.nbytes == 2 * 9 * 12 * 8
    steps = torch.cat([mla(x[:, t : t + 1], cache=cache) for t in range(9)], dim=1)
    assert_close(steps, mla(x), what="converted MLA, cached decode vs full")


def test_to_mla_leaves_the_source_alone_and_keeps_settings():
    attn = mh.Attention(16, 4, causal=True, backend="math").double().train()
    before = params(attn)
    mla = convert.to_mla(attn, 8)
    assert (mla.causal, mla.backend, mla.training, mla.latent_norm, mla.rope_dim) == (True, "math", True, False, 0)
    assert mla.kv_a_proj.weight.dtype == torch.float64
    for name, p in before.items():
        assert torch.equal(attn.state_dict()[name], p), name


# ------------------------------------------------------------- torch interop


def test_from_torch_to_torch_round_trip():
    mha = nn.MultiheadAttention(16, 4, batch_first=True).double().eval()
    attn = convert.from_torch(mha)
    back = convert.to_torch(attn)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert_close(attn(x), mha(x, x, x, need_weights=False)[0])
    assert_close(back(x, x, x, need_weights=False)[0], mha(x, x, x, need_weights=False)[0])


# ------------------------------------------------------------------ bad input


def _bad_cases():
    mha = mh.Attention(16, 4)
    return [
        ("to_gqa not dividing", lambda: convert.to_gqa(mha, 3), ValueError,
         "n_kv_heads must divide the layer's 4 key/value heads; received 3; valid: 1, 2, 4"),
        ("to_gqa zero", lambda: convert.to_gqa(mha, 0), ValueError, "received 0; valid: 1, 2, 4"),
        ("to_gqa more heads", lambda: convert.to_gqa(mh.Attention(16, 4, 2), 4), ValueError,
         "divide the layer's 2 key/value heads; received 4; valid: 1, 2"),
        ("to_gqa nn.MHA", lambda: convert.to_gqa(nn.MultiheadAttention(16, 4), 2), TypeError,
         "to_gqa takes a multihead.Attention; received MultiheadAttention (use multihead.convert.from_torch"),
        ("to_mla rank 0", lambda: convert.to_mla(mha, 0), ValueError,
         "kv_rank must be an int in 1..17, the rank of the stacked [W_k ; W_v] (min(32 rows, 17 columns)); "
         "received 0"),
        ("to_mla rank negative", lambda: convert.to_mla(mha, -3), ValueError, "received -3"),
        ("to_mla rank above max", lambda: convert.to_mla(mh.Attention(16, 4, bias=False), 17), ValueError,
         "kv_rank must be an int in 1..16"),
        ("to_mla rank float", lambda: convert.to_mla(mha, 8.0), ValueError, "received 8.0"),
        ("to_mla rope", lambda: convert.to_mla(mh.Attention(16, 4, rope=True), 8), ValueError,
         "to_mla: the layer has rotary embeddings"),
        ("to_mla cross", lambda: convert.to_mla(mh.Attention(16, 4, context_dim=8), 8), ValueError,
         "context_dim (8) != d_model (16)"),
        ("to_mla LatentAttention", lambda: convert.to_mla(mh.LatentAttention(16, 4, 8), 4), TypeError,
         "received LatentAttention"),
        ("mla_report rank", lambda: convert.mla_report(mha, 99), ValueError, "received 99"),
        ("to_torch GQA", lambda: convert.to_torch(mh.Attention(16, 4, 2)), ValueError,
         "n_kv_heads (2) != n_heads (4)"),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _bad_cases()])
def test_bad_input(case):
    _, call, exc, message = next(c for c in _bad_cases() if c[0] == case)
    with pytest.raises(exc) as err:
        call()
    assert message in str(err.value)


def test_deepcopy_of_converted_layers_works():
    # converted layers are ordinary modules: copyable, state_dict round-trips
    mla = convert.to_mla(mh.Attention(16, 4), 6)
    clone = copy.deepcopy(mla)
    x = torch.randn(1, 3, 16)
    assert torch.equal(clone(x), mla(x))
    again = mh.LatentAttention(16, 4, 6, latent_norm=False, bias=True)
    again.load_state_dict(mla.state_dict())
    assert torch.equal(again(x), mla(x))
    assert np.isfinite(convert.mla_report(mh.Attention(16, 4)).errors).all()
