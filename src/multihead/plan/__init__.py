"""plan: exact accounting of attention geometry, and a recommender (`multihead plan`).

Pure Python, no torch: parameters, KV-cache bytes (window- and MLA-aware), attention
FLOPs, and device fit for a model's shape; a reader for Hugging Face config.json files
(gpt2, bert, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma, gemma2,
gemma3, falcon, phi3, gpt_neox, gpt_oss, deepseek_v2/v3; MoE with total and active
parameters); and a deterministic recommender of heads, KV heads and attention variant.

`recommend(Request(...))` returns a `Recommendation`; `read_config` takes a path, a dict
or a preset name. The numbers equal the library's modules (tested).

Details: docs/plan.md, "`multihead.plan` from Python, in short".
"""

from multihead.plan.configs import SUPPORTED, read_config
from multihead.plan.devices import DEVICES, Device, Fit, custom_device, fit, get_device
from multihead.plan.geometry import (
    AttentionFlops,
    AttentionGeometry,
    FeedForward,
    LatentGeometry,
    MixtureOfExperts,
    ModelGeometry,
    ParamCounts,
    attention_flops,
    attention_params,
    describe,
    kv_bytes_per_token,
    kv_cache_bytes,
    model_kv_cache_bytes,
    model_params,
    param_counts,
)
from multihead.plan.recommend import Recommendation, Request, recommend
from multihead.plan.report import account, account_text
from multihead.plan.text import recommendation_text
from multihead.plan.units import (
    dtype_bits,
    parse_bandwidth,
    parse_bytes,
    parse_count,
    parse_tokens,
)

__all__ = [
    "AttentionFlops", "AttentionGeometry", "DEVICES", "Device", "FeedForward", "Fit",
    "LatentGeometry", "MixtureOfExperts", "ModelGeometry", "ParamCounts", "Recommendation",
    "Request", "SUPPORTED", "account", "account_text", "attention_flops", "attention_params", "custom_device",
    "describe", "dtype_bits", "fit", "get_device", "kv_bytes_per_token", "kv_cache_bytes",
    "model_kv_cache_bytes", "model_params", "param_counts", "parse_bandwidth", "parse_bytes",
    "parse_count", "parse_tokens", "read_config", "recommend", "recommendation_text",
]
