"""plan: exact accounting of attention geometry, and a recommender (`multihead plan`).

Pure Python, no torch: parameters, KV-cache bytes (window- and MLA-aware), attention
FLOPs, and device fit for a model's shape; a reader for Hugging Face config.json files
(gpt2, bert, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma, gemma2,
gemma3, falcon, phi3, gpt_neox, gpt_oss, deepseek_v2/v3; MoE with total and active
parameters); and a deterministic recommender of heads, KV heads and attention variant.

    >>> from multihead import plan
    >>> g = plan.AttentionGeometry(4096, 32, 8, bias=False)   # Llama-3-8B's attention
    >>> plan.attention_params(g)
    41943040
    >>> plan.kv_cache_bytes(g, tokens=1, dtype="bf16") * 32   # per token, 32 layers
    131072

`recommend(Request(...))` returns a `Recommendation` (one-line repr; `print(rec)` or
`recommendation_text(rec)` is the text `multihead plan` prints); `account_text([account(m)])`
is the table of `multihead plan --config`. `read_config` takes a path, a dict or a preset
name (`"llama-3-8b"`; `multihead.plan.presets.PRESETS` lists them).

The numbers equal the library's modules: `attention_params(AttentionGeometry(*args))`
is the parameter count of `multihead.Attention(*args)`, and `kv_cache_bytes` is the
`nbytes` of its cache; likewise `LatentGeometry` and `multihead.LatentAttention`.
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
