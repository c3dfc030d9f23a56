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
    assert isinstance(mla, mh.LatentAttention) and mla.kv_rank == rank and report.error < 1e-13
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
        assert report.errors[r] == pytest.approx(report.error, rel=1e-9) and report.kv_rank == r


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_to_mla_carries_the_key_bias_under_a_softcap(n_kv_heads):
    # tanh(s / cap) of a score shifted by q . b_k is not a shifted tanh: the key bias the conversion used to
    # drop changed the outputs by up to 1.4 while the report said 0
    torch.manual_seed(0)
    attn = _randomize_biases(mh.Attention(16, 4, n_kv_heads, causal=True, softcap=2.0).double(), scale=1.0)
    rank = convert.mla_report(attn).max_rank
    mla, report = convert.to_mla(attn, rank, return_report=True)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    for absorb in (False, True):
        assert_close(mla(x, absorb=absorb), attn(x), atol=1e-12, rtol=1e-10, what=f"softcap + biases, absorb={absorb}")
    assert report.error < 1e-13
    for r in (3, 9):  # below full rank: the report's error is that of the map the module computes
        mla, report = convert.to_mla(attn, r, return_report=True)
        D, G = attn.head_dim, attn.n_groups
        up = mla.kv_b_proj.weight.detach().view(attn.n_heads, 2 * D, r)[::G]
        up = torch.cat([up[:, :D], up[:, D:]]).reshape(-1, r)
        down = torch.cat([mla.kv_a_proj.weight, mla.kv_a_proj.bias[:, None]], dim=1).detach()
        M = torch.cat([torch.cat([attn.k_proj.weight, attn.v_proj.weight]),
                       torch.cat([attn.k_proj.bias, attn.v_proj.bias])[:, None]], dim=1).detach()
        actual = ((up @ down - M).norm() / M.norm()).item()
        assert actual == pytest.approx(report.error, rel=1e-9), (r, actual, report.error)
    # the whole-model report is measured the same way
    model = nn.Sequential(attn)
    _, rows = convert.to_mla(model, rank, return_report=True)
    assert rows.max_error < 1e-13


def test_to_mla_rope_dim_lists_only_values_that_convert():
    # a head of 8 fully rotary dims: rope_dim 8 leaves no non-rotary feature (LatentAttention's head_dim 0);
    # it used to be announced as valid and then fail inside LatentAttention
    attn = mh.Attention(16, 2, head_dim=8, causal=True, rope=mh.RotaryEmbedding(8)).double()
    for bad in (8, 10):
        with pytest.raises(ValueError, match=r"rope_dim must be an even int in 0..6 .*received "
                                             + str(bad) + r"; valid: 0, 2, 4, 6$"):
            convert.to_mla(attn, 4, rope_dim=bad)
    for ok in (0, 2, 4, 6):  # every listed value converts
        assert convert.to_mla(attn, 4, rope_dim=ok).rope_dim == ok


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
         "the layer's key/value heads (4) must be divisible by n_kv_heads (3); valid: 1, 2, 4"),
        ("to_gqa zero", lambda: convert.to_gqa(mha, 0), ValueError, "n_kv_heads must be an int >= 1; received 0"),
        ("to_gqa float", lambda: convert.to_gqa(mha, 2.0), TypeError,
         "n_kv_heads must be an int >= 1; received 2.0 (float)"),
        ("to_gqa more heads", lambda: convert.to_gqa(mh.Attention(16, 4, 2), 4), ValueError,
         "the layer's key/value heads (2) must be divisible by n_kv_heads (4); valid: 1, 2"),
        ("to_gqa nn.MHA", lambda: convert.to_gqa(nn.MultiheadAttention(16, 4), 2), TypeError,
         "to_gqa takes a multihead.Attention; received MultiheadAttention (use multihead.convert.from_torch"),
        ("to_mla rank 0", lambda: convert.to_mla(mha, 0), ValueError,
         "kv_rank must be an int in 1..17, the rank of the stacked [W_k ; W_v] (min(32 rows, 17 columns)); "
         "received 0"),
        ("to_mla rank negative", lambda: convert.to_mla(mha, -3), ValueError, "received -3"),
        ("to_mla rank above max", lambda: convert.to_mla(mh.Attention(16, 4, bias=False), 17), ValueError,
         "kv_rank must be an int in 1..16"),
        ("to_mla rank float", lambda: convert.to_mla(mha, 8.0), TypeError,
         "kv_rank must be an int; received 8.0 (float)"),
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


