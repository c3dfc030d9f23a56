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
    # Mixtral-8x7B: Mistral-7B's attention (41,943,040) and 8 experts of 3*4096*14336 =
    # 176,160,768 in every layer, router 8*4096, 2 norms: 1,451,270,144 per layer;
    # 32 layers + 2*32000*4096 + 4096 = 46,702,792,704 (published "46.7B"). KV as Mistral.
    "mixtral-8x7b": (46_702_792_704, 41_943_040, 131_072),
    # Qwen1.5-MoE-A2.7B: attention 4*2048^2 + 3*2048 (q/k/v biases) = 16,783,360; 60 experts
    # of 3*2048*1408 = 8,650,752, ONE shared MLP 3*2048*5632 = 34,603,008 and its gate 2048,
    # router 60*2048, 2 norms: 570,560,512 per layer; 24 layers + 2*151936*2048 + 2048 =
    # 14,315,784,192 (published "14.3B"). KV 2*24*16*128*2.
    "qwen1.5-moe-a2.7b": (14_315_784_192, 16_783_360, 196_608),
    # Qwen3-30B-A3B: q 2048*4096, k/v 2048*512, o 4096*2048, q/k norms 2*128 = 18,874,624;
    # 128 experts of 3*2048*768 = 4,718,592, router 128*2048, 2 norms: 623,120,640 per layer;
    # 48 layers + 2*151936*2048 + 2048 = 30,532,122,624 (published "30.5B"). KV 2*48*4*128*2.
    "qwen3-30b-a3b": (30_532_122_624, 18_874_624, 98_304),
    # Qwen3-8B: Llama-3-8B's attention + q/k norms (2*128) = 41,943,296; MLP 3*4096*12288;
    # 36 layers of 193,946,432 + 2*151936*4096 + 4096 = 8,190,735,360 (published "8.2B").
    "qwen3-8b": (8_190_735_360, 41_943_296, 147_456),
    # Gemma-3-1B: q 1152*1024, k/v 1152*256, o 1024*1152, q/k norms 2*256 = 2,949,632; MLP
    # 3*1152*6912; 4 norms: 26 layers of 26,842,112 + tied 262144*1152 + 1152 =
    # 999,885,952 (published "1B"). KV 2*26*1*256*2 (before the 512 window fills).
    "gemma-3-1b": (999_885_952, 2_949_632, 26_624),
    # Gemma-3-4B's language model (text_config over Gemma3TextConfig's defaults: 8 heads,
    # 4 KV heads of 256, vocab 262208): q 2560*2048, k/v 2560*1024, o 2048*2560, q/k norms
    # 512 = 15,729,152; MLP 3*2560*10240; 4 norms: 34 layers of 94,382,592 + tied
    # 262208*2560 + 2560 = 3,880,263,168 (the published 4.3B adds the SigLIP tower).
    "gemma-3-4b": (3_880_263_168, 15_729_152, 139_264),
    # Pythia-160M: attention 4*(768^2 + 768), MLP 2*768*3072 + 3072 + 768, 2 LayerNorms
    # with biases: 12 layers of 7,087,872 + untied 2*50304*768 + 1536 = 162,322,944
    # (the Pythia paper's count). KV 2*12*768*2.
    "pythia-160m": (162_322_944, 2_362_368, 36_864),
    # GPT-NeoX-20B: 44 layers of 4*(6144^2 + 6144) + 2*6144*24576 + 24576 + 6144 + 4*6144
    # = 453,009,408 + 2*50432*6144 + 12288 = 20,554,567,680 (the paper's 20,554,567,680).
    "gpt-neox-20b": (20_554_567_680, 151_019_520, 1_081_344),
    # gpt-oss-20b: q 2880*4096 + 4096, k/v 2880*512 + 512, o 4096*2880 + 2880, 64 sinks =
    # 26,550,144; 32 experts of gate_up 2880*5760 + 5760 and down 2880*2880 + 2880 =
    # 24,891,840, router 32*2880 + 32, 2 norms: 823,186,976 per layer; 24 layers + untied
    # 2*201088*2880 + 2880 = 20,914,757,184 (published "21B"). KV 2*24*8*64*2.
    "gpt-oss-20b": (20_914_757_184, 26_550_144, 49_152),
    # gpt-oss-120b: the same layer with 128 experts (3,212,352,192 + 26,550,144 + 368,768 +
    # 5,760), 36 layers: 116,829,156,672 (published "117B").
    "gpt-oss-120b": (116_829_156_672, 26_550_144, 73_728),
}

