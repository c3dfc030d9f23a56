"""The pieces of kernels/common.py (every attention formula has one home), against the
NumPy float64 reference: the masked softmax (with sinks) and its entropy (the stream's),
the block attention with its lse (ring attention's block), torch's fused CPU kernel with
its lse, the one-query step over shared keys (MLA's decode), the probabilities a backward
recomputes from the log-sum-exp, and blocks merged by merge_two / lse_merge /
lse_merge_into equal to the softmax over all keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multihead import reference as ref
from multihead.kernels.common import (
    backward_lse,
    block_attention,
    flash_lse,
    lse_merge,
    lse_merge_into,
    merge_two,
    one_query_shared_keys,
    probs_from_lse,
    softmax,
    softmax_entropy,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _np_lse(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        return (np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True)) + m)[..., 0]


def _case(dtype, seed=0):
    """Scores (2, 3, 5, 7) and a mask with one row of nothing to attend and one fully open."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(2, 3, 5, 7, generator=g) * 4).to(dtype)
    allowed = torch.rand(2, 3, 5, 7, generator=g) > 0.4
    allowed[0, 1, 2] = False  # a row with no key
    allowed[1, 0, 0] = True
    return scores, allowed


def _masked_np(scores: torch.Tensor, allowed: torch.Tensor) -> np.ndarray:
    return np.where(allowed.numpy(), scores.double().numpy(), -np.inf)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softmax_equals_the_reference_and_guards_empty_rows(dtype):
    scores, allowed = _case(dtype, seed=1)
    bias = torch.randn(1, 3, 1, 7, dtype=dtype, generator=torch.Generator().manual_seed(2))
    got = softmax(scores, allowed, bias)
    want = ref.softmax(np.where(allowed.numpy(), (scores + bias).double().numpy(), -np.inf))
    err = np.abs(got.double().numpy() - want).max()
    assert err < TOL[dtype], f"max diff {err:.3g}"
    assert torch.equal(got[0, 1, 2], torch.zeros(7, dtype=dtype))
    # scores that already hold -inf (hidden pairs filled by the caller): `hidden` guards the empty row
    filled = scores.masked_fill(~allowed, float("-inf"))
    assert torch.equal(softmax(filled, hidden=True), softmax(scores, allowed))
    assert torch.isnan(softmax(filled)[0, 1, 2]).all()  # what the guard is for
    assert np.abs(softmax(scores).double().numpy() - ref.softmax(scores.double().numpy())).max() < TOL[dtype]


def test_backward_lse_makes_empty_rows_zero_and_keeps_the_rest():
    scores, allowed = _case(torch.float64)
    masked = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.from_numpy(_np_lse(_masked_np(scores, allowed)))  # the reference's, -inf on the empty row
    back = backward_lse(lse)
    assert torch.isposinf(back[0, 1, 2]) and torch.equal(back[torch.isfinite(lse)], lse[torch.isfinite(lse)])
    # the backward's recomputation exp(masked scores - lse) gives the forward's probabilities, 0 on empty rows
    again = probs_from_lse(masked, back[..., None])
    assert torch.equal(again[0, 1, 2], torch.zeros(7, dtype=torch.float64))
    err = np.abs(again.numpy() - ref.softmax(_masked_np(scores, allowed))).max()
    assert err < 1e-12, f"max diff {err:.3g}"
    assert torch.isnan(torch.exp(masked - lse[..., None])).any()  # what backward_lse is for


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sinks", [False, True])
def test_softmax_entropy_equals_the_reference(dtype, sinks):
    """The stream's probabilities and entropies: the reference softmax and -sum p log p (0 log 0 = 0),
    a row with nothing to attend zeros with entropy 0 (or all its mass on the sink)."""
    scores, allowed = _case(dtype, seed=10)
    bias = torch.randn(1, 3, 1, 7, dtype=dtype, generator=torch.Generator().manual_seed(11))
    sink = torch.randn(1, 3, 1, 1, generator=torch.Generator().manual_seed(12)).to(dtype) if sinks else None
    probs, entropy = softmax_entropy(scores.clone(), allowed, bias, sinks=sink)
    x = np.where(allowed.numpy(), (scores + bias).double().numpy(), -np.inf)
    if sinks:
        x = np.concatenate([x, np.broadcast_to(sink.double().numpy(), x.shape[:-1] + (1,))], axis=-1)
    p = ref.softmax(x)[..., :-1] if sinks else ref.softmax(x)  # the sink's probability dropped, as its term
    with np.errstate(divide="ignore", invalid="ignore"):
        want_e = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
    err = max(np.abs(probs.double().numpy() - p).max(), np.abs(entropy.double().numpy() - want_e).max())
    assert err < TOL[dtype] * 10, f"max diff {err:.3g}"
    assert not probs.isnan().any() and not entropy.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_blocks_merged_by_their_lse_equal_attention_over_all_keys(dtype):
    """ring attention's use (lse_merge_into), the fused tiles' (lse_merge) and the decode
    split's (merge_two): each block's attention with its lse, merged, is attention over
    every key; a row with no key in either block stays 0 with lse -inf."""
    q, k, v = _qkv(dtype, H=3, Hkv=3, S=7)
    allowed = torch.rand(2, 3, 5, 7, generator=torch.Generator().manual_seed(4)) > 0.4
    allowed[0, 1, 2] = False  # a row with no key
    allowed[1, 2, 3, :4] = False  # a row with keys in the second block only
    allowed[1, 2, 3, 5] = True
    want = ref.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), mask=allowed.numpy(), scale=0.4)
    want = np.where(allowed.numpy().any(-1, keepdims=True), want, 0.0)  # the reference's empty row is NaN
    parts = []
    out = torch.zeros(2, 3, 5, 3, dtype=dtype)
    lse = torch.full((2, 3, 5), float("-inf"), dtype=dtype)
    for s0, s1 in ((0, 4), (4, 7)):
        ob, lb = block_attention(q, k[:, :, s0:s1], v[:, :, s0:s1], 0.4, allowed[..., s0:s1])
        parts.append((ob, lb[..., None]))
        lse_merge_into(out, lse, ob, lb)
    merged, merged_lse = lse_merge(parts, dtype, dtype)
    two = merge_two(parts[0][0], parts[1][0], parts[0][1][..., 0], parts[1][1][..., 0])
    assert torch.equal(merged_lse[..., 0], lse)
    for got in (merged, out, two):
        err = np.nanmax(np.abs(got.double().numpy() - want))
        assert err < TOL[dtype] * 10, f"max diff {err:.3g}"
    assert torch.equal(out[0, 1, 2], torch.zeros(3, dtype=dtype)) and torch.isneginf(lse[0, 1, 2])
    assert torch.equal(merged[0, 1, 2], torch.zeros(3, dtype=dtype))
    assert torch.isnan(two[0, 1, 2]).all()  # merge_two leaves the empty row to its caller (decode has none)
    # a NaN in a part (bad data) stays NaN in the merged row, output and lse
    bad = [(o.clone(), lp.clone()) for o, lp in parts]
    bad[1][0][1, 0, 1] = float("nan")
    bad[1][1][1, 0, 1] = float("nan")
    got, got_lse = lse_merge(bad, dtype, dtype)
    assert torch.isnan(got[1, 0, 1]).all() and torch.isnan(got_lse[1, 0, 1]).all()
    assert torch.equal(got[0], merged[0])


