"""Conversions on Gemma 3's attention (MQA with QK-norm), on a tiny random Gemma 3 of the same
layout: `to_mla` refuses by name (the per-head RMS norm on keys breaks the linear latent),
`to_gqa` says there is one key/value head already, and its n_kv_heads=1 copy is the model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_gemma():
    cfg = transformers.Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=8, vocab_size=100,
                                        sliding_window=4, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).eval()


def test_to_mla_refuses_qk_norm_by_name(tiny_gemma):
    from multihead import convert

    with pytest.raises(ValueError, match=r"to_mla: Gemma3ForCausalLM's Gemma3Attention normalises every query and "
                                         r"key head \(QK-norm"):
        convert.to_mla(tiny_gemma, 8, rope_dim=2)


@pytest.mark.parametrize("n", [2, 4])
def test_to_gqa_says_there_is_one_kv_head_already(tiny_gemma, n):
    from multihead import convert

    with pytest.raises(ValueError, match=f"has one key/value head already .MQA.*nothing to group into {n}; valid: "
                                         "n_kv_heads=1"):
        convert.to_gqa(tiny_gemma, n)


def test_to_gqa_with_its_one_head_is_an_identical_copy(tiny_gemma):
    from multihead import convert

    copy = convert.to_gqa(tiny_gemma, 1)
    ids = torch.randint(100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, tiny_gemma(ids).logits)
    assert copy is not tiny_gemma
