"""What the `multihead heads` commands share: the bound on counts, the check that inputs fit
the model's vocabulary, and the token after a text, each a one-line UsageError when it fails; a
subcommand's parser made from its module's docstring; the printed table with its top heads, and
the heat maps of a layer x head table. (--threads and its `torch_threads` are every command's: multihead.cli_args.)
"""

from __future__ import annotations

import argparse

from multihead.errors import UsageError
from multihead.heads.heatmap import text_table

MAX_COUNT = 100_000  # pairs, sequences or tokens: beyond it a run would not end (a 400-digit --n loops)


def check_count(flag: str, value: int, low: int) -> None:
    """UsageError unless low <= value <= MAX_COUNT (a huge value shown by its first digits)."""
    if not low <= value <= MAX_COUNT:
        shown = value if len(str(value)) <= 20 else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise UsageError(f"{flag} must be between {low} and {MAX_COUNT:,}; received {shown}")


def check_pair_or_task(args, command: str, tasks: str, verb: str) -> None:
    """--task (it makes its own prompts: none of --clean, --corrupted, --answer, --wrong) or
    one pair (all four), refused before the model loads, so a mistake costs no wait. `tasks`:
    the command's --task choices as written ("ioi|induction"); `verb`: what it does to one pair."""
    flags = ("clean", "corrupted", "answer", "wrong")
    if args.task is not None:
        given = [f"--{k}" for k in flags if getattr(args, k) is not None]
        if given:
            raise UsageError(f"--task {args.task} makes its own prompts; drop {', '.join(given)} (or drop --task to "
                             f"{verb} one pair)")
        return
    missing = [f"--{k}" for k in flags if getattr(args, k) is None]
    if missing:
        raise UsageError(f"heads {command} needs --task {tasks}, or one pair: --clean, --corrupted, --answer and "
                         f"--wrong (missing: {', '.join(missing)})")


def token_after(loaded, flag: str, text: str, token: str) -> tuple[int, str]:
    """The id and piece of `token` as the model would write it after `text`
    (`LoadedModel.token_after`, for `heads scan` and `heads path` alike); UsageError unless it
    is one known token."""
    try:
        return loaded.token_after(text, token, flag)
    except ValueError as err:
        raise UsageError(str(err)) from None


def check_fit(model, *inputs) -> None:
    """A one-line refusal (UsageError) when the inputs hold ids beyond the model's vocabulary."""
    from multihead.tokens import check_ids_fit

    try:
        for x in inputs:
            check_ids_fit(model, x)
    except ValueError as err:
        raise UsageError(f"--model: {err}") from None




def documented_parser(subparsers, name: str, help: str, doc: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name`, described by its module's docstring `doc`: the
    paragraph after the title as the description, the examples as the epilog."""
    return subparsers.add_parser(name, help=help, description=doc.split("\n\n")[1].replace("\n", " "),
                                 epilog="examples:" + doc.split("examples:")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)


def heat_maps(r: dict, png, html, command: str, title: str, subtitle: str, **axes) -> None:
    """Write the result `r`'s layer x head table as a PNG heat map (at `png`, titled `title`)
    and a self-contained HTML page (at `html`, under `subtitle`), each when its path is given,
    and record where in `r` ("png", "html"). The colours centre on the corrupted metric."""
    from multihead.heads.heatmap import heat_html, heat_png

    if png:
        heat_png(png, r["table"], r["metric_corrupted"], title, **axes)
        r["png"] = str(png)
    if html:
        heat_html(html, r["table"], r["metric_corrupted"], f"multihead heads {command}", subtitle)
        r["html"] = str(html)


def print_table_and_top(r: dict, head: str) -> None:
    """A scan's layer x head table, then its top heads, each as `head` formats it (with the
    row's fields: layer, head, value, effect...) and its share of clean - corrupted where known."""
    print(text_table(r["table"]))
    print("top heads (by |patched - corrupted|):")
    for t in r["top"]:
        rec = "" if t["recovered"] is None else f" ({100 * t['recovered']:.0f}% of clean - corrupted)"
        print("  " + head.format(**t) + rec)
