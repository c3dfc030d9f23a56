"""The `multihead` command.

Each subcommand lives with its feature: a module that defines
`add_arguments(parser)` and `main(args) -> int`. They are registered here by module
path and imported only when the parser is built, and each keeps its heavy imports
(torch, transformers, matplotlib) inside `main`, so `multihead --help` stays fast.
Bad user input exits with code 2 and a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module path, one-line help)
SUBCOMMANDS = {
    "plan": ("multihead.plan.cli", "account for and recommend an attention geometry"),
    "inspect": ("multihead.inspect.cli", "see what every head of a real model does"),
    "lab": ("multihead.lab.cli", "run the classic multi-head experiments"),
    "tour": ("multihead.tour", "a short tour: build MHA/GQA/MQA, check them, decode"),
}


class UsageError(Exception):
    """Bad user input: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Multi-head attention: modules, inspection, planning and experiments.",
    )
    from multihead import __version__

    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_path)
        except ModuleNotFoundError as err:
            if err.name is None or not module_path.startswith(err.name):
                raise
            continue  # that feature is not built yet
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or "").strip())
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_main", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._main(args) or 0)
    except UsageError as err:
        print(f"multihead {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`multihead plan ... | head`): not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
