"""plan reads real Hugging Face configs and gets the published numbers exactly.

The configs below are the public config.json files of each model (trimmed of fields
that do not change the shape: token ids, rope scaling, dropout...). Each expected
number has its derivation beside it, so a reader can check it by hand.
"""

import json

import pytest

from multihead import plan
from multihead.plan.geometry import LatentGeometry
from plan_public_configs import CONFIGS  # noqa: E402

KNOWN = {
    # 50257*768 + 1024*768 + 12*7,087,872 + 2*768; attention 4*(768^2 + 768);
    # KV 2 (K,V) * 12 layers * 768 * 2 bytes. Published: 124,439,808.
    "gpt2": (124_439_808, 2_362_368, 36_864),
    # (30522 + 512 + 2)*768 + 2*768 + 12*7,087,872 + pooler 768^2 + 768. Encoder: no cache.
    "bert-base-uncased": (109_482_240, 2_362_368, 0),
    # 2*128256*4096 + 32*(41,943,040 + 3*4096*14336 + 2*4096) + 4096;
    # attention 2*4096^2 + 2*4096*1024; KV 2 * 32 layers * 8 heads * 128 * 2 bytes.
    "llama-3-8b": (8_030_261_248, 41_943_040, 131_072),
    # Llama-3-8B with a 32000 vocabulary: 8,030,261,248 - 2*(128256-32000)*4096.
    "mistral-7b-v0.1": (7_241_732_096, 41_943_040, 131_072),
    # q 3584^2+3584, k and v 3584*512+512 each, o 3584^2 (no bias): 29,364,736;
    # 2*152064*3584 + 28*(29,364,736 + 3*3584*18944 + 2*3584) + 3584. KV 2*28*4*128*2.
    "qwen2-7b": (7_615_616_512, 29_364_736, 57_344),
    # head_dim 256: q 3584*4096, k/v 3584*2048, o 4096*3584 = 44,040,192; tied embeddings;
    # 256000*3584 + 42*(44,040,192 + 3*3584*14336 + 4*3584) + 3584. KV 2*42*8*256*2.
    "gemma-2-9b": (9_241_705_984, 44_040_192, 344_064),
    # 256000*3072 + 28*(4*3072*4096 + 3*3072*24576 + 2*3072) + 3072 (published 8.54B).
    "gemma-7b": (8_537_680_896, 50_331_648, 458_752),
    # One KV head: qkv 4544*(71+2)*64, dense 4544^2 = 41,877,504; tied; one LayerNorm per
    # block: 65024*4544 + 32*(41,877,504 + 2*4544*18176 + 2*4544) + 2*4544. KV 2*32*1*64*2.
    "falcon-7b": (6_921_720_704, 41_877_504, 8_192),
    # 2*32064*3072 + 32*(4*3072^2 + 3*3072*8192 + 2*3072) + 3072. KV 2*32*32*96*2.
    "phi-3-mini-4k": (3_821_079_552, 37_748_736, 393_216),
    # MLA: q 2048*16*192, kv_a 2048*576, kv_norm 512, kv_b 512*16*256, o 2048*2048 =
    # 13,763,072. 2*102400*2048 + 27*attention + dense 3*2048*10944 + 26 MoE layers of
    # 66 experts (64 routed + 2 shared) * 3*2048*1408 + router 64*2048, + 55*2048 norms.
    # Published as 15.7B. KV (latent) 27 layers * (512 + 64) * 2 bytes.
    "deepseek-v2-lite": (15_706_484_224, 13_763_072, 31_104),
    # MLA with q_rank 1536: 7168*1536 + 1536 + 1536*128*192 + 7168*576 + 512 + 512*128*256
    # + 16384*7168 = 187,107,328. 2*129280*7168 + 61*attention + 3 dense 3*7168*18432 +
    # 58 MoE layers of 257 experts * 3*7168*2048 + router 256*7168 + 256 score-correction
    # biases, + 123*7168 norms = 671,026,419,200: the published "671B" of the main model
    # (the checkpoint's 685B adds the multi-token-prediction module, not counted here).
    "deepseek-v3": (671_026_419_200, 187_107_328, 70_272),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_parameter_counts_and_cache(name):
    total, attn, kv = KNOWN[name]
    model = plan.read_config(CONFIGS[name], name=name)
    counts = plan.param_counts(model)
    assert counts.total == total, f"{name}: {counts.total:,} != {total:,}"
    assert counts.attention_per_layer == attn
    assert plan.kv_bytes_per_token(model, "bf16") == kv
    assert counts.total == (counts.embedding + counts.attention + counts.ffn + counts.norms
                            + counts.head + counts.pooler)


def test_read_config_from_a_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS["llama-3-8b"]))
    model = plan.read_config(path)
    assert model.family == "llama"
    assert model.name == tmp_path.name  # a model directory names the model
    assert plan.model_params(model) == 8_030_261_248