# ------------------------------------------------------------- whole models


def _lab_model(n_heads=4, n_kv_heads=None, n_layers=2, bias=False):
    from multihead.decoder import LabConfig, LabTransformer

    torch.manual_seed(0)
    cfg = LabConfig(vocab_size=13, max_len=12, d_model=16, n_layers=n_layers, n_heads=n_heads,
                    n_kv_heads=n_kv_heads, bias=bias)
    model = LabTransformer(cfg).double().eval()
    with torch.no_grad():  # trained-looking weights: not the tiny init, biases nonzero
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


class _TwoLayers(nn.Module):
    """A plain module (not a lab model) with attention at two depths of nesting."""

    def __init__(self):
        super().__init__()
        self.first = mh.Attention(16, 4, causal=True, rope=True)
        self.inner = nn.ModuleDict({"attn": mh.Attention(16, 4, causal=True, sliding_window=3)})

    def forward(self, x):
        return self.inner["attn"](x + self.first(x))


@pytest.mark.parametrize("init", ["mean", "first"])
def test_whole_model_keeping_the_heads_is_exact(init):
    model = _lab_model(bias=True)
    x = torch.randint(0, 13, (2, 12))
    new, report = convert.to_gqa(model, 4, init=init, return_report=True)
    assert new is not model and all(a is not b for a, b in zip(new.parameters(), model.parameters()))
    assert_close(new(x), model(x), atol=1e-6, rtol=0, what=f"to_gqa(model, n_heads) init={init}")
    assert report.errors == (0.0, 0.0) and [layer.name for layer in report.layers] == ["blocks.0.attn",
                                                                                       "blocks.1.attn"]
    plain = _TwoLayers().double()
    xs = torch.randn(2, 7, 16, dtype=torch.float64)
    assert_close(convert.to_gqa(plain, 4, init=init)(xs), plain(xs), atol=1e-6, rtol=0, what="plain module")


def test_whole_model_to_mla_at_full_rank_is_exact():
    model = _lab_model(bias=True)
    x = torch.randint(0, 13, (2, 12))
    new, report = convert.to_mla(model, 17, return_report=True)  # 16 + the value-bias column
    assert all(isinstance(b.attn, mh.LatentAttention) for b in new.blocks)
    assert new.cfg.attention == "mla" and new.cfg.kv_rank == 17 and new.cfg.bias and not new.cfg.latent_norm
    assert report.target == "MLA-17" and report.max_error < 1e-12
    assert_close(new(x), model(x), atol=1e-6, rtol=0, what="to_mla(model, full rank)")


