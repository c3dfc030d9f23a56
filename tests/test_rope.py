"""multihead.rope: angles in float64, and the RoPE scalings against transformers' own
rotary classes (LlamaRotaryEmbedding for linear / dynamic / llama3 / yarn,
DeepseekV2RotaryEmbedding and DeepseekV2Attention's softmax scale for DeepSeek's YaRN).

transformers computes its frequencies and angles in float32; multihead in float64.
Tolerances against transformers are therefore float32's: inverse frequencies to 1e-6
relative, cos/sin to a few float32 roundings of the largest angle compared.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import assert_close
from multihead.rope import RopeScaling, RotaryEmbedding, apply_rotary


def _np_rope(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Half-split RoPE in float64 NumPy: the reference."""
    d = x.shape[-1]
    inv = 1.0 / base ** (np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def test_float64_input_at_large_positions_matches_float64_reference():
    x = torch.randn(1, 2, 4, 64, dtype=torch.float64)
    offset = 100_000
    got = RotaryEmbedding(64)(x, offset)
    ref = _np_rope(x.numpy(), np.arange(offset, offset + 4, dtype=np.float64))
    assert_close(got, ref, atol=1e-10, rtol=1e-10, what="float64 RoPE at position 1e5")


def test_float32_input_at_large_positions_is_as_close_as_float32_allows():
    x = torch.randn(1, 2, 4, 64)
    offset = 100_000
    got = RotaryEmbedding(64)(x, offset)
    ref = _np_rope(x.double().numpy(), np.arange(offset, offset + 4, dtype=np.float64))
    # each output is a sum of two float32 products of exact-to-float32 inputs: a few ulps of |x|
    bound = 4 * np.finfo(np.float32).eps * np.abs(x.numpy()).max()
    d = assert_close(got, ref, atol=bound, rtol=0, what="float32 RoPE at position 1e5")
    print(f"float32 at position 1e5: max |diff| {d:.1e} (bound {bound:.1e})")


def test_cast_module_keeps_float64_frequencies():
    rope = RotaryEmbedding(16).to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float64
    x = torch.randn(1, 1, 3, 16, dtype=torch.bfloat16)
    ref = _np_rope(x.double().numpy(), np.arange(1000, 1003, dtype=np.float64))
    assert_close(rope(x, 1000), ref, atol=3e-2, rtol=0, what="bfloat16 input, float64 angles")


@pytest.mark.parametrize("base, error, match", [
    ("10000", TypeError, r"rotary base must be a finite number > 1; received '10000' \(str\)"),
    (float("nan"), ValueError, "received nan"),
    (float("inf"), ValueError, "received inf"),
    (1.0, ValueError, "received 1.0"),
    (True, TypeError, "received True"),
])
def test_bad_base_is_refused_at_the_boundary(base, error, match):
    with pytest.raises(error, match=match):
        RotaryEmbedding(8, base=base)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(kind="ntk", factor=2.0), ValueError, r"kind 'ntk' is not supported; valid: linear, dynamic, llama3, yarn"),
    (dict(kind="linear", factor=0.5), ValueError, r"factor must be >= 1; received 0.5"),
    (dict(kind="linear", factor="2"), TypeError, "factor must be a positive finite number"),
    (dict(kind="yarn", factor=4.0), ValueError, "needs original_max_positions"),
    (dict(kind="llama3", factor=8.0, original_max_positions=8192, low_freq_factor=4.0, high_freq_factor=1.0),
     ValueError, "high_freq_factor"),
])
def test_bad_scaling(kwargs, err, match):
    with pytest.raises(err, match=match):
        RopeScaling(**kwargs)


def test_bad_scaling_dicts():
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        RopeScaling.from_hf({"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(TypeError, match="scaling must be None, a RopeScaling or a rope_parameters dict"):
        RotaryEmbedding(8, scaling="yarn")
    assert RopeScaling.from_hf({"rope_type": "default", "rope_theta": 10000.0}) is None


def test_positions_must_be_integers():
    with pytest.raises(TypeError, match="positions must be an integer tensor; received dtype torch.float32"):
        RotaryEmbedding(8).cos_sin(torch.zeros(3))


# ------------------------------------------------------------ against transformers

transformers = pytest.importorskip("transformers")

SCALED = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
             "beta_slow": 1.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                    "mscale_all_dim": 1.0},
}


