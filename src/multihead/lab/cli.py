"""Run the classic multi-head experiments on multihead's own modules.

  multihead lab heads      does the number of heads matter? (copy task, 1 layer)
  multihead lab kv         what do GQA, MQA and MLA save? (parameters, cache, decode time)
  multihead lab mla        how small can MLA's latent be? (character LM on the KJV Bible)
  multihead lab induction  when do induction heads appear? (2-layer attention-only)

Each writes results.json, PNG plots and a safetensors checkpoint (model/, which
`multihead inspect --model OUT` opens; kv trains nothing and writes none) to --out. --quick runs a small version in
seconds. Ctrl-C stops cleanly: what finished is kept, marked "interrupted": true.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXPERIMENTS = {
    "heads": "does the number of heads matter? copy task, n_heads 1..16, several seeds",
    "kv": "parameters, KV-cache bytes and decode time of MHA, GQA, MQA and MLA",
    "mla": "char-level LM: validation bits/char against cache bytes for MLA ranks, GQA, MQA",
    "induction": "2-layer attention-only model: accuracy and head roles over training",
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4; received {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4; received {text!r}")
    return values


def _positive_of(cast, what: str):
    """An argparse type: `cast(text)` that must be > 0, else "expected a positive {what}"."""

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {what}; received {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {what}; received {text!r}")
        return v

    return parse


_positive = _positive_of(int, "integer")
_positive_float = _positive_of(float, "number")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    for name, help_text in EXPERIMENTS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--quick", action="store_true", help="a small version that runs in seconds (for tests)")
        p.add_argument("--out", type=Path, default=None, help="output folder (default: lab-<experiment>)")
        p.add_argument("--seed", type=int, default=0, help="random seed; same seed, same numbers (default 0)")
        p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="where to train (default auto: cuda when present)")
        p.add_argument("--threads", type=_positive, default=None,
                       help="CPU threads for torch (default: at most 2)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
        if name != "kv":
            p.add_argument("--steps", type=_positive, default=None, help="training steps per model")
            p.add_argument("--batch-size", type=_positive, default=None, help="sequences per step")
            p.add_argument("--lr", type=_positive_float, default=None, help="peak learning rate")
        if name == "heads":
            p.add_argument("--head-counts", type=_ints, default=None, help="n_heads to compare (default 1,2,4,8,16)")
            p.add_argument("--seeds", type=_positive, default=None, dest="n_seeds", help="seeds per head count")
            p.add_argument("--d-model", type=_positive, default=None, help="model width (default 64)")
            p.add_argument("--seq-len", type=_positive, default=None, help="tokens to copy (default 24)")
        elif name == "kv":
            p.add_argument("--d-model", type=_positive, default=None, help="model width (default 512)")
            p.add_argument("--n-heads", type=_positive, default=None, help="query heads (default 8)")
            p.add_argument("--context", type=_positive, default=None, help="cached tokens N (default 2048)")
            p.add_argument("--kv-heads", type=_ints, default=None, dest="kv_heads",
                           help="n_kv_heads to compare (default 8,4,2,1: MHA, GQA, GQA, MQA)")
            p.add_argument("--kv-ranks", type=_ints, default=None, dest="mla_ranks",
                           help="MLA kv_rank values (default 128,256)")
            p.add_argument("--batch", type=_positive, default=None, help="decode batch size (default 1)")
            p.add_argument("--decode-steps", type=_positive, default=None, help="timed decode steps")
        elif name == "mla":
            p.add_argument("--corpus", type=Path, default=None,
                           help="a UTF-8 text file (default: the King James Bible shipped with multihead)")
            p.add_argument("--kv-ranks", type=_ints, default=None, dest="ranks",
                           help="MLA kv_rank sweep (default 8,16,32,64)")
            p.add_argument("--tolerance", type=_positive_float, default=None,
                           help="allowed bits/char above MHA (default 1.0)")
            p.add_argument("--d-model", type=_positive, default=None, help="model width (default 128)")
            p.add_argument("--n-layers", type=_positive, default=None, help="blocks (default 2)")
            p.add_argument("--n-heads", type=_positive, default=None, help="heads (default 8)")
            p.add_argument("--context", type=_positive, default=None, help="characters per sequence")
        elif name == "induction":
            p.add_argument("--d-model", type=_positive, default=None, help="model width (default 64)")
            p.add_argument("--n-heads", type=_positive, default=None, help="heads per layer (default 4)")
            p.add_argument("--vocab", type=_positive, default=None, help="random symbols (default 64)")
            p.add_argument("--seq-len", type=_positive, default=None, help="tokens per sequence")


def main(args: argparse.Namespace) -> int:
    from multihead.cli import UsageError

    if getattr(args, "experiment", None) is None:
        raise UsageError(f"choose an experiment: {', '.join(EXPERIMENTS)} (multihead lab --help)")
    import torch

    threads = args.threads or max(1, min(2, torch.get_num_threads()))
    torch.set_num_threads(threads)
    out = args.out or Path(f"lab-{args.experiment}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    runner, cfg = _configure(args)
    try:
        res = runner(cfg, out, seed=args.seed, device=args.device, progress=not args.no_progress)
    except ValueError as err:
        raise UsageError(str(err)) from None
    _report(res, out)
    return 130 if res["interrupted"] else 0


def _configure(args):
    from dataclasses import replace

    from multihead.cli import UsageError

    def build(cls, **kw):
        cfg = cls.quick() if args.quick else cls()
        kw = {k: v for k, v in kw.items() if v is not None}
        try:
            return replace(cfg, **kw)
        except (ValueError, TypeError) as err:
            raise UsageError(str(err)) from None

    common = {} if args.experiment == "kv" else {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr}
    if args.experiment == "heads":
        from multihead.lab.heads import HeadsConfig, run_heads

        return run_heads, build(HeadsConfig, head_counts=args.head_counts, n_seeds=args.n_seeds,
                                d_model=args.d_model, seq_len=args.seq_len, **common)
    if args.experiment == "kv":
        from multihead.lab.kv import KVConfig, run_kv

        return run_kv, build(KVConfig, d_model=args.d_model, n_heads=args.n_heads, context=args.context,
                             kv_heads=args.kv_heads, mla_ranks=args.mla_ranks, batch=args.batch,
                             decode_steps=args.decode_steps)
    if args.experiment == "mla":
        from multihead.lab.mla import MLAConfig, run_mla

        corpus = None
        if args.corpus is not None:
            if not args.corpus.is_file():
                raise UsageError(f"--corpus {args.corpus}: no such file")
            corpus = str(args.corpus)
        return run_mla, build(MLAConfig, corpus=corpus, ranks=args.ranks, tolerance=args.tolerance,
                              d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                              context=args.context, **common)
    if args.experiment == "induction":
        from multihead.lab.induction import InductionConfig, run_induction

        return run_induction, build(InductionConfig, d_model=args.d_model, n_heads=args.n_heads,
                                    vocab=args.vocab, seq_len=args.seq_len, **common)
    raise UsageError(f"unknown experiment {args.experiment!r}; valid: {', '.join(EXPERIMENTS)}")


def _report(res: dict, out: Path) -> None:
    r = res["results"]
    if r.get("table"):
        print(r["table"])
    for key in ("conclusion", "summary"):
        if r.get(key):
            print()
            print(r[key])
    print()
    status = "interrupted: partial results" if res["interrupted"] else "results"
    print(f"{status} in {out}/results.json; plots: {', '.join(res['plots']) or 'none'}"
          + (f"; checkpoint: {out}/{res['checkpoint']} (multihead inspect --model {out})" if res["checkpoint"] else ""))
    sys.stdout.flush()
