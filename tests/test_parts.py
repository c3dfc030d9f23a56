"""Masks, RoPE, caches and the NumPy reference, each against an independent computation."""

import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import masks

# ------------------------------------------------------------------------- masks


def test_predicates_materialise_with_only_the_dims_they_use():
    assert masks.causal().to_dense(4, 8, 3, 5).shape == (1, 1, 3, 5)
    assert masks.padding(torch.tensor([2, 5])).to_dense(2, 8, 3, 5).shape == (2, 1, 1, 5)
    combined = (masks.causal() & masks.padding(torch.tensor([2, 5]))).to_dense(2, 8, 3, 5)
    assert combined.shape == (2, 1, 3, 5)


def test_causal_and_window_values_bottom_right():
    dense = masks.sliding_window(2).to_dense(1, 1, 2, 4)[0, 0]
    # queries sit at positions 2 and 3 of 4 keys; each sees itself and one key back
    assert dense.tolist() == [[False, True, True, False], [False, False, True, True]]
    full = masks.causal().to_dense(1, 1, 3, 3)[0, 0]
    assert torch.equal(full, torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_or_masks_and_keep_mask():
    keep = torch.tensor([[True, False, True, True]])
    either = masks.or_masks(masks.causal(), masks.padding(keep=keep)).to_dense(1, 1, 4, 4)[0, 0]
    expect = torch.tril(torch.ones(4, 4, dtype=torch.bool)) | keep
    assert torch.equal(either, expect)


def test_torch_mask_conversions_invert_bool_keep_float():
    kpm = torch.tensor([[False, True]])
    assert masks.from_key_padding_mask(kpm).tolist() == [[[[True, False]]]]
    fk = torch.tensor([[0.0, float("-inf")]])
    assert torch.equal(masks.from_key_padding_mask(fk), fk[:, None, None])
    am = torch.tensor([[False, True], [False, False]])
    assert masks.from_torch_attn_mask(am)[0, 0].tolist() == [[True, False], [True, True]]
    am3 = torch.zeros(6, 2, 2, dtype=torch.bool)
    assert masks.from_torch_attn_mask(am3, n_heads=3).shape == (2, 3, 2, 2)


# -------------------------------------------------------------------------- rope


def _hf_half_split(x, pos, base=10000.0):
    """HF Llama's formulation, written independently: cat(freqs, freqs) with rotate_half."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = pos[:, None].double() * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * emb.cos() + rot * emb.sin()


def _gptj_interleaved(x, pos, base=10000.0):
    """GPT-J's rotate_every_two with repeat_interleave'd sin/cos."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = pos[:, None].double() * inv[None]
    sin, cos = freqs.sin().repeat_interleave(2, -1), freqs.cos().repeat_interleave(2, -1)
    rot = torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
    return x * cos + rot * sin


@pytest.mark.parametrize("interleaved,ref", [(False, _hf_half_split), (True, _gptj_interleaved)])
def test_rope_layouts_match_their_models(interleaved, ref):
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    rope = mh.RotaryEmbedding(8, interleaved=interleaved)
    assert_close(rope(x, offset=5), ref(x, torch.arange(5, 11)), atol=1e-6, rtol=1e-6)


def test_rope_scores_depend_on_relative_position_only():
    rope = mh.RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    s1 = (rope(q, 3) * rope(k, 1)).sum()
    s2 = (rope(q, 103) * rope(k, 101)).sum()
    assert abs(s1 - s2) < 1e-4


def test_partial_rope_leaves_the_rest():
    x = torch.randn(1, 1, 4, 8)
    out = mh.RotaryEmbedding(4)(x, 2)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert not torch.allclose(out[..., :4], x[..., :4])
