"""A two-minute tour: build MHA, GQA and MQA layers, check each against the NumPy float64
reference, decode a few tokens through a KV cache and compare with the full forward,
and print what each variant costs in parameters and cache bytes (--json: the same as JSON)."""

from __future__ import annotations

import argparse
import json

from multihead.cli_args import add_context, add_json, add_seed

DESCRIPTION = __doc__  # the --help text: this module's docstring is short enough to be it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    parser.add_argument("--n-heads", type=int, default=8, dest="heads", help="query heads (default 8)")
    add_context(parser, "context length for cache bytes (default 4096)", type=int, default=4096)
    add_seed(parser, "the random weights and inputs (default 0)")
    add_json(parser, help="print the table as JSON (schema multihead.tour/1) instead of text")


def main(args: argparse.Namespace) -> int:
    import torch

    import multihead as mh
    from multihead import reference as R
    from multihead.checks import divisibility_error
    from multihead.errors import UsageError

    C, H = args.d_model, args.heads
    if C < 1 or H < 1:
        raise UsageError(f"--d-model and --n-heads must be >= 1; received {C} and {H}")
    if divisibility_error("--d-model", C, "--n-heads", H):
        raise UsageError(divisibility_error("--d-model", C, "--n-heads", H))
    if C > 2**14:  # the tour builds the modules in float64 and checks them against NumPy
        raise UsageError(f"--d-model must be at most 16384 for the tour; received {C}")
    if not 1 <= args.context <= 2**40:
        raise UsageError(f"--context must be in 1 .. 2**40; received {args.context}")
    torch.manual_seed(args.seed)
    variants = [("MHA", H), ("GQA", max(1, H // 4) if H % 4 == 0 else 1), ("MQA", 1)]

    def say(*line: str) -> None:  # with --json, stdout is the JSON alone
        if not args.json:
            print(*line)

    say(f"multihead {mh.__version__} tour: d_model={C}, n_heads={H}, head_dim={C // H}, torch {torch.__version__}\n")
    header = f"{'variant':8} {'kv heads':>8} {'params':>10} {'cache/token':>12} {f'cache @ {args.context}':>14} " \
             f"{'|x - numpy|':>12} {'|decode - full|':>16}"
    say(header)
    say("-" * len(header))
    ok, rows = True, []
    for name, n_kv in variants:
        attn = mh.Attention(C, H, n_kv, causal=True).double().eval()
        x = torch.randn(2, 12, C, dtype=torch.float64)
        with torch.no_grad():
            out = attn(x)
            w = lambda lin: lin.weight.numpy().T  # noqa: E731  nn.Linear holds W^T
            b = lambda lin: lin.bias.numpy()  # noqa: E731
            ref = R.gqa_forward(x.numpy(), w(attn.q_proj), w(attn.k_proj), w(attn.v_proj), w(attn.o_proj),
                                H, n_kv, causal=True, b_q=b(attn.q_proj), b_k=b(attn.k_proj),
                                b_v=b(attn.v_proj), b_o=b(attn.o_proj))
            err_ref = float(abs(out.numpy() - ref).max())
            cache = attn.new_cache(2, 12)
            steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t : t + 1], cache=cache) for t in range(4, 12)]
            err_dec = float((torch.cat(steps, 1) - out).abs().max())
        params = sum(p.numel() for p in attn.parameters())
        per_token = mh.KVCache(1, n_kv, 1, C // H, dtype=torch.bfloat16).nbytes
        ok &= err_ref < 1e-10 and err_dec < 1e-10
        rows.append({"variant": name, "n_kv_heads": n_kv, "params": params, "cache_bytes_per_token": per_token,
                     "cache_bytes_at_context": per_token * args.context, "max_abs_error_reference": err_ref,
                     "max_abs_error_decode": err_dec})
        say(f"{name:8} {n_kv:>8} {params:>10,} {per_token:>10,} B {per_token * args.context / 2**20:>11.2f} MiB "
            f"{err_ref:>12.1e} {err_dec:>16.1e}")
    if args.json:
        print(json.dumps({"schema": "multihead.tour/1", "version": mh.__version__, "torch": torch.__version__,
                          "d_model": C, "n_heads": H, "head_dim": C // H, "context": args.context,
                          "seed": args.seed, "cache": "per layer, batch 1, bf16", "variants": rows, "ok": ok},
                         indent=2))
        return 0 if ok else 1
    print("\ncache bytes are per layer, batch 1, bf16; errors are float64 max differences.")
    print("all variants equal the NumPy reference and their cached decode equals the full forward."
          if ok else "MISMATCH: see the errors above")
    return 0 if ok else 1
