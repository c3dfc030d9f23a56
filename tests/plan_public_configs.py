"""Public config.json contents of real models (from their Hugging Face repos), shared by
the plan tests."""

CONFIGS = {
    "gpt2": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "activation_function": "gelu_new",
        "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
        "n_inner": None, "vocab_size": 50257, "layer_norm_epsilon": 1e-05,
    },
    "bert-base-uncased": {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 768,
        "intermediate_size": 3072, "max_position_embeddings": 512, "num_attention_heads": 12,
        "num_hidden_layers": 12, "type_vocab_size": 2, "vocab_size": 30522, "hidden_act": "gelu",
    },
    "llama-3-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
    },
    "mistral-7b-v0.1": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "vocab_size": 32000,
    },
    "qwen2-7b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064,
    },
    "gemma-2-9b": {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid",
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192,
        "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "sliding_window": 4096,
        "vocab_size": 256000,
    },
    "gemma-7b": {
        "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "head_dim": 256,
        "hidden_size": 3072, "intermediate_size": 24576, "max_position_embeddings": 8192,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06, "vocab_size": 256000,
    },
    "falcon-7b": {
        "model_type": "falcon", "architectures": ["FalconForCausalLM"], "alibi": False,
        "apply_residual_connection_post_layernorm": False, "bias": False, "hidden_size": 4544,
        "layer_norm_epsilon": 1e-05, "multi_query": True, "new_decoder_architecture": False,
        "num_attention_heads": 71, "num_hidden_layers": 32, "parallel_attn": True,
        "vocab_size": 65024,
    },
    "phi-3-mini-4k": {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072,
        "intermediate_size": 8192, "max_position_embeddings": 4096, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "sliding_window": 2047,
        "tie_word_embeddings": False, "vocab_size": 32064,
    },
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False, "first_k_dense_replace": 1, "hidden_size": 2048,
        "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
        "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06, "scoring_func": "softmax", "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
    },
    "deepseek-v3": {
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
    },
}  # fmt: skip

# name -> (total params, attention params per layer, KV bytes per token in bf16)