@pytest.mark.parametrize("n_kv_from,n_kv_to", [(4, 2), (4, 1), (2, 1)])
def test_whole_model_mean_pool_is_the_mean_of_each_group(n_kv_from, n_kv_to):
    model = _lab_model(n_kv_heads=n_kv_from, bias=True)
    before = params(model)
    new = convert.to_gqa(model, n_kv_to)
    assert new.cfg.n_kv_heads == n_kv_to and model.cfg.n_kv_heads == n_kv_from
    D, m = 4, n_kv_from // n_kv_to
    for old_block, new_block in zip(model.blocks, new.blocks):
        for name in ("k_proj", "v_proj"):
            w = getattr(old_block.attn, name).weight.detach().numpy()  # (Hkv*D, C)
            b = getattr(old_block.attn, name).bias.detach().numpy()
            # by hand: head j of the new layer is (head j*m + ... + head j*m + m - 1) / m
            want_w = np.concatenate([sum(w[(j * m + i) * D:(j * m + i + 1) * D] for i in range(m)) / m
                                     for j in range(n_kv_to)])
            want_b = np.concatenate([sum(b[(j * m + i) * D:(j * m + i + 1) * D] for i in range(m)) / m
                                     for j in range(n_kv_to)])
            np.testing.assert_allclose(getattr(new_block.attn, name).weight.detach().numpy(), want_w, atol=1e-15)
            np.testing.assert_allclose(getattr(new_block.attn, name).bias.detach().numpy(), want_b, atol=1e-15)
        # and the layer computes NumPy's GQA with those pooled projections
        a = new_block.attn
        T = lambda lin: lin.weight.detach().numpy().T  # noqa: E731
        bb = lambda lin: lin.bias.detach().numpy()  # noqa: E731
        h = torch.randn(2, 5, 16, dtype=torch.float64)
        ref = R.gqa_forward(h.numpy(), T(a.q_proj), T(a.k_proj), T(a.v_proj), T(a.o_proj), 4, n_kv_to, causal=True,
                            b_q=bb(a.q_proj), b_k=bb(a.k_proj), b_v=bb(a.v_proj), b_o=bb(a.o_proj))
        assert_close(a(h), ref, what="converted layer vs NumPy GQA")
    for name, p in before.items():  # the input model is untouched
        assert torch.equal(model.state_dict()[name], p), name


def test_first_and_random_inits():
    model = _lab_model(bias=True)
    first, rep_first = convert.to_gqa(model, 2, init="first", return_report=True)
    mean, rep_mean = convert.to_gqa(model, 2, init="mean", return_report=True)
    D = 4
    w = model.blocks[0].attn.k_proj.weight.detach()
    want = torch.cat([w[0:D], w[2 * D:3 * D]])  # heads 0 and 2: the first of each group of two
    assert torch.equal(first.blocks[0].attn.k_proj.weight, want)
    # the mean is the least-squares representative of a group: never a larger error than one member
    assert all(m <= f + 1e-15 for m, f in zip(rep_mean.errors, rep_first.errors)), (rep_mean, rep_first)
    assert all(0 < e < 1 for e in rep_mean.errors)
    r1 = convert.to_gqa(model, 2, init="random", generator=torch.Generator().manual_seed(3))
    r2 = convert.to_gqa(model, 2, init="random", generator=torch.Generator().manual_seed(3))
    r3 = convert.to_gqa(model, 2, init="random", generator=torch.Generator().manual_seed(4))
    k1 = r1.blocks[1].attn.k_proj
    assert torch.equal(k1.weight, r2.blocks[1].attn.k_proj.weight)
    assert not torch.equal(k1.weight, r3.blocks[1].attn.k_proj.weight)
    assert torch.count_nonzero(k1.bias) == 0
    src = model.blocks[1].attn.k_proj.weight
    assert float(k1.weight.detach().std()) == pytest.approx(float(src.detach().std()), rel=0.25)
    assert torch.equal(r1.blocks[1].attn.q_proj.weight, model.blocks[1].attn.q_proj.weight)


def test_converted_lab_model_saves_and_loads(tmp_path):
    from multihead.checkpoint import Vocab, load_lab_checkpoint, save_lab_checkpoint

    model = _lab_model().float()
    vocab = Vocab("char", tuple("abcdefghijklm"))
    x = torch.randint(0, 13, (1, 12))
    for new in (convert.to_gqa(model, 1), convert.to_mla(model, 6)):
        save_lab_checkpoint(tmp_path / new.cfg.kind, new, vocab, experiment="uptrain")
        back, _, _ = load_lab_checkpoint(tmp_path / new.cfg.kind)
        assert back.cfg == new.cfg
        assert torch.equal(back(x), new(x))


