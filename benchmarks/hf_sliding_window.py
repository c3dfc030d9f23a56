"""A transformers sliding-window layer on attn_implementation="multihead": dense mask vs predicate.

transformers' sdpa path hands a sliding-window layer a dense `(B, 1, T, S)` mask; the mask
builder registered with "multihead" hands it transformers' own mask function instead, which
multihead's kernel evaluates tile by tile, skipping the tiles outside the window. This
times one call of the attention function both ways (same q, k, v, same padding):

    python benchmarks/hf_sliding_window.py [--tokens 4096] [--window 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


class _Layer(torch.nn.Module):
    is_causal = True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="T = S (default 4096)")
    p.add_argument("--window", type=int, default=256, help="sliding window (default 256)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per way (default 5)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    from multihead.interop.hf import attention_forward
    from multihead.interop.hf.registry import multihead_mask

    B, H, Hkv, T, D, W = 1, 8, 2, args.tokens, 64, args.window
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, :5] = False  # left padding, so transformers cannot skip the mask
    fn = sliding_window_causal_mask_function(W)
    ways = {"dense mask (transformers' sdpa mask)": sdpa_mask(batch_size=B, q_length=T, kv_length=T, mask_function=fn,
                                                             attention_mask=keep, local_size=W,
                                                             allow_is_causal_skip=False),
            "predicate (multihead's mask builder)": multihead_mask(B, T, T, mask_function=fn, attention_mask=keep,
                                                                  local_size=W)}
    outs = {}
    print(f"T = S = {T}, window {W}, H = {H} on Hkv = {Hkv}, D = {D}, fp32, {args.threads} thread(s)")
    for name, mask in ways.items():
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs[name], _ = attention_forward(_Layer(), q, k, v, mask)
            times.append(time.perf_counter() - t0)
        print(f"{name:<40} {1e3 * statistics.median(times):8.0f} ms (median of {args.repeats})")
    a, b = outs.values()
    print(f"max |diff| on the real queries: {(a - b)[:, 5:].abs().max():.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