def test_gemma2_head_dim_and_local_global_layers():
    model = plan.read_config(CONFIGS["gemma-2-9b"])
    a = model.attention
    assert (a.d_model, a.n_heads, a.d_head) == (3584, 16, 256)  # 16 * 256 = 4096 != 3584
    assert (model.window, model.n_window_layers, model.n_global_layers) == (4096, 21, 21)
    # 8K context: 21 global layers hold 8192 tokens, 21 local layers only 4096;
    # each token-layer is 2 * 8 heads * 256 * 2 bytes = 8192 bytes.
    assert plan.model_kv_cache_bytes(model, 8192, 1, "bf16") == 21 * (8192 + 4096) * 8192
    # Below the window, every layer holds every token.
    assert plan.model_kv_cache_bytes(model, 4096, 1, "bf16") == 42 * 4096 * 8192


def test_mistral_window_caps_the_cache():
    model = plan.read_config(CONFIGS["mistral-7b-v0.1"])
    assert plan.model_kv_cache_bytes(model, 32768, 2, "bf16") == 2 * 32 * 4096 * 4096
    assert plan.model_kv_cache_bytes(model, 1000, 1, "bf16") == 1000 * 131_072


def test_qwen2_sliding_window_is_off_unless_used():
    model = plan.read_config(CONFIGS["qwen2-7b"])
    assert model.window is None
    a = model.attention
    assert a.bias and not a.has_o_bias
    on = dict(CONFIGS["qwen2-7b"], use_sliding_window=True, sliding_window=4096,
              max_window_layers=20)
    windowed = plan.read_config(on)
    assert (windowed.window, windowed.n_window_layers) == (4096, 8)  # layers 20..27


def test_falcon_multi_query_overrides_num_kv_heads():
    cfg = dict(CONFIGS["falcon-7b"], num_kv_heads=71)
    assert plan.read_config(cfg).attention.n_kv == 1
    # The new decoder architecture (Falcon-40B) trusts num_kv_heads and has two norms.
    cfg40 = dict(cfg, new_decoder_architecture=True, num_kv_heads=8, hidden_size=8192,
                 num_attention_heads=128, num_hidden_layers=60)
    m40 = plan.read_config(cfg40)
    assert (m40.attention.n_kv, m40.norms_per_layer) == (8, 2)
    # Falcon-40B shape: 65024*8192 + 60*(8192*(128+16)*64 + 8192^2 + 2*8192*32768
    # + 2*2*8192) + 2*8192 = 532,676,608 + 60*679,510,016 + 16,384 (published as "40B").
    assert plan.model_params(m40) == 41_303_293_952
    # multi_query false and no num_kv_heads: MHA.
    mha = plan.read_config(dict(CONFIGS["falcon-7b"], multi_query=False))
    assert mha.attention.kind == "MHA"
    # The old RefinedWeb model_type is read as falcon.
    old = plan.read_config(dict(CONFIGS["falcon-7b"], model_type="RefinedWebModel"))
    assert plan.model_params(old) == 6_921_720_704