@pytest.mark.parametrize("name", list(SCALED))
def test_scaling_matches_transformers_llama_rotary(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {**SCALED[name], "rope_theta": 10000.0}
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=64, rope_parameters=params)
    theirs = LlamaRotaryEmbedding(cfg)
    scaling = RopeScaling.from_hf(cfg.rope_parameters, cfg.max_position_embeddings)
    mine = RotaryEmbedding(64, 10000.0, scaling=scaling)
    assert_close(mine.inv_freq, theirs.inv_freq, atol=0, rtol=1e-6, what=f"{name} inverse frequencies")
    assert math.isclose(scaling.cos_sin_factor, theirs.attention_scaling, rel_tol=1e-12)
    # past max_position_embeddings for dynamic, whose base then grows with the sequence
    positions = torch.arange(100 if name == "dynamic" else 60)
    x = torch.zeros(1, len(positions), 64)
    with torch.no_grad():
        cos_t, sin_t = theirs(x, positions[None])  # (1, T, 64): both halves equal
    cos, sin = mine.cos_sin(positions)
    atol = 8 * np.finfo(np.float32).eps * float(positions.max())  # float32 angles in transformers
    dc = assert_close(cos, cos_t[0, :, :32], atol=atol, rtol=0, what=f"{name} cos")
    ds = assert_close(sin, sin_t[0, :, :32], atol=atol, rtol=0, what=f"{name} sin")
    print(f"{name}: cos {dc:.1e}, sin {ds:.1e} (atol {atol:.1e})")


def test_deepseek_v2_yarn_rotary_and_softmax_scale():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2Attention,
        DeepseekV2RotaryEmbedding,
    )

    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
              "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    cfg = DeepseekV2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                           q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           max_position_embeddings=640, rope_parameters=params)
    theirs = DeepseekV2RotaryEmbedding(cfg)
    scaling = RopeScaling.from_hf(cfg.rope_parameters, cfg.max_position_embeddings)
    mine = RotaryEmbedding(8, 10000.0, interleaved=True, scaling=scaling)
    positions = torch.arange(50)
    with torch.no_grad():
        freqs = theirs(torch.zeros(1), positions[None])[0]  # (T, 4) complex: cos + i sin, times the factor
    cos, sin = mine.cos_sin(positions)
    atol = 8 * np.finfo(np.float32).eps * 50
    assert_close(cos, freqs.real, atol=atol, rtol=0, what="deepseek yarn cos")
    assert_close(sin, freqs.imag, atol=atol, rtol=0, what="deepseek yarn sin")
    attn = DeepseekV2Attention(cfg, layer_idx=0)
    assert math.isclose(24 ** -0.5 * scaling.softmax_factor, attn.scaling, rel_tol=1e-12)
    assert scaling.softmax_factor > 1.5  # it matters at DeepSeek's factor 40


def test_apply_rotary_with_given_angles_equals_the_module():
    rope = RotaryEmbedding(16, scaling=RopeScaling("linear", 2.0))
    x = torch.randn(2, 3, 5, 16)
    cos, sin = rope.cos_sin(torch.arange(7, 12))
    assert torch.equal(apply_rotary(x, cos, sin), rope(x, 7))


# ------------------------------------------------- layouts against their models' formulations


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
    rope = RotaryEmbedding(8, interleaved=interleaved)
    assert_close(rope(x, offset=5), ref(x, torch.arange(5, 11)))  # float64 angles: exact


def test_rope_scores_depend_on_relative_position_only():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    s1 = (rope(q, 3) * rope(k, 1)).sum()
    s2 = (rope(q, 103) * rope(k, 101)).sum()
    assert abs(s1 - s2) < 1e-4


def test_partial_rope_leaves_the_rest():
    x = torch.randn(1, 1, 4, 8)
    out = RotaryEmbedding(4)(x, 2)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert not torch.allclose(out[..., :4], x[..., :4])
