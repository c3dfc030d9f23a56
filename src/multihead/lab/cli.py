"""`multihead lab`: the classic multi-head experiments (heads, kv, mla, induction, uptrain)
on multihead's own modules; each subcommand's flags read their defaults off the experiment's
config dataclass. `DESCRIPTION` is the --help text; docs/lab.md the guide.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from multihead.cli_args import (
    add_context,
    add_device,
    add_json,
    add_out,
    add_seed,
    add_threads,
    int_in,
    renamed,
)
from multihead.errors import UsageError

DESCRIPTION = """Run the classic multi-head experiments on multihead's own modules.

  multihead lab heads      does the number of heads matter? (copy task, 1 layer)
  multihead lab kv         what do GQA, MQA and MLA save? (parameters, cache, decode time)
  multihead lab mla        how small can MLA's latent be? (character LM on the KJV Bible)
  multihead lab induction  when do induction heads appear? (2-layer attention-only)

Each writes results.json, PNG plots and a safetensors checkpoint (model/, which
`multihead inspect --model OUT` opens; kv trains nothing and writes none) to --out, which
must be new or empty: --force replaces an earlier run's folder, and only once the new run
has completed. --quick runs a small version in seconds. Ctrl-C stops cleanly: what
finished is kept, marked "interrupted": true.

  multihead lab induction --n-layers 2 --d-model 4096 --n-heads 32 --n-kv-heads 4 --quick

trains the head geometry `multihead plan` recommends, scaled to a CPU (same head_dim and
n_heads / n_kv_heads), and says what was scaled.
"""

EXPERIMENTS = {
    "heads": "does the number of heads matter? copy task, n_heads 1..16, several seeds",
    "kv": "parameters, KV-cache bytes and decode time of MHA, GQA, MQA and MLA",
    "mla": "char-level LM: validation bits/char against cache bytes for MLA ranks, GQA, MQA",
    "induction": "2-layer attention-only model: accuracy and head roles over training",
    "uptrain": "MHA converted to MQA/GQA/MLA (mean-pool, first head, random; SVD), then uptrained",
}
_CONFIGS = {"heads": "HeadsConfig", "kv": "KVConfig", "mla": "MLAConfig", "induction": "InductionConfig",
            "uptrain": "UptrainConfig"}
_MAX_INT = 2**31 - 1  # every count and size fits a C int; beyond it only overflows later, far from the flag
_MAX_LIST = 64


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; every flag's help states its default itself."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4; received {text!r}") from None
    if not values or any(not 1 <= v <= _MAX_INT for v in values) or len(values) > _MAX_LIST:
        raise argparse.ArgumentTypeError(f"expected 1 to {_MAX_LIST} positive integers like 1,2,4; received {text!r}")
    return values


def _positive_of(cast, what: str, maximum: float = _MAX_INT):
    """An argparse type: `cast(text)` that must be a finite number in (0, maximum]."""

    def parse(text: str):
        try:
            v = cast(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected a positive {what}; received {text!r}") from None
        # an int is compared as an int: math.isfinite of a 400-digit int overflows a float
        if not (v > 0 and (isinstance(v, int) or math.isfinite(v))):
            raise argparse.ArgumentTypeError(f"expected a positive {what}; received {text!r}")
        if v > maximum:
            raise argparse.ArgumentTypeError(f"expected a positive {what} of at most {maximum:g}; received {text!r}")
        return v

    return parse


_nonnegative = int_in(0, _MAX_INT, f"an integer in 0 .. {_MAX_INT}")
_positive = _positive_of(int, "integer")
_positive_float = _positive_of(float, "number", maximum=1e300)
# A learning rate must convert to float32 inside the optimizer (at most 3.4e38): bounded well
# below that and far above any rate that trains (a too-high one is reported as a divergence).
_learning_rate = _positive_of(float, "learning rate", maximum=1e30)


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple) else f"{v:g}" if isinstance(v, float) else str(v)


def _defaults(name: str):
    """help(field) -> "(default X; --quick Y)", read off the experiment's config dataclass."""
    from multihead.lab import configs, uptrain_config

    cls = getattr(configs if name != "uptrain" else uptrain_config, _CONFIGS[name])
    full, quick = cls(), cls.quick()

    def text(field: str) -> str:
        a, b = getattr(full, field), getattr(quick, field)
        if a is None:
            return ""
        return f" (default {_shown(a)}" + ("" if a == b else f"; --quick {_shown(b)}") + ")"

    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One subcommand per experiment: the flags every run takes, the training flags (all but
    kv, which trains nothing), then the experiment's own; each help states its default."""
    parser.formatter_class = _Formatter
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    for name, help_text in EXPERIMENTS.items():
        d = _defaults(name)
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter, allow_abbrev=False)
        _run_flags(p, name)
        if name != "kv":
            _training_flags(p, d)
        _EXPERIMENT_FLAGS[name](p, d)


