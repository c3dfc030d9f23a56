"""The flags every `multihead` subcommand shares, defined once: one spelling, one help text.

Each tool's CLI (plan, inspect, heads, lab, tour) adds its shared flags through these
functions, so `--model`, `--json`, `--out`, `--threads`, `--seed`, `--context` (a sequence
length) and `--device` (where torch runs) read and mean the same everywhere.
This module imports nothing of multihead's, so every tool may use it without importing
another tool or the command itself.

`Parser` is the command's parser class: flags are spelled in full (argparse's prefix
matching is off, so a new flag never changes what an old abbreviation meant), and an
abbreviation is refused with the flag it abbreviates. `renamed` keeps an old spelling as a
usage error that names the new one.
"""

from __future__ import annotations

import argparse
import contextlib

__all__ = ["Parser", "add_context", "add_device", "add_json", "add_model", "add_out", "add_seed", "add_threads",
           "int_in", "model_help", "renamed", "seed", "torch_threads"]

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
            full = sorted(o for o, action in self._option_string_actions.items()
                          if o.startswith(typed) and o != typed and not isinstance(action, _Renamed))
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


def int_in(low: int, high: int, expected: str):
    """An argparse type: an integer in low .. high; anything else is refused with `expected`
    ("a seed in 0 .. 2**63 - 1") and what was received."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {expected}; received {text!r}")
        return value

    return parse


# an argparse type: a seed every generator takes (torch's need 0 .. 2**63 - 1)
seed = int_in(0, 2**63 - 1, "a seed in 0 .. 2**63 - 1")


def add_seed(parser, help: str, default: int = 0) -> argparse.Action:
    return parser.add_argument("--seed", type=seed, default=default, metavar="N", help=help)


_threads = int_in(1, MAX_THREADS, f"a positive integer of at most {MAX_THREADS}")


THREADS_HELP = "CPU threads for torch during the run (default: torch's own, one per core)"


def add_threads(parser, help: str = THREADS_HELP) -> argparse.Action:
    """--threads N, the CPU threads torch may use (applied by `torch_threads`)."""
    return parser.add_argument("--threads", type=_threads, default=None, metavar="N", help=help)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block on `n` CPU threads (None: torch's own number), then restore the number
    before it, so a command run inside a notebook or a test leaves torch as it was."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def add_context(parser, help: str, type=None, **kwargs) -> argparse.Action:
    """--context TOKENS, a sequence length (the old --seq-len refused where a command had it)."""
    kwargs.setdefault("default", None)
    return parser.add_argument("--context", type=type, metavar="TOKENS", help=help, **kwargs)


TORCH_DEVICES = ("auto", "cpu", "cuda")  # where torch runs; plan.devices.DEVICES are accelerator presets


def add_device(parser, help: str) -> argparse.Action:
    """--device auto|cpu|cuda, where torch builds and runs the modules (auto: cuda when present).
    An accelerator to plan for is `plan --accelerator`, a different thing."""
    return parser.add_argument("--device", choices=TORCH_DEVICES, default="auto", help=help)


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, new: str, note: str = "", **kwargs):
        self.new, self.note = new, note
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="*", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}" + (f" ({self.note})" if self.note else ""))


def renamed(parser, old: str, new: str, note: str = "") -> argparse.Action:
    """Refuse the old spelling `old` of a flag with a usage error naming `new` (hidden from --help);
    `note` says why, where the old spelling now means something else elsewhere."""
    return parser.add_argument(old, action=_Renamed, new=new, note=note)
