"""plan's arithmetic: sizes, dtypes, geometry checks, caches, FLOPs and device fit,
each against numbers worked out by hand."""

import subprocess
import sys

import pytest

from multihead import plan
from multihead.plan import units
from multihead.plan.devices import DEVICES, GiB, max_batch, max_context
from plan_public_configs import CONFIGS as PUBLIC_CONFIGS


def test_plan_imports_no_torch():
    code = "import sys, multihead.plan, multihead.plan.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- sizes as people write them ------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("125M", 125_000_000), ("1.3B", 1_300_000_000), ("7b", 7_000_000_000),
    ("70B", 70_000_000_000), ("1.2T", 1_200_000_000_000), ("124439808", 124_439_808),
    ("1,300,000", 1_300_000), ("10k", 10_000),
])  # fmt: skip
def test_parse_count(text, value):
    assert units.parse_count(text) == value


@pytest.mark.parametrize("text, value", [
    ("32k", 32_768), ("128K", 131_072), ("4096", 4096), ("1M", 1_048_576), ("1.5k", 1536),
])  # fmt: skip
def test_parse_tokens(text, value):
    assert units.parse_tokens(text) == value


@pytest.mark.parametrize("text, value", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("24 GB", 24 * 10**9), ("512MiB", 2**29),
    ("1TB", 10**12),
])  # fmt: skip
def test_parse_bytes(text, value):
    assert units.parse_bytes(text) == value


def test_parse_bandwidth():
    assert units.parse_bandwidth("3.35TB/s") == 3_350_000_000_000
    assert units.parse_bandwidth("900GB/s") == 900 * 10**9


@pytest.mark.parametrize("fn, text, match", [
    (units.parse_count, "-7B", "must be positive; received '-7B'"),
    (units.parse_count, "0", "must be positive"),
    (units.parse_count, "7X", r"could not read parameter count '7X'; write it like 125M"),
    (units.parse_count, "seven", "write it like 125M, 1.3B"),
    (units.parse_tokens, "32.1k", "not a whole number"),
    (units.parse_tokens, "32KB", "write it like 512, 4096, 32k"),
    (units.parse_bytes, "80XB", "write it like 24GB, 80GiB"),
    (units.parse_bandwidth, "fast", "write it like 3.35TB/s"),
])  # fmt: skip
def test_bad_sizes_name_what_was_received(fn, text, match):
    with pytest.raises(ValueError, match=match):
        fn(text)


def test_sizes_must_be_text_or_int():
    with pytest.raises(TypeError, match="received 1.5"):
        units.parse_count(1.5)


@pytest.mark.parametrize("name, bits", [
    ("fp32", 32), ("bf16", 16), ("fp16", 16), ("fp8", 8), ("int8", 8), ("int4", 4),
    ("bfloat16", 16), ("torch.float16", 16), ("float8_e4m3fn", 8),
])  # fmt: skip
def test_dtype_bits(name, bits):
    assert units.dtype_bits(name) == bits


def test_unknown_dtype_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown dtype 'fp12'; valid: fp32, bf16, fp16, fp8"):
        units.dtype_bits("fp12")
    with pytest.raises(TypeError, match="received 16"):
        units.dtype_bits(16)


# --- geometry --------------------------------------------------------------------------