def test_whole_model_carries_rope_and_window():
    plain = _TwoLayers().double()
    new = convert.to_gqa(plain, 2)
    assert new.first.rope is not None and new.inner["attn"].sliding_window == 3 and new.inner["attn"].n_kv_heads == 2
    assert plain.first.n_kv_heads == 4
    with pytest.raises(ValueError, match=r"to_mla: layer first: to_mla: the layer has rotary embeddings"):
        convert.to_mla(plain, 8)


def test_to_gqa_keeps_window_softcap_and_alibi():
    # the layer conversion used to drop them, silently changing what the layer computes
    for kw in (dict(sliding_window=3), dict(softcap=2.0), dict(alibi=True)):
        attn = mh.Attention(16, 4, causal=True, **kw).double()
        x = torch.randn(2, 8, 16, dtype=torch.float64)
        assert_close(convert.to_gqa(attn, 4)(x), attn(x), what=f"to_gqa keeps {kw}")


def test_to_mla_keeps_window_and_softcap_and_refuses_alibi():
    for kw in (dict(sliding_window=3), dict(softcap=2.0)):
        attn = mh.Attention(16, 4, causal=True, bias=False, **kw).double()
        x = torch.randn(2, 8, 16, dtype=torch.float64)
        assert_close(convert.to_mla(attn, 16)(x), attn(x), what=f"to_mla keeps {kw}")
    with pytest.raises(ValueError, match="ALiBi"):
        convert.to_mla(mh.Attention(16, 4, causal=True, alibi=True), 8)


def test_whole_model_bad_input():
    with pytest.raises(ValueError, match=r"init must be one of mean, first, random, aligned; received 'avg'"):
        convert.to_gqa(_lab_model(), 2, init="avg")
    with pytest.raises(ValueError, match=r"to_gqa: Linear holds no multihead.Attention layer"):
        convert.to_gqa(nn.Linear(3, 3), 1)
    with pytest.raises(ValueError, match=r"from_torch first"):
        convert.to_gqa(nn.Sequential(nn.MultiheadAttention(16, 4)), 1)
    with pytest.raises(TypeError, match=r"received str"):
        convert.to_gqa("model", 1)
    with pytest.raises(ValueError, match=r"layer blocks.0.attn: the layer's key/value heads \(4\) must be divisible "
                                         r"by n_kv_heads \(3\); valid: 1, 2, 4$"):
        convert.to_gqa(_lab_model(), 3)
    with pytest.raises(ValueError, match=r"^n_kv_heads must be an int >= 1; received 0$"):
        convert.to_gqa(_lab_model(), 0)


def test_layers_with_some_biases_convert():
    # Qwen2 layers (from_llama) have q/k/v biases and no o bias: both conversions used to fail to load o_proj
    attn = _randomize_biases(mh.Attention(16, 4, causal=True)).double()
    attn.o_proj.register_parameter("bias", None)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    gqa = convert.to_gqa(attn, 4)
    assert gqa.o_proj.bias is None and gqa.k_proj.bias is not None
    assert_close(gqa(x), attn(x), what="to_gqa, no o bias")
    mla = convert.to_mla(attn, 17)
    assert mla.o_proj.bias is None and mla.kv_a_proj.bias is not None
    assert_close(mla(x), attn(x), what="to_mla, no o bias")
    attn.v_proj.register_parameter("bias", None)  # a key bias alone: dropped exactly, no latent bias
    mla = convert.to_mla(attn, 16)
    assert mla.kv_a_proj.bias is None
    assert_close(mla(x), attn(x), what="to_mla, key bias only")


# ------------------------------------------------------- partial RoPE (MHA2MLA)


def _rope_layer(n_kv_heads, rope, bias=True):
    torch.manual_seed(1)
    attn = mh.Attention(32, 4, n_kv_heads, head_dim=16, causal=True, rope=rope, bias=bias).double()
    return _randomize_biases(attn) if bias else attn