def _run_flags(p: argparse.ArgumentParser, name: str) -> None:
    """Where the run goes and how it runs: --quick, --out, --force, --seed, --device, --threads, --json."""
    p.add_argument("--quick", action="store_true", help="a small version that runs in seconds (for tests)")
    add_out(p, f"output folder, new or empty (default lab-{name})", type=Path, default=None)
    p.add_argument("--force", action="store_true",
                   help="replace an earlier run's --out folder (one with results.json), once this run completes")
    add_seed(p, "random seed; same seed, same numbers (default 0)")
    add_device(p, ("where to build and time the modules" if name == "kv" else "where to train")
               + " (default auto: cuda when present)")
    add_threads(p, "CPU threads for torch (default: 2 with 4 or more cores, else 1; 1 for kv and --quick)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_json(p, help="print the run's results.json instead of the text report (its notes go to stderr)")


def _training_flags(p: argparse.ArgumentParser, d) -> None:
    p.add_argument("--steps", type=_positive_of(int, "integer", 10**7), default=None,
                   help="training steps per model" + d("steps"))
    p.add_argument("--batch-size", type=_positive_of(int, "integer", 2**16), default=None,
                   help="sequences per step" + d("batch_size"))
    p.add_argument("--lr", type=_learning_rate, default=None, help="peak learning rate" + d("lr"))


def _heads_flags(p: argparse.ArgumentParser, d) -> None:
    p.add_argument("--head-counts", type=_ints, default=None, help="n_heads to compare" + d("head_counts"))
    p.add_argument("--seeds", type=_positive_of(int, "integer", 1000), default=None, dest="n_seeds",
                   help="seeds per head count" + d("n_seeds"))
    _d_model(p, "model width" + d("d_model"))
    _context(p, "tokens to copy" + d("seq_len"))


def _kv_flags(p: argparse.ArgumentParser, d) -> None:
    _d_model(p, "model width" + d("d_model"))
    _n_heads(p, "query heads" + d("n_heads"))
    add_context(p, "cached tokens N" + d("context"), type=_positive)
    _kv_heads(p, "n_kv_heads to compare: MHA, GQA, ..., MQA" + d("kv_heads"))
    p.add_argument("--kv-ranks", type=_ints, default=None, dest="mla_ranks",
                   help="MLA kv_rank values" + d("mla_ranks"))
    p.add_argument("--batch-size", type=_positive, default=None, dest="batch",
                   help="decode batch size" + d("batch"))
    p.add_argument("--decode-steps", type=_positive, default=None,
                   help="timed decode steps" + d("decode_steps"))


def _mla_flags(p: argparse.ArgumentParser, d) -> None:
    p.add_argument("--corpus", type=Path, default=None,
                   help="a UTF-8 text file (default: the King James Bible shipped with multihead)")
    p.add_argument("--kv-ranks", type=_ints, default=None, dest="ranks",
                   help="MLA kv_rank sweep" + d("ranks"))
    _kv_heads(p, "GQA/MQA n_kv_heads trained beside MHA and MLA" + d("kv_heads"))
    p.add_argument("--tolerance", type=_positive_float, default=None,
                   help="allowed bits/char above MHA" + d("tolerance"))
    _d_model(p, "model width" + d("d_model"))
    _layers(p, "blocks" + d("n_layers"))
    _n_heads(p, "heads" + d("n_heads"))
    add_context(p, "characters per sequence" + d("context"), type=_positive)


def _induction_flags(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group(
        "head geometry", "a model's heads (what `multihead plan` prints); a geometry too large for a\n"
        "CPU is scaled down keeping head_dim = d_model / n_heads, n_heads / n_kv_heads and\n"
        "rope_dim, and the output says what was scaled")
    g.add_argument("--variant", choices=("mha", "gqa", "mqa", "mla"), default=None,
                   help="attention variant (default: from --n-kv-heads / --kv-rank; mha)")
    _layers(g, "layers" + d("n_layers"))
    _d_model(g, "model width C" + d("d_model"))
    _n_heads(g, "query heads per layer H" + d("n_heads"))
    g.add_argument("--n-kv-heads", type=_positive, default=None, metavar="N",
                   help="key/value heads K (GQA: 1 < K < H; MQA: 1) (default: --n-heads, MHA)")
    g.add_argument("--kv-rank", type=_positive, default=None,
                   help="MLA latent rank R; implies --variant mla (default: none, MHA/GQA/MQA)")
    g.add_argument("--rope-dim", type=_nonnegative, default=None,
                   help="MLA decoupled RoPE dims per head (default 0)")
    p.add_argument("--vocab", type=_positive, default=None, help="random symbols" + d("vocab"))
    _context(p, "tokens per sequence" + d("seq_len"))


def _uptrain_flags(p: argparse.ArgumentParser, d) -> None:
    """The lab model's conversions (--from, --inits, ...) and, with --model, a transformers model's
    (its options and defaults live in multihead.lab.uptrain_hf)."""
    from multihead.lab.uptrain_config import parse_fractions, parse_inits, parse_mla_targets, parse_rope_dims

    p.add_argument("--from", type=Path, default=None, dest="from_checkpoint",
                   help="a `multihead lab mla` run folder: convert its MHA model (default: train one)")
    _kv_heads(p, "MQA/GQA n_kv_heads to convert to" + d("kv_heads"))
    p.add_argument("--inits", type=parse_inits, default=None, help="GQA/MQA inits" + d("inits"))
    p.add_argument("--kv-ranks", type=parse_mla_targets, default=None, dest="ranks",
                   help="MLA kv_rank; with --model R+P also sets that target's RoPE dims (64,144+72)" + d("ranks"))
    p.add_argument("--fractions", type=parse_fractions, default=None,
                   help="uptraining, shares of --steps" + d("fractions"))
    p.add_argument("--uptrain-lr", type=_learning_rate, default=None,
                   help="uptraining's peak learning rate (default: the baseline's last, 0.1 x --lr)")
    p.add_argument("--positions", choices=("learned", "rope"), default=None,
                   help="the baseline's positions (default learned)")
    p.add_argument("--mla-rope-dims", type=parse_rope_dims, default=None,
                   help="with --positions rope: MLA's rotary dims kept" + d("mla_rope_dims"))
    _d_model(p, "model width" + d("d_model"))
    _layers(p, "blocks" + d("n_layers"))
    _n_heads(p, "heads" + d("n_heads"))
    p.add_argument("--model", default=None, help="a Llama-family transformers model ('smollm2' or a folder) "
                   "to convert to MQA and MLA and uptrain on the KJV (default: none, the lab model; "
                   "its defaults: multihead.lab.uptrain_hf)")
    p.add_argument("--rope-dim", type=_nonnegative, default=None,
                   help="with --model: MLA's RoPE dims (default 24)")
    p.add_argument("--resume", action="store_true", help="with --model: continue the run in --out")
    p.add_argument("--long", action="store_true",
                   help="with --model: the longer curve (control, MQA aligned, two MLA targets; 196 steps of "
                        "8 x 128 tokens, evaluated at 12K, 50K, 100K and 200K tokens)")


_EXPERIMENT_FLAGS = {"heads": _heads_flags, "kv": _kv_flags, "mla": _mla_flags, "induction": _induction_flags,
                     "uptrain": _uptrain_flags}


def _context(p, help_text: str) -> None:
    """--context N, the sequence length, as kv, mla, plan and tour spell it (the old --seq-len refused)."""
    add_context(p, help_text, type=_positive, dest="seq_len")
    renamed(p, "--seq-len", "--context")


def _d_model(p, help_text: str) -> None:
    """--d-model C, the model width, one definition for every experiment."""
    p.add_argument("--d-model", type=_positive, default=None, help=help_text)


def _n_heads(p, help_text: str) -> None:
    """--n-heads H, the query heads (per layer), one definition for every experiment."""
    p.add_argument("--n-heads", type=_positive, default=None, help=help_text)


def _kv_heads(p, help_text: str) -> None:
    """--kv-head-counts, the n_kv_heads to compare (a list, as --head-counts and --kv-ranks are);
    --n-kv-heads is one count, in lab induction and plan, so here it is refused with the new name."""
    p.add_argument("--kv-head-counts", type=_ints, default=None, dest="kv_heads", metavar="LIST", help=help_text)
    renamed(p, "--n-kv-heads", "--kv-head-counts", "a list of n_kv_heads to compare; --n-kv-heads is one count")


def _layers(p, help_text: str) -> None:
    """--n-layers N (a count, as in `multihead plan`; a selection of layers is --only-layers)."""
    p.add_argument("--n-layers", type=_positive_of(int, "integer", 1024), default=None, dest="n_layers",
                   help=help_text)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "experiment", None) is None:
        raise UsageError(f"choose an experiment: {', '.join(EXPERIMENTS)} (multihead lab --help)")
    out = args.out or Path(f"lab-{args.experiment}")
    runner, cfg = _configure(args)  # every flag checked first
    _check_inputs_apart(args, out)  # --force replaces --out when the run ends: never a folder the run reads
    from multihead.lab.results import lock_out

    with lock_out(out):  # one run per --out at a time: a second one stops here (exit 2)
        return _run(args, out, runner, cfg)


def _run(args: argparse.Namespace, out: Path, runner, cfg) -> int:
    resume = getattr(args, "resume", False)  # lab uptrain --model --resume continues the run in --out
    stage = None if resume else _prepare_out(out, args.force)  # then --out, before anything is trained
    import torch

    # One thread by default for kv (it times single decode steps), --quick (tiny models) and
    # on machines of 2 cores or fewer: there a second OpenMP thread waits at every op's
    # barrier whenever anything else runs (docs/lab.md, "Threads", has the measurement);
    # 2 where 4 or more cores are.
    threads = args.threads or (1 if args.experiment == "kv" or args.quick
                               else max(1, min(2, torch.get_num_threads() // 2)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # for the run only: main() may run inside a notebook or a test
    target = out if stage is None else stage
    try:
        res = runner(cfg, target, seed=args.seed, device=args.device, progress=not args.no_progress)
    except BaseException:
        if stage is not None:
            _remove_tree(stage)
        raise
    finally:
        torch.set_num_threads(before)
    shown = out
    if stage is not None:
        shown = _settle(stage, out, res)
    if args.json:
        print((Path(shown) / "results.json").read_text(encoding="utf-8"), flush=True)
    else:
        _report(res, shown)
    if res["diverged"]:
        d = res["diverged"][0]
        more = f" (and {len(res['diverged']) - 1} more runs)" if len(res["diverged"]) > 1 else ""
        raise UsageError(f"training diverged at step {d['step']} in {d['run']}{more} ({d['reason']}); "
                         f"lr {getattr(cfg, 'lr', '?'):g} is too high: try a smaller --lr. "
                         f"{shown}/results.json records it")
    return 130 if res["interrupted"] else 0


def _inputs(args: argparse.Namespace) -> list[tuple[str, Path, bool]]:
    """(what, file or folder) of everything the run reads from disk: --model (resolved as the
    loaders do: 'smollm2' is its cached file, a lab run's folder its model/), --from, --corpus."""
    found = []  # (what, path, whether only the file itself is protected)
    if getattr(args, "model", None) is not None:
        from multihead.interop.loaders import resolve_model

        try:
            _, source, _, _ = resolve_model(args.model)
        except (ValueError, OSError) as err:
            raise UsageError(f"--model {args.model}: {err}") from None
        found.append(("the model", source, False))
    for flag, what, file_only in (("from_checkpoint", "the --from run", False), ("corpus", "the corpus", True)):
        value = getattr(args, flag, None)
        if value is not None and Path(value).exists():
            found.append((what, Path(value), file_only))
    return found


def _check_inputs_apart(args: argparse.Namespace, out: Path) -> None:
    from multihead.files import check_out_apart

    for what, source, file_only in _inputs(args):
        check_out_apart("--out", out, source, tool=f"lab {args.experiment}", what=what, file_only=file_only)


def _prepare_out(out: Path, force: bool) -> Path | None:
    """Refuse an --out that cannot hold a run; return a staging folder when --force is to
    replace an earlier run (the new run goes there and replaces `out` only when complete)."""
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                raise UsageError(f"--out {out}: {folder} is a file, not a folder; give a folder path")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise UsageError(f"--out {out}: cannot write in {folder} (permission denied)")
            break
    if not out.is_dir() or not any(out.iterdir()):
        return None
    earlier = (out / "results.json").is_file()
    if not force:
        raise UsageError(f"--out {out} is not empty" + (" (it holds an earlier run's results.json)" if earlier else "")
                         + "; give a new or empty folder, or add --force to replace an earlier run "
                         "once this one completes")
    if not earlier:
        raise UsageError(f"--force replaces only an earlier lab run's folder (one with results.json); {out} has "
                         "none, so it is left alone: give a new or empty --out")
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise UsageError(f"--force would replace {out}, the current folder or one above it; give --out a folder "
                         "below the current one")
    if not os.access(out.resolve().parent, os.W_OK | os.X_OK):
        raise UsageError(f"--force needs to write beside {out} (in {out.resolve().parent}); permission denied")
    import tempfile

    from multihead.files import usual_mode

    stage = Path(tempfile.mkdtemp(prefix=f".{out.resolve().name}.new-", dir=out.resolve().parent))
    os.chmod(stage, usual_mode(folder=True))  # the mode mkdir gives, not mkdtemp's 0700
    return stage


def _settle(stage: Path, out: Path, res: dict) -> Path:
    """After a --force run: a complete run replaces `out`; an interrupted or diverged one is
    kept beside it and `out` keeps the earlier complete run. Returns where the run now is."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if res["interrupted"] or res["diverged"]:
        kind = "interrupted" if res["interrupted"] else "diverged"
        kept, n = out.parent / f"{out.name}.{kind}-{stamp}", 1
        while kept.exists():
            n += 1
            kept = out.parent / f"{out.name}.{kind}-{stamp}-{n}"
        os.rename(stage, kept)
        res.setdefault("notes", []).append(f"{out} still holds the earlier run: this {kind} run did not replace it")
        return kept
    old = out.parent / f".{out.name}.old-{stamp}-{os.getpid()}"
    os.rename(out, old)
    os.rename(stage, out)
    _remove_tree(old)
    return out


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _configure(args):
    """(the experiment's runner, its config): --quick's or the full config with the given
    flags in; every flag is checked here, before --out is touched."""
    common = {} if args.experiment == "kv" else {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr}
    configure = _EXPERIMENT_CONFIGS.get(args.experiment)
    if configure is None:
        raise UsageError(f"unknown experiment {args.experiment!r}; valid: {', '.join(EXPERIMENTS)}")
    return configure(args, common)


def _build(args, cls, **kw):
    """cls's --quick or full config with the flags given (None: not given); a value the config
    refuses is a usage error."""
    from dataclasses import replace

    cfg = cls.quick() if args.quick else cls()
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        return replace(cfg, **kw)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


def _configure_heads(args, common: dict):
    from multihead.lab.heads import HeadsConfig, run_heads

    return run_heads, _build(args, HeadsConfig, head_counts=args.head_counts, n_seeds=args.n_seeds,
                             d_model=args.d_model, seq_len=args.seq_len, **common)


def _configure_kv(args, common: dict):
    from multihead.lab.kv import KVConfig, run_kv

    return run_kv, _build(args, KVConfig, d_model=args.d_model, n_heads=args.n_heads, context=args.context,
                          kv_heads=args.kv_heads, mla_ranks=args.mla_ranks, batch=args.batch,
                          decode_steps=args.decode_steps)


def _configure_mla(args, common: dict):
    from multihead.lab.mla import MLAConfig, run_mla

    corpus = None
    if args.corpus is not None:
        if not args.corpus.exists():
            raise UsageError(f"--corpus {args.corpus}: no such file")
        if not args.corpus.is_file():  # a folder, or a device such as /dev/zero that reads forever
            raise UsageError(f"--corpus {args.corpus} is not a regular file; give a UTF-8 text file")
        corpus = str(args.corpus)
    return run_mla, _build(args, MLAConfig, corpus=corpus, ranks=args.ranks, kv_heads=args.kv_heads,
                           tolerance=args.tolerance, d_model=args.d_model, n_layers=args.n_layers,
                           n_heads=args.n_heads, context=args.context, **common)


def _configure_induction(args, common: dict):
    """The head geometry asked for, scaled to a CPU (the notes printed say what was scaled)."""
    from multihead.lab.configs import InductionConfig, scale_induction
    from multihead.lab.induction import run_induction

    base = InductionConfig.quick() if args.quick else InductionConfig()
    geometry, notes = scale_induction(variant=args.variant, layers=args.n_layers, d_model=args.d_model,
                                      n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, kv_rank=args.kv_rank,
                                      rope_dim=args.rope_dim, base=base, quick=args.quick)
    for line in notes:
        # stdout is the report's, or with --json the JSON's alone
        print(f"multihead lab induction: {line}", file=sys.stderr if args.json else sys.stdout, flush=True)
    given = {k: v for k, v in common.items() if v is not None}  # --steps etc. win over --quick's smoke run
    return run_induction, _build(args, InductionConfig, **{**geometry, "vocab": args.vocab,
                                                           "seq_len": args.seq_len, **given})


def _configure_uptrain(args, common: dict):
    """The lab model's uptrain, or with --model (or its --resume, --rope-dim) a transformers
    model's, which multihead.lab.uptrain_hf configures."""
    if args.model is not None or args.resume or args.rope_dim is not None or args.long:
        from multihead.lab.uptrain_hf import configure

        return configure(args, args.quick)
    from multihead.lab.uptrain import UptrainConfig, run_uptrain

    if args.ranks is not None and any(isinstance(r, tuple) for r in args.ranks):
        raise UsageError(f"--kv-ranks {','.join(f'{r[0]}+{r[1]}' for r in args.ranks if isinstance(r, tuple))}: "
                         "R+P (a RoPE width per MLA target) goes with --model; the lab model's MLA ranks are plain "
                         "kv_ranks (its RoPE dims: --positions rope --mla-rope-dims)")
    src = args.from_checkpoint
    if src is not None and not src.is_dir():
        raise UsageError(f"--from {src}: no such folder; give the output folder of a `multihead lab mla` run")
    return run_uptrain, _build(args, UptrainConfig, from_checkpoint=None if src is None else str(src),
                               kv_heads=args.kv_heads, inits=args.inits, ranks=args.ranks,
                               fractions=args.fractions, uptrain_lr=args.uptrain_lr, positions=args.positions,
                               mla_rope_dims=args.mla_rope_dims, d_model=args.d_model,
                               n_layers=args.n_layers, n_heads=args.n_heads, **common)


_EXPERIMENT_CONFIGS = {"heads": _configure_heads, "kv": _configure_kv, "mla": _configure_mla,
                       "induction": _configure_induction, "uptrain": _configure_uptrain}


def _report(res: dict, out: Path) -> None:
    r = res["results"]
    if r.get("table"):
        print(r["table"])
    for key in ("conclusion", "summary"):
        if r.get(key):
            print()
            print(r[key])
    print()
    for note in res.get("notes", []):
        print(f"note: {note}")
    for d in res.get("diverged", []):
        print(f"training diverged at step {d['step']} in {d['run']} ({d['reason']})")
    status = "interrupted: partial results" if res["interrupted"] else "results"
    print(f"{status} in {out}/results.json; plots: {', '.join(res['plots']) or 'none'}"
          + (f"; checkpoint: {out}/{res['checkpoint']} (multihead inspect --model {out})" if res["checkpoint"] else ""))
    extra = r.get("mla_checkpoint")
    if extra:
        print(f"MLA checkpoint: {out}/{extra} (multihead inspect --model {out}/{extra})")
    sys.stdout.flush()