def _qkv(dtype, B=2, H=4, Hkv=2, T=5, S=7, D=6, Dv=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype) for shape in
                 ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softmax_with_sinks_equals_the_reference(dtype):
    """A sink is one more logit in the denominator with no value (GPT-OSS): the reference
    softmax over [scores, sink] with the sink's column dropped; a row with no key then
    gives its whole mass to the sink (zeros, not NaN)."""
    scores, allowed = _case(dtype, seed=6)
    sinks = torch.randn(1, 3, 1, 1, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = softmax(scores, allowed, sinks=sinks)
    x = _masked_np(scores, allowed)
    logits = np.concatenate([x, np.broadcast_to(sinks.double().numpy(), x.shape[:-1] + (1,))], axis=-1)
    want = ref.softmax(logits)[..., :-1]
    err = np.abs(got.double().numpy() - want).max()
    assert err < TOL[dtype], f"max diff {err:.3g}"
    assert torch.equal(got[0, 1, 2], torch.zeros(7, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_block_attention_equals_the_reference(dtype, Hkv):
    q, k, v = _qkv(dtype, Hkv=Hkv)
    allowed = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(8)) > 0.4
    allowed[1, 0, 3] = False  # a row with no key
    out, lse = block_attention(q, k, v, 0.4, allowed)
    want = ref.attention(q.numpy(), k.numpy(), v.numpy(), mask=allowed.numpy(), scale=0.4)
    want = np.where(allowed.numpy().any(-1, keepdims=True), want, 0.0)  # the reference's empty row is NaN
    err = np.abs(out.double().numpy() - want).max()
    assert err < TOL[dtype] * 10, f"out: max diff {err:.3g}"
    G = 4 // Hkv
    scores = q.double().numpy() @ np.repeat(k.double().numpy(), G, axis=1).swapaxes(-1, -2) * 0.4
    want_l = _np_lse(np.where(allowed.numpy(), scores, -np.inf))
    finite = np.isfinite(want_l)
    assert np.abs(lse.double().numpy()[finite] - want_l[finite]).max() < TOL[dtype] * 10
    assert torch.isneginf(lse[1, :, 3]).all() and not out.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flash_lse_equals_the_block_attention_and_fixes_empty_rows(dtype):
    """torch's CPU kernel reports lse 0 for a row with no key; flash_lse makes it -inf."""
    q, k, v = _qkv(dtype, Dv=6)
    q, k, v = q[:, :2], k[:, :2], v[:, :2]  # the fused kernel's layout: as many K/V heads as query heads
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1] = False  # batch 1: no key at all
    mask = torch.zeros(2, 1, 1, 7, dtype=dtype).masked_fill(~keep[:, None, None], float("-inf"))
    out, lse = flash_lse(q, k, v, causal=False, scale=0.4, mask=mask, empty=~keep.any(-1)[:, None, None])
    want_o, want_l = block_attention(q, k, v, 0.4, keep[:, None, None])
    assert (out[0].double() - want_o[0].double()).abs().max() < TOL[dtype] * 10
    assert (lse[0].double() - want_l[0].double()).abs().max() < TOL[dtype] * 10
    assert torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_query_over_shared_keys_equals_the_reference(dtype):
    """MLA's absorbed step: one query per head over one latent that is keys (all W
    features) and values (its first R), with and without a softcap."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 1, 10, generator=g).to(dtype)
    latent = torch.randn(2, 7, 10, generator=g).to(dtype)
    for cap in (None, 2.0):
        got = one_query_shared_keys(q, latent, 6, 0.3, cap)
        kv = latent.double().numpy()[:, None]  # (B, 1, S, W): one K/V head
        want = ref.attention(q.numpy(), kv, kv[..., :6], scale=0.3, softcap_cap=cap)
        err = np.abs(got.double().numpy() - want).max()
        assert got.shape == (2, 4, 1, 6) and err < TOL[dtype] * 10, f"cap {cap}: max diff {err:.3g}"
