"""multihead.plan.conversions: what a conversion saves, against the converted modules themselves."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import convert
from multihead.plan.configs import read_config
from multihead.plan.conversions import conversions, conversions_text
from multihead.plan.geometry import AttentionGeometry, FeedForward, ModelGeometry, kv_bytes_per_token, param_counts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("bias", [True, False])
def test_savings_equal_the_converted_modules(bias):
    C, H, L = 32, 8, 3
    model = ModelGeometry(AttentionGeometry(C, H, 4, bias=bias), n_layers=L, vocab_size=50, ffn=FeedForward(64))
    attn = mh.Attention(C, H, 4, bias=bias, causal=True)
    n_attn = sum(p.numel() for p in attn.parameters())
    rows = conversions(model)
    assert [r["conversion"] for r in rows] == ["to_gqa -> GQA-2", "to_gqa -> MQA", "to_mla R=16", "to_mla R=8"]
    for r in rows:
        new = convert.to_gqa(attn, r["n_kv_heads"]) if "n_kv_heads" in r else convert.to_mla(attn, r["kv_rank"])
        cache = new.new_cache(1, 1, dtype=torch.bfloat16)
        assert r["kv_bytes_per_token"] == L * cache.nbytes, r
        assert r["params_saved"] == L * (n_attn - sum(p.numel() for p in new.parameters())), r
        assert r["kv_saved"] == pytest.approx(1 - L * cache.nbytes / kv_bytes_per_token(model))
        assert r["params"] == param_counts(model).total - r["params_saved"]


def test_exact_rank_and_text():
    model = read_config("gpt2")  # MHA with biases, learned positions: 12 heads of 64, d_model 768
    rows = conversions(model)
    ranks = [r["kv_rank"] for r in rows if "kv_rank" in r]
    assert ranks == [768, 512, 384, 256, 128]
    text = conversions_text(model)
    assert "to_gqa -> MQA" in text and "(-92%)" in text
    assert "the latent alone (rope_dim 0), exact at the top rank for layers without RoPE" in text
    assert "to_mla(model, R, rope_dim=r)" in text and "caches r more values per token per layer" in text
    assert conversions(read_config("deepseek-v2-lite")) == []  # already MLA
    assert conversions_text(read_config("bert-base-uncased")) == ""  # an encoder caches nothing


@pytest.mark.parametrize("rope_dim", [0, 4, 8])
def test_the_text_says_what_a_rope_layer_caches(rope_dim):
    """The listing's note on RoPE models: to_mla(layer, R, rope_dim=r) converts a rotary layer
    (it no longer refuses one) and its cache holds R + r values per token, r more than the
    rows, which count the latent alone; without RoPE the top rank is exact."""
    C, H, R = 64, 4, 32  # heads of 16: rotary pairs to spare for rope_dim 8
    model = ModelGeometry(AttentionGeometry(C, H, 2, bias=False), n_layers=1, vocab_size=50, ffn=FeedForward(64))
    row = next(r for r in conversions(model) if r.get("kv_rank") == R)
    attn = mh.Attention(C, H, 2, bias=False, causal=True, rope=True)
    mla = convert.to_mla(attn, R, rope_dim=rope_dim)
    cache = mla.new_cache(1, 1, dtype=torch.bfloat16)
    assert cache.nbytes == row["kv_bytes_per_token"] + 2 * rope_dim
    plain = mh.Attention(C, H, 2, bias=False, causal=True).double()
    x = torch.randn(2, 5, C, dtype=torch.float64)
    exact = convert.to_mla(plain, C)  # the top rank: the stacked [W_k ; W_v] has rank C
    torch.testing.assert_close(exact(x), plain(x), atol=1e-10, rtol=0)