def _check_same(mla, ref, what):
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    want = ref(x)
    for absorb in (False, True):
        assert_close(mla(x, absorb=absorb), want, atol=1e-10, rtol=1e-9, what=f"{what}, absorb={absorb}")
    cache = mla.new_cache(2, 9)
    steps = torch.cat([mla(x[:, t:t + 1], cache=cache) for t in range(9)], dim=1)
    assert_close(steps, want, atol=1e-10, rtol=1e-9, what=f"{what}, cached decode")


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rope_keeping_every_rotary_pair_of_an_mqa_layer_is_exact(interleaved):
    # one key head and a rotary part of 8 of its 16 dims: the decoupled key is that part, exactly
    attn = _rope_layer(1, mh.RotaryEmbedding(8, interleaved=interleaved))
    mla, report = convert.to_mla(attn, 24, rope_dim=8, return_report=True)  # rank of [W_k nope ; W_v]: 8 + 16
    assert mla.rope_dim == 8 and mla.head_dim == 8 and report.error < 1e-12
    _check_same(mla, attn, f"MQA, rotary 8 of 16, interleaved={interleaved}")


def test_partial_rope_shares_the_mean_of_the_key_heads_rotary_parts():
    attn = _rope_layer(2, mh.RotaryEmbedding(8))
    with torch.no_grad():  # equal rotary parts in both key heads (features 0-3 and 4-7 of each): then exact
        w = attn.k_proj.weight.view(2, 16, 32)
        w[1, :8] = w[0, :8]
        attn.k_proj.bias.view(2, 16)[1, :8] = attn.k_proj.bias.view(2, 16)[0, :8]
    _check_same(convert.to_mla(attn, 33, rope_dim=8), attn, "GQA with equal rotary parts")
    with torch.no_grad():
        w[1, :8] = torch.randn(8, 32, dtype=torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    assert not torch.allclose(convert.to_mla(attn, 33, rope_dim=8)(x), attn(x), atol=1e-3)


def test_partial_rope_keeps_the_highest_frequencies_and_drops_the_rest():
    # interleaved, rotary over 8 of a head's 16 dims; keeping 4: pairs (0,1), (2,3) rotate at the original
    # frequencies, the others not at all: what RotaryEmbedding(4, base ** (4 / 8)) does to the same weights
    attn = _rope_layer(1, mh.RotaryEmbedding(8, interleaved=True))
    ref = copy.deepcopy(attn)
    ref.rope = mh.RotaryEmbedding(4, 10000.0 ** 0.5, interleaved=True)
    _check_same(convert.to_mla(attn, 28, rope_dim=4), ref, "keep 2 of 4 pairs")
    ref.rope = None  # rope_dim=0: no rotation left at all
    mla = convert.to_mla(attn, 32, rope_dim=0)
    assert mla.rope is None
    _check_same(mla, ref, "rope_dim=0")


def test_partial_rope_bad_input():
    attn = _rope_layer(2, mh.RotaryEmbedding(8))
    for bad in (3, 10, -2):
        with pytest.raises(ValueError, match=r"rope_dim must be an even int in 0..8 \(the layer's rotary dim\); "
                                             r"received .*; valid: 0, 2, 4, 6, 8"):
            convert.to_mla(attn, 8, rope_dim=bad)
    with pytest.raises(TypeError, match=r"^to_mla: rope_dim must be an int; received 2.0 \(float\)$"):
        convert.to_mla(attn, 8, rope_dim=2.0)
    with pytest.raises(ValueError, match=r"rope_dim must be an even int in 0..0"):
        convert.to_mla(mh.Attention(32, 4), 8, rope_dim=2)
    scaled = _rope_layer(2, mh.RotaryEmbedding(8, scaling=mh.rope.RopeScaling("linear", 2.0)))
    with pytest.raises(ValueError, match="linear scaling"):
        convert.to_mla(scaled, 8, rope_dim=4)
    with pytest.raises(ValueError, match=r"valid: rope=None, or to_mla\(..., rope_dim=r\)"):
        convert.to_mla(attn, 8)
