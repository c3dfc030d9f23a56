"""DeepSeek-V2 in transformers, decoding: its own attention vs multihead's.

A small random-init DeepSeek-V2 (DeepseekV2ForCausalLM from its config class, dense MLPs
so that attention dominates) is prefilled with S tokens, then decodes N tokens one at a
time with transformers' DynamicCache, three ways:

- "transformers": the model as it is (sdpa);
- "registry": attn_implementation="multihead", the model otherwise untouched (the
  attention module still decompresses every cached token's K and V each step);
- "patched": `multihead.interop.hf.use_latent_attention(model)`: LatentAttention, latent-only cache,
  absorbed decode.

Reported per way: cache bytes after the run, median decode time per token (ms), and
whether the greedy tokens equal transformers'. Run:

    python benchmarks/hf_mla.py [--prompt 1024] [--new 32] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch


def build(layers: int, seed: int = 0):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                           num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=16,
                           num_key_value_heads=16, kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64,
                           qk_rope_head_dim=32, v_head_dim=64, vocab_size=1000, max_position_embeddings=4096,
                           n_routed_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2)
    torch.manual_seed(seed)
    return DeepseekV2ForCausalLM(cfg).eval()


def decode(model, ids, new: int) -> tuple[list[int], list[float], object]:
    """Prefill, then `new` greedy one-token steps: (tokens, seconds per step, cache)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens, times = [int(token)], []
        for _ in range(new - 1):
            t0 = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
    return tokens, times, cache


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=1024, help="prompt length S (default 1024)")
    p.add_argument("--new", type=int, default=32, help="tokens decoded (default 32)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--quick", action="store_true", help="a few seconds: prompt 64, 4 tokens")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    from machine_info import finish  # now: it takes the load at the start (benchmarks/ is on sys.path)
    if args.quick:
        args.prompt, args.new = 64, 4
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    from multihead.interop import hf

    base = build(args.layers)
    cfg = base.config
    ids = torch.randint(3, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    ways = {"transformers": base}
    registry = copy.deepcopy(base)
    registry.set_attn_implementation("multihead")
    ways["registry"] = registry
    ways["patched"] = hf.use_latent_attention(copy.deepcopy(base))
    rows = {}
    for name, model in ways.items():
        tokens, times, cache = decode(model, ids, args.new)
        rows[name] = {"cache_bytes": hf.latent_cache_bytes(cache), "ms_per_token": 1e3 * statistics.median(times),
                      "ms_per_token_min": 1e3 * min(times), "tokens": tokens}
    ref = rows["transformers"]["tokens"]
    S = args.prompt + args.new - 1
    H, R, Dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    decompressed = args.layers * S * H * (cfg.qk_nope_head_dim + Dr + cfg.v_head_dim) * 4
    print(f"DeepSeek-V2 (random init): {args.layers} layers, H={H}, kv_rank={R}, rope_dim={Dr}, "
          f"prompt {args.prompt}, {args.new} new tokens, fp32, {args.threads} thread(s)")
    print(f"{'way':<14}{'cache bytes':>14}{'ms/token (median)':>20}{'min':>8}  tokens == transformers'")
    for name, row in rows.items():
        print(f"{name:<14}{row['cache_bytes']:>14,}{row['ms_per_token']:>20.2f}{row['ms_per_token_min']:>8.2f}  "
              f"{row['tokens'] == ref}")
    print(f"decompressed K/V of the same tokens would take {decompressed:,} bytes "
          f"({decompressed / rows['patched']['cache_bytes']:.1f}x the latent)")
    if args.json:
        result = {"config": {"layers": args.layers, "heads": H, "kv_rank": R, "rope_dim": Dr,
                             "prompt": args.prompt, "new": args.new, "threads": args.threads},
                  "rows": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} | {"tokens_equal": v["tokens"] == ref}
                           for k, v in rows.items()},
                  "decompressed_bytes": decompressed}
        finish(result)
        with open(args.json + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        os.chmod(args.json + ".tmp", 0o644)
        os.replace(args.json + ".tmp", args.json)
    return 0 if all(row["tokens"] == ref for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
