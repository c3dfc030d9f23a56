"""Named presets: the public config.json of well-known models, shipped with the package.

`multihead plan --model llama-3-8b` (and `plan.read_config("llama-3-8b")`) reads the
preset when no file or folder of that name exists; `plan --list-models` lists them. A
preset is also found by its Hugging Face repository id or that id's last part, in any
case (`meta-llama/Meta-Llama-3-8B`, `Meta-Llama-3-8B`): exact names only, no guessing;
an unknown name gets the close ones as "did you mean".

The contents are the fields of each repository's config.json that the accounting reads
(and a few more for recognition), copied as published; the known parameter counts in
tests/test_plan_configs.py are derived from them independently and cross-checked against
transformers' own models built on the meta device.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    name: str
    repo: str  # the Hugging Face repository the config.json comes from
    config: dict = field(repr=False, compare=False, hash=False)


PRESETS: dict[str, Preset] = {
    "gpt2": Preset("gpt2", "openai-community/gpt2", {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "activation_function": "gelu_new", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
        "n_layer": 12, "n_positions": 1024, "n_inner": None, "vocab_size": 50257,
        "layer_norm_epsilon": 1e-05,
    }),
    "bert-base-uncased": Preset("bert-base-uncased", "google-bert/bert-base-uncased", {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 768,
        "intermediate_size": 3072, "max_position_embeddings": 512, "num_attention_heads": 12,
        "num_hidden_layers": 12, "type_vocab_size": 2, "vocab_size": 30522, "hidden_act": "gelu",
    }),
    "minilm": Preset("minilm", "sentence-transformers/all-MiniLM-L6-v2", {
        "model_type": "bert", "architectures": ["BertModel"], "hidden_size": 384,
        "intermediate_size": 1536, "max_position_embeddings": 512, "num_attention_heads": 12,
        "num_hidden_layers": 6, "type_vocab_size": 2, "vocab_size": 30522, "hidden_act": "gelu",
    }),
    "llama-3-8b": Preset("llama-3-8b", "meta-llama/Meta-Llama-3-8B", {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
    }),
    "mistral-7b-v0.1": Preset("mistral-7b-v0.1", "mistralai/Mistral-7B-v0.1", {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "vocab_size": 32000,
    }),
    "qwen2-7b": Preset("qwen2-7b", "Qwen/Qwen2-7B", {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064,
    }),
    "qwen2.5-7b": Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B", {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064,
    }),
    "gemma-2-9b": Preset("gemma-2-9b", "google/gemma-2-9b", {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid",
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192,
        "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "sliding_window": 4096,
        "vocab_size": 256000,
    }),
    "gemma-7b": Preset("gemma-7b", "google/gemma-7b", {
        "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "head_dim": 256,
        "hidden_size": 3072, "intermediate_size": 24576, "max_position_embeddings": 8192,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06, "vocab_size": 256000,
    }),
    "falcon-7b": Preset("falcon-7b", "tiiuae/falcon-7b", {
        "model_type": "falcon", "architectures": ["FalconForCausalLM"], "alibi": False,
        "apply_residual_connection_post_layernorm": False, "bias": False, "hidden_size": 4544,
        "layer_norm_epsilon": 1e-05, "multi_query": True, "new_decoder_architecture": False,
        "num_attention_heads": 71, "num_hidden_layers": 32, "parallel_attn": True,
        "vocab_size": 65024,
    }),
    "phi-3-mini-4k": Preset("phi-3-mini-4k", "microsoft/Phi-3-mini-4k-instruct", {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072,
        "intermediate_size": 8192, "max_position_embeddings": 4096, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "sliding_window": 2047, "tie_word_embeddings": False, "vocab_size": 32064,
    }),
    "deepseek-v2-lite": Preset("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False, "first_k_dense_replace": 1, "hidden_size": 2048,
        "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
        "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "scoring_func": "softmax", "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
    }),
    "deepseek-v3": Preset("deepseek-v3", "deepseek-ai/DeepSeek-V3", {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False, "first_k_dense_replace": 3, "hidden_size": 7168,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
        "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
    }),
    "mixtral-8x7b": Preset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "vocab_size": 32000,
    }),
    "qwen1.5-moe-a2.7b": Preset("qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", {
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
        "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
        "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
        "norm_topk_prob": False,
    }),
    "qwen3-30b-a3b": Preset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128, "hidden_size": 2048,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936,
    }),
    "qwen3-8b": Preset("qwen3-8b", "Qwen/Qwen3-8B", {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
        "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288,
        "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 32,
        "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936,
    }),
    "gemma-3-1b": Preset("gemma-3-1b", "google/gemma-3-1b-pt", {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "vocab_size": 262144,
    }),
    "gemma-3-4b": Preset("gemma-3-4b", "google/gemma-3-4b-pt", {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {
                "factor": 8.0, "rope_type": "linear",
            },
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
            "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
            "patch_size": 14, "vision_use_head": False,
        },
    }),
    "smollm2-135m": Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
        "max_position_embeddings": 8192, "mlp_bias": False, "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-05,
        "rope_theta": 100000, "tie_word_embeddings": True, "vocab_size": 49152,
    }),
    "pythia-160m": Preset("pythia-160m", "EleutherAI/pythia-160m", {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_act": "gelu",
        "hidden_size": 768, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
        "max_position_embeddings": 2048, "num_attention_heads": 12, "num_hidden_layers": 12,
        "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
        "use_parallel_residual": True, "vocab_size": 50304,
    }),
    "gpt-neox-20b": Preset("gpt-neox-20b", "EleutherAI/gpt-neox-20b", {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
        "hidden_act": "gelu_fast", "hidden_size": 6144, "intermediate_size": 24576,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "num_attention_heads": 64,
        "num_hidden_layers": 44, "rotary_emb_base": 10000, "rotary_pct": 0.25,
        "tie_word_embeddings": False, "use_parallel_residual": True, "vocab_size": 50432,
    }),
    "gpt-oss-20b": Preset("gpt-oss-20b", "openai/gpt-oss-20b", {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True,
        "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
        "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "vocab_size": 201088,
    }),
    "gpt-oss-120b": Preset("gpt-oss-120b", "openai/gpt-oss-120b", {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True,
        "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128,
        "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "vocab_size": 201088,
    }),
}  # fmt: skip

_BY_ALIAS = {alias.lower(): p for p in PRESETS.values()
             for alias in (p.name, p.repo, p.repo.rsplit("/", 1)[-1])}


def find_preset(name: str) -> Preset | None:
    """The preset of this name, repository id or repository name (any case), else None."""
    return _BY_ALIAS.get(name.strip().lower()) if isinstance(name, str) else None


def preset_config(name: str) -> dict:
    """A copy of the preset's config.json contents (edit it freely); ValueError if unknown."""
    preset = find_preset(name)
    if preset is None:
        raise ValueError(f"unknown preset {name!r}{did_you_mean(name)}; valid: {', '.join(PRESETS)}")
    return copy.deepcopy(preset.config)


def did_you_mean(name: str) -> str:
    """' (did you mean llama-3-8b?)' for a name close to a preset's, else ''."""
    key = str(name).strip().lower().removesuffix("/config.json").removesuffix(".json")
    close = difflib.get_close_matches(key, list(_BY_ALIAS), n=3, cutoff=0.6)
    names = list(dict.fromkeys(_BY_ALIAS[c].name for c in close))
    return f" (did you mean {' or '.join(names)}?)" if names else ""


__all__ = ["PRESETS", "Preset", "did_you_mean", "find_preset", "preset_config"]
