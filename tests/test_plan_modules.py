"""plan's numbers are the modules' numbers: parameter counts and cache bytes.

For each geometry, build the real module and compare `sum(p.numel())` and the `nbytes`
of its cache with what `multihead.plan` computes without torch.
"""

import pytest
import torch

from multihead import latent, plan
from plan_public_configs import CONFIGS as PUBLIC_CONFIGS

ATTENTION = [
    # (d_model, n_heads, n_kv_heads, kwargs)
    pytest.param(64, 8, None, {}, id="mha"),
    pytest.param(64, 8, 2, {}, id="gqa"),
    pytest.param(64, 8, 1, {}, id="mqa"),
    pytest.param(48, 4, 2, {"head_dim": 16}, id="head_dim-not-C/H"),
    pytest.param(40, 2, 1, {"head_dim": 32}, id="gemma-like-H*D>C"),
    pytest.param(64, 4, None, {"context_dim": 24}, id="cross-attention"),
    pytest.param(64, 4, 2, {"context_dim": 24, "head_dim": 8}, id="cross-gqa-head_dim"),
    pytest.param(64, 8, 4, {"bias": False}, id="gqa-no-bias"),
    pytest.param(64, 8, None, {"bias": True}, id="mha-bias"),
]


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("d_model, n_heads, n_kv_heads, kw", ATTENTION)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_attention_params_and_cache_match_the_module(d_model, n_heads, n_kv_heads, kw, dtype):
    from multihead import Attention

    module = Attention(d_model, n_heads, n_kv_heads, **kw)
    g = plan.AttentionGeometry(d_model, n_heads, n_kv_heads, **kw)
    assert plan.attention_params(g) == n_params(module)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for batch, max_len in [(1, 1), (3, 17)]:
        cache = module.new_cache(batch, max_len, dtype=torch_dtype)
        assert plan.kv_cache_bytes(g, max_len, batch, dtype) == cache.nbytes
        # A torch dtype works too (duck-typed: plan imports no torch).
        assert plan.kv_cache_bytes(g, max_len, batch, torch_dtype) == cache.nbytes


def test_qwen2_style_o_bias_is_counted_apart():
    from multihead import Attention

    module = Attention(64, 8, 2, bias=True)
    g = plan.AttentionGeometry(64, 8, 2, bias=True, o_bias=False)
    assert plan.attention_params(g) == n_params(module) - module.o_proj.bias.numel()


LATENT = [
    # (d_model, n_heads, kv_rank, kwargs)
    pytest.param(64, 4, 16, {}, id="no-rope"),
    pytest.param(64, 4, 16, {"rope_dim": 8}, id="rope"),
    pytest.param(64, 4, 16, {"q_rank": 24, "rope_dim": 8}, id="q_rank"),
    pytest.param(64, 4, 32, {"head_dim": 12, "rope_dim": 4, "v_head_dim": 20}, id="dims"),
    pytest.param(64, 4, 16, {"q_rank": 24, "rope_dim": 8, "bias": True}, id="bias"),
    pytest.param(64, 4, 16, {"rope_dim": 8, "latent_norm": False}, id="no-latent-norm"),
    # DeepSeek-V2-Lite's attention at full size (16 heads, 128 + 64, rank 512).
    pytest.param(2048, 16, 512, {"head_dim": 128, "rope_dim": 64, "v_head_dim": 128},
                 id="deepseek-v2-lite"),
]


@pytest.mark.parametrize("d_model, n_heads, kv_rank, kw", LATENT)
def test_latent_params_and_cache_match_the_module(d_model, n_heads, kv_rank, kw):
    module = latent.LatentAttention(d_model, n_heads, kv_rank, **kw)
    g = plan.LatentGeometry(d_model, n_heads, kv_rank, **kw)
    assert plan.attention_params(g) == n_params(module)
    for dtype, torch_dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        cache = module.new_cache(2, 9, dtype=torch_dtype)
        assert plan.kv_cache_bytes(g, 9, 2, dtype) == cache.nbytes


def test_deepseek_v2_lite_attention_matches_the_config_reader():
    CONFIGS = PUBLIC_CONFIGS

    model = plan.read_config(CONFIGS["deepseek-v2-lite"])
    a = model.attention
    module = latent.LatentAttention(a.d_model, a.n_heads, a.kv_rank, q_rank=a.q_rank,
                                    head_dim=a.head_dim, rope_dim=a.rope_dim,
                                    v_head_dim=a.v_head_dim)
    assert n_params(module) == plan.param_counts(model).attention_per_layer == 13_763_072


def test_llama3_attention_block_matches_the_module():
    from multihead import Attention

    with torch.device("meta"):  # shapes only, no memory
        module = Attention(4096, 32, 8, bias=False)
    assert n_params(module) == 41_943_040
    cache = module.new_cache(1, 1, dtype=torch.bfloat16, device="meta")
    assert cache.nbytes * 32 == 131_072  # 32 layers: Llama-3-8B's KV bytes per token


# --- any geometry, not only the listed ones ------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def attention_args(draw):
    n_heads = draw(st.integers(1, 12))
    n_kv = draw(st.sampled_from([k for k in range(1, n_heads + 1) if n_heads % k == 0]))
    head_dim = draw(st.one_of(st.none(), st.integers(1, 24)))
    d_model = draw(st.integers(1, 8)) * n_heads if head_dim is None else draw(st.integers(1, 96))
    kw = {"head_dim": head_dim, "bias": draw(st.booleans()),
          "context_dim": draw(st.one_of(st.none(), st.integers(1, 40)))}
    return d_model, n_heads, n_kv, kw


@settings(max_examples=60, deadline=None)
@given(attention_args(), st.integers(1, 4), st.integers(0, 33))
def test_any_attention_geometry_matches_the_module(args, batch, max_len):
    from multihead import Attention

    d_model, n_heads, n_kv, kw = args
    with torch.device("meta"):
        module = Attention(d_model, n_heads, n_kv, **kw)
    g = plan.AttentionGeometry(d_model, n_heads, n_kv, **kw)
    assert (g.n_kv_heads, g.head_dim) == (module.n_kv_heads, module.head_dim)
    assert plan.attention_params(g) == n_params(module)
    if max_len:
        cache = module.new_cache(batch, max_len, dtype=torch.float16, device="meta")
        assert plan.kv_cache_bytes(g, max_len, batch, "fp16") == cache.nbytes


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 8), st.integers(1, 48), st.one_of(st.none(), st.integers(1, 32)),
       st.integers(1, 16), st.sampled_from([0, 2, 4, 8]), st.one_of(st.none(), st.integers(1, 16)),
       st.booleans(), st.booleans())
def test_any_latent_geometry_matches_the_module(n_heads, kv_rank, q_rank, head_dim, rope_dim,
                                                v_head_dim, bias, latent_norm):
    d_model = 8 * n_heads
    kw = {"q_rank": q_rank, "head_dim": head_dim, "rope_dim": rope_dim,
          "v_head_dim": v_head_dim, "bias": bias, "latent_norm": latent_norm}
    with torch.device("meta"):
        module = latent.LatentAttention(d_model, n_heads, kv_rank, **kw)
    g = plan.LatentGeometry(d_model, n_heads, kv_rank, **kw)
    assert (g.head_dim, g.v_head_dim) == (module.head_dim, module.v_head_dim)
    assert plan.attention_params(g) == n_params(module)
    cache = module.new_cache(2, 5, dtype=torch.bfloat16, device="meta")
    assert plan.kv_cache_bytes(g, 5, 2, "bf16") == cache.nbytes