# Active parameters per token: name -> (active, active without the input embedding table,
# which is a lookup, the way model cards count "activated" parameters).
ACTIVE = {
    # 32 * (41,943,040 + 2 of 8 experts 352,321,536 + router 32,768 + 8192) + 2*32000*4096
    # + 4096: 12.9B, Mistral AI's "12.9B active".
    "mixtral-8x7b": (12_879_925_248, 12_748_853_248),
    # 24 * (16,783,360 + 4 of 60 experts 34,603,008 + shared 34,603,008 + gate 2048 + router
    # 122,880 + 4096) + 2*151936*2048 + 2048: Qwen's "2.7B activated".
    "qwen1.5-moe-a2.7b": (2_689_173_504, 2_378_008_576),
    # 48 * (18,874,624 + 8 of 128 experts 37,748,736 + router 262,144 + 4096) + 2*151936*2048
    # + 2048: Qwen's "3.3B activated".
    "qwen3-30b-a3b": (3_353_032_704, 3_041_867_776),
    # 24 * (26,550,144 + 4 of 32 experts 99,567,360 + router 92,192 + 5760) + 2*201088*2880
    # + 2880 = 4,187,440,704; without embed_tokens 3,608,307,264: OpenAI's "3.6B active".
    "gpt-oss-20b": (4_187_440_704, 3_608_307_264),
    # 36 layers, 4 of 128 experts: 5,132,849,472 without embed_tokens, OpenAI's "5.1B".
    "gpt-oss-120b": (5_711_982_912, 5_132_849_472),
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


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_moe_total_and_active(name):
    model = plan.read_config(CONFIGS[name])
    counts = plan.param_counts(model)
    active, without_embedding = ACTIVE[name]
    assert counts.active == active, f"{name}: {counts.active:,} != {active:,}"
    assert counts.active - model.vocab_size * model.d_model == without_embedding
    assert model.n_moe_layers == model.n_layers and counts.active < counts.total


@pytest.mark.parametrize("name", sorted(set(KNOWN) - {"bert-base-uncased"}))
def test_counts_equal_transformers_on_the_meta_device(name):
    """An independent reference: transformers builds the model skeleton from the same
    config (meta device: shapes, no memory) and we sum `numel()`. The attention block
    is the first module whose class is named *Attention (q/k norms and sinks included)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dict(CONFIGS[name])
    config = transformers.CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
    if name == "gemma-3-4b":
        config = config.text_config  # the language model; the vision tower is not counted
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    # DeepSeek-V3's router score correction is a buffer in transformers, a tensor in the
    # checkpoint: plan counts it.
    total += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    counts = plan.param_counts(plan.read_config(CONFIGS[name]))
    assert counts.total == total, f"{name}: plan {counts.total:,} != transformers {total:,}"
    assert counts.attention_per_layer == sum(p.numel() for p in attn.parameters())
    types = getattr(config, "layer_types", None)
    model_geometry = plan.read_config(CONFIGS[name])
    if types and model_geometry.window is not None:
        assert model_geometry.n_window_layers == types.count("sliding_attention")


def test_sliding_windows_of_the_new_families():
    # gpt-oss: 128-token windows on every other layer (12 of 24); sinks add no cache.
    oss = plan.read_config(CONFIGS["gpt-oss-20b"])
    assert (oss.window, oss.n_window_layers, oss.sinks) == (128, 12, True)
    per_layer_token = 2 * 8 * 64 * 2
    assert plan.model_kv_cache_bytes(oss, 131072, 1, "bf16") == (12 * 131072 + 12 * 128) * per_layer_token
    # Gemma-3-1B: sliding_window_pattern 6 makes layers 5, 11, 17, 23 global: 22 local.
    g1 = plan.read_config(CONFIGS["gemma-3-1b"])
    assert (g1.window, g1.n_window_layers) == (512, 22)
    assert plan.model_kv_cache_bytes(g1, 32768, 1, "bf16") == (4 * 32768 + 22 * 512) * 2 * 256 * 2
    # The multimodal Gemma-3-4B: 34 layers, 5 of 6 local (29), window 1024, and a note.
    g4 = plan.read_config(CONFIGS["gemma-3-4b"])
    assert (g4.window, g4.n_window_layers, g4.family) == (1024, 29, "gemma3")
    assert any("vision tower" in n for n in g4.notes)


def test_qwen_moe_layer_placement():
    # decoder_sparse_step counts from layer 1 (transformers: (i + 1) % step == 0), and
    # mlp_only_layers stay dense with intermediate_size.
    cfg = dict(CONFIGS["qwen1.5-moe-a2.7b"], decoder_sparse_step=2, mlp_only_layers=[1])
    model = plan.read_config(cfg)
    moe_layers = [i for i in range(24) if model.moe.is_moe_layer(i)]
    assert moe_layers == list(range(3, 24, 2))
    assert model.n_moe_layers == 11
    full = plan.read_config(CONFIGS["qwen1.5-moe-a2.7b"])
    dense_layer = 3 * 2048 * 5632
    moe_layer = 60 * 3 * 2048 * 1408 + 3 * 2048 * 5632 + 2048 + 60 * 2048
    assert plan.model_params(full) - plan.model_params(model) == 13 * (moe_layer - dense_layer)


def test_read_config_from_a_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS["llama-3-8b"]))
    model = plan.read_config(path)
    assert model.family == "llama"
    assert model.name == tmp_path.name  # a model directory names the model
    assert plan.model_params(model) == 8_030_261_248
    # A model folder reads its config.json.
    assert plan.model_params(plan.read_config(tmp_path)) == 8_030_261_248
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty is a folder without a config.json"):
        plan.read_config(empty)


def test_gemma2_head_dim_and_local_global_layers():
    model = plan.read_config(CONFIGS["gemma-2-9b"])
    a = model.attention
    assert (a.d_model, a.n_heads, a.head_dim) == (3584, 16, 256)  # 16 * 256 = 4096 != 3584
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
    assert plan.read_config(cfg).attention.n_kv_heads == 1
    # The new decoder architecture (Falcon-40B) trusts num_kv_heads and has two norms.
    cfg40 = dict(cfg, new_decoder_architecture=True, num_kv_heads=8, hidden_size=8192,
                 num_attention_heads=128, num_hidden_layers=60)
    m40 = plan.read_config(cfg40)
    assert (m40.attention.n_kv_heads, m40.norms_per_layer) == (8, 2)
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
    with pytest.raises(ValueError, match=r"^config: num_attention_heads \(32\) must be divisible by "
                                         r"num_key_value_heads \(5\); valid: 1, 2, 4, 8, 16, 32$"):
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


# --- hostile files: every one a ValueError naming the file and the field ---------------


def _write(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def test_a_huge_number_is_refused_with_the_field(tmp_path):
    cfg = json.dumps(CONFIGS["llama-3-8b"]).replace('"num_hidden_layers": 32', '"num_hidden_layers": ' + "9" * 400)
    path = _write(tmp_path, "big.json", cfg)
    with pytest.raises(ValueError, match=r"big.json: field 'num_hidden_layers' is a 400-digit number; "
                                         r"no setting is that large"):
        plan.read_config(path)
    # Past Python's 4300-digit limit the JSON parser itself refuses: still named.
    path = _write(tmp_path, "huge.json", '{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match=r"huge.json is not a usable Hugging Face config.json"):
        plan.read_config(path)
    # A float overflow (1e999 is inf) or NaN is not an integer field.
    path = _write(tmp_path, "inf.json", json.dumps(CONFIGS["llama-3-8b"]).replace('"hidden_size": 4096',
                                                                                '"hidden_size": 1e999'))
    with pytest.raises(ValueError, match=r"inf.json: field 'hidden_size' is inf .*expected a finite number"):
        plan.read_config(path)
    path = _write(tmp_path, "nan.json", '{"model_type": "llama", "hidden_size": NaN}')
    with pytest.raises(ValueError, match=r"nan.json: NaN is not a valid JSON number"):
        plan.read_config(path)


def test_deep_json_and_bad_bytes_and_endless_files(tmp_path):
    path = _write(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"deep.json nests \d+ levels deep"):
        plan.read_config(path)
    raw = '{"model_type": "llama", "name": "caf\xe9"}'.encode("latin-1")
    path = _write(tmp_path, "latin1.json", raw)
    with pytest.raises(ValueError, match=rf"latin1.json is not UTF-8 text \(byte 0xe9 at offset {raw.index(0xE9)}\)"):
        plan.read_config(path)
    # A file that never ends (what /dev/zero is on most machines): at most
    # MAX_CONFIG_BYTES + 1 bytes are read by the reader read_config uses. A FIFO fed forever
    # by a thread stands for it (read_config itself refuses pipes and devices before opening
    # them: tests/test_plan_hostile.py).
    import os
    import threading

    from multihead.files import read_json
    from multihead.plan.configs import MAX_CONFIG_BYTES

    fifo = tmp_path / "endless.json"
    os.mkfifo(fifo)

    def feed():
        try:
            with open(fifo, "wb") as w:
                while True:
                    w.write(b" " * 65536)
        except (BrokenPipeError, OSError):
            pass  # the reader stopped: done

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    with pytest.raises(ValueError, match=r"endless.json is larger than 4 MiB"):
        read_json(fifo, max_bytes=MAX_CONFIG_BYTES)
    writer.join(timeout=10)
    assert not writer.is_alive()
    if os.path.exists("/dev/zero"):
        with pytest.raises(ValueError, match=r"^/dev/zero is a device, not a regular file"):
            plan.read_config("/dev/zero")
    path = _write(tmp_path, "padded.json", b" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match=r"padded.json is larger than"):
        plan.read_config(path)


@pytest.mark.parametrize("field, value, expected", [
    ("model_type", ["llama"], r"field 'model_type' must be a string .*received \['llama'\]"),
    ("model_type", {"x": 1}, r"field 'model_type' must be a string"),
    ("layer_types", "sliding_attention", r"field 'layer_types' .* list of strings"),
    ("layer_types", ["sliding_attention"] * 3, r"'layer_types' has 3 entries but num_hidden_layers is 24"),
    ("mlp_only_layers", [1, "2"], r"field 'mlp_only_layers' .* list of layer indices"),
    ("num_experts_per_tok", 99, r"top_k \(99\) must be <= n_experts \(32\)"),
    ("tie_word_embeddings", "no", r"field 'tie_word_embeddings' .* true or false; received 'no'"),
    ("hidden_size", "x" * 10_000, r"field 'hidden_size' .* integer; received 'xxxx.{0,60}\.\.\.$"),
])
def test_bad_fields_name_the_file_and_the_field(tmp_path, field, value, expected):
    base = "qwen1.5-moe-a2.7b" if field == "mlp_only_layers" else "gpt-oss-20b"
    path = _write(tmp_path, "cfg.json", json.dumps(dict(CONFIGS[base], **{field: value})))
    with pytest.raises(ValueError, match=r"cfg.json") as info:
        plan.read_config(path)
    import re

    assert re.search(expected, str(info.value)), str(info.value)
    assert len(str(info.value)) < 400


def test_gemma3_without_text_config():
    cfg = {k: v for k, v in CONFIGS["gemma-3-4b"].items() if k != "text_config"}
    with pytest.raises(ValueError, match=r"needs a 'text_config' object"):
        plan.read_config(cfg)
