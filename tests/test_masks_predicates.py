"""Mask predicates materialised densely, and nn.MultiheadAttention mask conversions, against hand-written masks."""

import pytest
import torch

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
    for n_heads in (4, None):
        with pytest.raises(ValueError, match=r"^a 3-D attn_mask \(6, 2, 2\) is \(B \* n_heads, T, S\): its dim 0 "
                                             rf"\(6\) must be divisible by n_heads \({n_heads}\); valid: 1, 2, 3, 6$"):
            masks.from_torch_attn_mask(am3, n_heads=n_heads)