def test_attention_geometry_defaults_mirror_the_module():
    g = plan.AttentionGeometry(768, 12)
    assert (g.kind, g.n_kv_heads, g.head_dim, g.bias) == ("MHA", 12, 64, True)
    assert g.params == 4 * (768 * 768 + 768)  # GPT-2's attention block
    assert plan.AttentionGeometry(4096, 32, 8).label == "GQA-8"
    assert plan.AttentionGeometry(4544, 71, 1, head_dim=64).kind == "MQA"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"d_model": 768, "n_heads": 12, "n_kv_heads": 5}, ValueError,
     r"n_heads \(12\) must be divisible by n_kv_heads \(5\); valid: 1, 2, 3, 4, 6, 12"),
    ({"d_model": 768, "n_heads": 0}, ValueError, "n_heads must be an int >= 1; received 0"),
    ({"d_model": -1, "n_heads": 2}, ValueError, "d_model must be an int >= 1; received -1"),
    ({"d_model": 768, "n_heads": 12.0}, TypeError, r"n_heads must be an int >= 1; received 12.0 \(float\)"),
    ({"d_model": 8, "n_heads": 16}, ValueError, r"d_model \(8\) // n_heads \(16\) is 0"),
])  # fmt: skip
def test_bad_geometry_says_what_is_valid(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan.AttentionGeometry(**kwargs)


def test_latent_geometry_validation():
    with pytest.raises(ValueError, match="rope_dim must be even"):
        plan.LatentGeometry(64, 4, 16, rope_dim=3)
    with pytest.raises(ValueError, match="kv_rank must be an int >= 1; received 0"):
        plan.LatentGeometry(64, 4, 0)


def test_kv_cache_bytes_by_dtype():
    g = plan.AttentionGeometry(4096, 32, 8, bias=False)  # 2 * 8 * 128 = 2048 values/token
    assert [plan.kv_cache_bytes(g, 1000, 2, dt) for dt in ("fp32", "bf16", "fp8", "int4")] == [
        2048 * 2000 * 4, 2048 * 2000 * 2, 2048 * 2000, 2048 * 1000]
    with pytest.raises(ValueError, match="decompressed=True applies to MLA only"):
        plan.kv_cache_bytes(g, 1, decompressed=True)
    with pytest.raises(ValueError, match="batch must be an int >= 1; received 0"):
        plan.kv_cache_bytes(g, 1, 0)


def test_mla_latent_and_decompressed_cache():
    g = plan.LatentGeometry(2048, 16, 512, head_dim=128, rope_dim=64, v_head_dim=128)
    assert plan.kv_cache_bytes(g, 10, 1, "bf16") == 10 * 576 * 2
    assert plan.kv_cache_bytes(g, 10, 1, "bf16", decompressed=True) == 10 * 16 * 320 * 2


def small_model(**kw):
    base = dict(attention=plan.AttentionGeometry(256, 4, 2, bias=False), n_layers=4,
                vocab_size=1000, ffn=plan.FeedForward(512))
    return plan.ModelGeometry(**{**base, **kw})


def test_model_parts_add_up_by_hand():
    m = small_model()
    c = plan.param_counts(m)
    attn = 256 * 256 + 2 * 256 * 128 + 256 * 256
    assert c.attention_per_layer == attn
    assert c.embedding == 1000 * 256 and c.head == 0  # tied
    assert c.ffn == 4 * 3 * 256 * 512
    assert c.norms == (4 * 2 + 1) * 256
    assert c.total == c.active == 256_000 + 4 * attn + 4 * 393_216 + 9 * 256
    untied = plan.param_counts(small_model(tied_embeddings=False))
    assert untied.total - c.total == 1000 * 256


def test_attention_flops_by_hand():
    m = small_model()
    f = plan.attention_flops(m, 100)
    proj = 2 * (256 * 256 + 2 * 256 * 128 + 256 * 256)
    per_key = 2 * 4 * (64 + 64)  # q.k and p.v for 4 heads of 64
    assert f.projections_per_token == 4 * proj
    assert f.decode_per_token == 4 * (proj + 100 * per_key)
    assert f.prefill_total == 4 * (100 * proj + per_key * 100 * 101 // 2)
    assert f.prefill_per_token == f.prefill_total / 100
    # A window of 10 on every layer: queries see min(i, 10) keys.
    w = plan.attention_flops(small_model(window=10), 100)
    keys = 10 * 11 // 2 + 90 * 10
    assert w.prefill_total == 4 * (100 * proj + per_key * keys)
    assert w.decode_per_token == 4 * (proj + 10 * per_key)


def test_mla_decode_flops_absorbed_and_naive():
    g = plan.LatentGeometry(2048, 16, 512, head_dim=128, rope_dim=64, v_head_dim=128)
    m = plan.ModelGeometry(g, 1, 1000, plan.FeedForward(64))
    f = plan.attention_flops(m, 1000)
    assert f.decode_per_token == 2 * g.weights + 2 * 16 * 1000 * (2 * 512 + 64)
    assert f.decode_decompressed_per_token == 2 * g.weights + 2 * 16 * 1000 * (192 + 128)


def test_moe_expected_experts_per_step():
    moe = plan.MixtureOfExperts(n_experts=64, top_k=6, d_expert=100)
    e = moe.expert_params(10)
    assert moe.active_params(10, tokens=1) == pytest.approx(6 * e + 64 * 10)
    # Many tokens touch nearly every expert.
    assert moe.active_params(10, tokens=10_000) == pytest.approx(64 * e + 640)
    with pytest.raises(ValueError, match=r"top_k \(9\) must be <= n_experts \(8\)"):
        plan.MixtureOfExperts(n_experts=8, top_k=9, d_expert=4)


# --- devices ---------------------------------------------------------------------------


def test_unknown_device_lists_the_valid_ones():
    with pytest.raises(ValueError,
                       match=r"unknown device 'h100' \(did you mean h100-80gb or h100-pcie\?\); valid: h100-80gb"):
        plan.get_device("h100")
    assert plan.get_device("H100-80GB") is DEVICES["h100-80gb"]
    assert DEVICES["h200"].memory == 141 * GiB


def test_fit_and_decode_estimate_by_hand():
    CONFIGS = PUBLIC_CONFIGS

    llama = plan.read_config(CONFIGS["llama-3-8b"])
    dev = plan.custom_device(memory=40 * GiB, bandwidth=1_000 * 10**9)
    f = plan.fit(llama, dev, context=8192, batch=4)
    assert f.weights_bytes == 2 * 8_030_261_248
    assert f.kv_bytes == 131_072 * 8192 * 4
    assert f.usable_bytes == int(0.9 * 40 * GiB)
    # Decode reads every weight but the input embedding table, plus the whole cache.
    read = 2 * (8_030_261_248 - 128256 * 4096) + f.kv_bytes
    assert f.decode_s == pytest.approx(read / 1e12)
    assert f.tokens_per_s == pytest.approx(4 / f.decode_s)
    assert f.fits
    # 22.6 GB free holds 20 sequences of 8K (1 GiB each), and 43K tokens at batch 4.
    assert max_batch(llama, f) == f.free_bytes // (131_072 * 8192)
    ctx = max_context(llama, f)
    assert 131_072 * ctx * 4 <= f.free_bytes < 131_072 * (ctx + 1) * 4


def test_max_context_with_windows_and_without_cache():
    CONFIGS = PUBLIC_CONFIGS

    mistral = plan.read_config(CONFIGS["mistral-7b-v0.1"])
    f = plan.fit(mistral, DEVICES["h100-80gb"], context=32768, batch=1)
    assert max_context(mistral, f) == 2**40  # every layer is windowed: the cache stops growing
    bert = plan.read_config(CONFIGS["bert-base-uncased"])
    assert max_context(bert, plan.fit(bert, DEVICES["l4"], 512)) == 2**40
    huge = plan.fit(plan.read_config(CONFIGS["deepseek-v3"]), DEVICES["h100-80gb"], 4096)
    assert not huge.weights_fit and not huge.fits


def test_account_dict_schema():
    CONFIGS = PUBLIC_CONFIGS

    acc = plan.account(plan.read_config(CONFIGS["deepseek-v2-lite"]), 4096, 2, "bf16",
                       DEVICES["a100-80gb"])
    assert set(acc) == {"name", "family", "summary", "geometry", "params", "kv_cache", "flops",
                        "device", "warnings", "notes", "context", "batch", "dtype"}
    assert acc["geometry"]["mla"] == {"kv_rank": 512, "q_rank": None, "rope_dim": 64,
                                      "nope_head_dim": 128, "v_head_dim": 128}
    assert acc["kv_cache"]["bytes"] == 31_104 * 4096 * 2
    assert acc["kv_cache"]["decompressed_bytes"] == 276_480 * 4096 * 2
    assert acc["params"]["total"] == 15_706_484_224
    assert acc["device"]["fits"] is True
