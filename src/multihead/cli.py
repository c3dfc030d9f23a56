"""The `multihead` command.

Each subcommand lives with its feature: a module with `add_arguments(parser)`, `main(args)
-> int` and `DESCRIPTION` (its --help text), registered here by module path and imported
only when the parser is built; heavy imports (torch, transformers, matplotlib) stay inside
`main`, so `multihead --help` stays fast.

This file is the one boundary between the library's errors and the terminal: a user's
mistake (a `ValueError`, `multihead.errors.UsageError` included; an `OSError` on a file;
memory exhausted by the sizes asked) prints one line, `multihead CMD: error: ...`, and
exits 2; anything else is a bug in multihead: the traceback, exit code 1. `--debug`
(anywhere on the command line, or MULTIHEAD_DEBUG=1) prints the traceback of every error,
then the same line and code. Ctrl-C exits 130; a closed pipe (`multihead plan ... | head`)
exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from multihead.cli_args import Parser
from multihead.errors import UsageError

__all__ = ["UsageError", "build_parser", "induction_check", "main", "user_message"]

# name -> (module path, one-line help)
SUBCOMMANDS = {
    "plan": ("multihead.plan.cli", "account for and recommend an attention geometry"),
    "inspect": ("multihead.inspect.cli", "see what every head of a real model does"),
    "heads": ("multihead.heads.cli", "which heads matter: patching, importance, pruning"),
    "lab": ("multihead.lab.cli", "run the classic multi-head experiments"),
    "tour": ("multihead.tour", "a short tour: build MHA/GQA/MQA, check them, decode"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(  # flags spelled in full, in every subcommand (its subparsers are Parsers)
        prog="multihead",
        description="Multi-head attention: modules, inspection, planning and experiments.",
    )
    from multihead import __version__

    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of every error (also accepted after the subcommand)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_path)
        p = sub.add_parser(name, help=help_text, description=module.DESCRIPTION.strip(), allow_abbrev=False)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    # inspect, a tool of its own, imports no other tool; the command that holds both hands it
    # heads' causal check for the induction heads it finds
    sub.choices["inspect"].set_defaults(induction_check=induction_check)
    return parser


def induction_check(loaded, ranked: list[tuple[int, int]]) -> dict:
    """`multihead heads induction`'s causal check of a ranking of heads, made small enough for a
    first look (`heads induction` runs 4 sequences of 50): the loss on the repeated half of 2
    random token sequences of 40, repeated once, with the top 4 heads mean-ablated, against 4
    random heads in 5 draws (`multihead.heads.cli.causal_check`: 8 forwards in all)."""
    from multihead.heads import tasks
    from multihead.heads.cli import causal_check

    n, limit = 2, getattr(loaded, "max_positions", None)
    length = min(40, limit // 2) if limit else 40
    task = tasks.induction(n, length, seed=0, vocab=loaded.token_source)
    cells = [(layer, h) for layer in range(loaded.n_layers) for h in range(loaded.n_heads)]
    check = causal_check(loaded.model, task.clean, task.metric, ranked, cells, task.reference, how="mean", ks=(4,))
    return {"n": n, "length": length, "ranked_by": "prefix matching (multihead inspect)", **check}


def _split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Take every `--debug` before a `--` out of argv, so it works after a subcommand too."""
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]
    return [a for a in argv[:end] if a != "--debug"] + argv[end:], debug


def user_message(err: BaseException) -> str | None:
    """The one-line message for an error the user caused, or None for a bug."""
    if isinstance(err, ValueError):  # UsageError, UnicodeError and JSONDecodeError included
        text = str(err)
    elif isinstance(err, OSError):
        what = err.strerror or str(err) or type(err).__name__
        text = f"{err.filename}: {what}" if err.filename is not None else what
        if err.filename2 is not None:
            text += f" (and {err.filename2})"
    elif isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError" or (
            isinstance(err, RuntimeError) and "can't allocate memory" in str(err)):
        text = "out of memory for the sizes asked; try smaller ones"
    else:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines) or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); return the exit code (never raises
    SystemExit: argparse's own exits are returned)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    argv, debug = _split_debug(argv)
    debug = debug or os.environ.get("MULTIHEAD_DEBUG", "") not in ("", "0")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a usage error argparse printed
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    if getattr(args, "_main", None) is None:
        parser.print_help(sys.stderr)
        return 2
    name = f"multihead {args.command}"
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`multihead plan ... | head`): not an error of ours
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (captured): nothing to silence
            pass
        return 0
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    except Exception as err:  # the boundary: every error ends here, as a line or a traceback
        message = user_message(err)
        if debug or message is None:
            traceback.print_exc(file=sys.stderr)
        if message is None:
            print(f"{name}: internal error: {type(err).__name__}: {err}; this is a bug in multihead, "
                  "please report it with the traceback above", file=sys.stderr)
            return 1
        print(f"{name}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