def test_mla_cache_is_the_latent_not_num_key_value_heads():
    model = plan.read_config(CONFIGS["deepseek-v2-lite"])
    a = model.attention
    assert isinstance(a, LatentGeometry)
    assert a.kv_elements_per_token == 576  # kv_lora_rank 512 + qk_rope_head_dim 64
    # A cache of decompressed K and V: per layer 16 heads * (192 + 128) values.
    assert plan.kv_bytes_per_token(model, "bf16", decompressed=True) == 27 * 16 * 320 * 2
    # GQA-style arithmetic with num_key_value_heads=16 would wrongly say 221,184 bytes,
    # 7.1x the latent's 31,104.
    assert plan.kv_bytes_per_token(model, "bf16") == 27 * 576 * 2 == 31_104 < 2 * 27 * 16 * 128 * 2
    assert any("num_key_value_heads" in n for n in model.notes)


def test_moe_active_parameters():
    model = plan.read_config(CONFIGS["deepseek-v2-lite"])
    counts = plan.param_counts(model)
    # 6 of 64 routed experts + 2 shared + router in 26 MoE layers; the rest is dense.
    expert = 3 * 2048 * 1408
    moe_active = 26 * (8 * expert + 64 * 2048)
    dense = counts.total - 26 * (66 * expert + 64 * 2048)
    assert counts.active == dense + moe_active == 2_661_150_208
    # Without the input embedding table (a lookup): 2.45B, the published "2.4B activated".
    assert counts.active - 102400 * 2048 == 2_451_435_008


def test_deepseek_v3_mtp_is_noted_not_counted():
    model = plan.read_config(CONFIGS["deepseek-v3"])
    assert model.moe.router_bias and model.n_moe_layers == 58
    assert any("multi-token" in n for n in model.notes)


def test_bert_is_an_encoder_without_cache():
    model = plan.read_config(CONFIGS["bert-base-uncased"])
    assert not model.causal
    assert plan.model_kv_cache_bytes(model, 512, 8) == 0
    flops = plan.attention_flops(model, 512)
    assert flops.decode_per_token is None
    # Bidirectional: every one of 512 queries sees 512 keys, 12 layers.
    proj = 2 * 4 * 768 * 768
    assert flops.prefill_total == 12 * (512 * proj + 2 * 12 * 512 * 512 * 128)


# --- bad configs -------------------------------------------------------------------


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match=r"unknown model_type 'mamba'; supported: .*llama"):
        plan.read_config({"model_type": "mamba", "hidden_size": 768})


@pytest.mark.parametrize("family", ["llama", "gpt2", "deepseek-v3"])
def test_missing_field_is_named(family):
    name = {"llama": "llama-3-8b", "gpt2": "gpt2", "deepseek-v3": "deepseek-v3"}[family]
    field = {"llama": "num_hidden_layers", "gpt2": "n_layer", "deepseek-v3": "kv_lora_rank"}
    cfg = dict(CONFIGS[name])
    del cfg[field[family]]
    with pytest.raises(ValueError, match=f"needs the field '{field[family]}'"):
        plan.read_config(cfg)


def test_gemma_without_head_dim_is_an_error():
    cfg = dict(CONFIGS["gemma-2-9b"])
    del cfg["head_dim"]
    with pytest.raises(ValueError, match="'head_dim'"):
        plan.read_config(cfg)


def test_bad_field_types_and_values():
    with pytest.raises(ValueError, match=r"'num_hidden_layers'.*integer; received '32'"):
        plan.read_config(dict(CONFIGS["llama-3-8b"], num_hidden_layers="32"))
    with pytest.raises(ValueError, match=r"'num_attention_heads'.*>= 1; received 0"):
        plan.read_config(dict(CONFIGS["llama-3-8b"], num_attention_heads=0))
    with pytest.raises(ValueError, match=r"not divisible by num_key_value_heads \(5\)"):
        plan.read_config(dict(CONFIGS["llama-3-8b"], num_key_value_heads=5))


def test_not_json_and_not_a_model_config(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        plan.read_config(bad)
    listy = tmp_path / "list.json"
    listy.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        plan.read_config(listy)
    other = tmp_path / "tokenizer.json"
    other.write_text(json.dumps({"version": "1.0", "truncation": None}))
    with pytest.raises(ValueError, match=r"no 'model_type'.*supported families"):
        plan.read_config(other)
    with pytest.raises(ValueError, match="cannot read"):
        plan.read_config(tmp_path / "missing.json")
