"""The flags every `multihead` subcommand shares, defined once: one spelling, one help text.

Each tool's CLI (plan, inspect, heads, lab) adds its shared flags through these functions,
so `--model`, `--json`, `--out`, `--threads` and `--seed` read and mean the same everywhere.
This module imports nothing of multihead's, so every tool may use it without importing
another tool or the command itself.

`Parser` is the command's parser class: flags are spelled in full (argparse's prefix
matching is off, so a new flag never changes what an old abbreviation meant), and an
abbreviation is refused with the flag it abbreviates. `renamed` keeps an old spelling as a
usage error that names the new one.
"""

from __future__ import annotations

import argparse

__all__ = ["Parser", "add_json", "add_model", "add_out", "add_seed", "add_threads", "model_help", "renamed",
           "seed"]

MAX_THREADS = 4096


class Parser(argparse.ArgumentParser):
    """An ArgumentParser without prefix matching whose subparsers are Parsers too
    (add_subparsers makes its parsers of the class of the parser it is called on)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for arg in extras:
            if not arg.startswith("--") or arg == "--":
                continue
            typed = arg.split("=", 1)[0]
            full = sorted(o for o in self._option_string_actions if o.startswith(typed) and o != typed)
            if full:
                self.error(f"{typed} is not a flag (flags are spelled in full); did you mean {' or '.join(full)}?")
        return namespace, extras


def model_help(default: str | None, decoder: bool = False, lab: bool = True) -> str:
    """The one help text of --model: the models a command can load, and its default.
    `decoder` for commands that read next-token logits; `lab=False` for those that need a
    transformers model (a `multihead lab` checkpoint is not one)."""
    sources = [
        "smollm2 (the bundled SmolLM2-135M-Instruct, a decoder LM)",
        "gemma3 (the bundled gemma-3-270m)",
        "a .gguf file",
        "a local Hugging Face " + ("causal LM " if decoder else "model ") + "folder",
    ]
    if lab:
        sources.append("a `multihead lab` checkpoint folder")
    if not decoder:
        sources.insert(0, "minilm (the bundled sentence-transformers/all-MiniLM-L6-v2, an encoder)")
    sources[-1] = "or " + sources[-1]
    what = f"a {'' if lab else 'transformers '}decoder language model: " if decoder else ""
    return what + ", ".join(sources) + (f"; default {default}" if default else "")


def add_model(parser, default: str | None, decoder: bool = False, lab: bool = True, **kwargs) -> argparse.Action:
    """--model NAME|PATH; `decoder` for commands that read next-token logits, `lab=False` for
    those that need a transformers model."""
    kwargs.setdefault("help", model_help(default, decoder, lab))
    return parser.add_argument("--model", default=default, metavar="NAME|PATH", **kwargs)


def add_json(parser, help: str = "print JSON instead of tables") -> argparse.Action:
    return parser.add_argument("--json", action="store_true", help=help)


def add_out(parser, help: str, **kwargs) -> argparse.Action:
    """--out DIR, the folder a command writes its results (or model) in."""
    kwargs.setdefault("metavar", "DIR")
    return parser.add_argument("--out", help=help, **kwargs)


def seed(text: str) -> int:
    """An argparse type: a seed every generator takes (torch's need 0 .. 2**63 - 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed >= 0; received {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected a seed in 0 .. 2**63 - 1; received {text!r}")
    return value


def add_seed(parser, help: str, default: int = 0) -> argparse.Action:
    return parser.add_argument("--seed", type=seed, default=default, metavar="N", help=help)


def _threads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; received {text!r}") from None
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected a positive integer of at most {MAX_THREADS}; received {text!r}")
    return value


def add_threads(parser, help: str) -> argparse.Action:
    """--threads N, the CPU threads torch may use."""
    return parser.add_argument("--threads", type=_threads, default=None, metavar="N", help=help)


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="*", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}")


def renamed(parser, old: str, new: str) -> argparse.Action:
    """Refuse the old spelling `old` of a flag with a usage error naming `new` (hidden from --help)."""
    return parser.add_argument(old, action=_Renamed, new=new)
