"""`multihead inspect`: run a text through a model and summarise what every head does (role
scores and per-head summaries, streamed at any length), with the HTML view, PNG heatmaps and
JSON. `DESCRIPTION` is the --help text; docs/inspect.md the guide.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings

from multihead.cli_args import add_json, add_model, add_threads, torch_threads
from multihead.errors import UsageError
from multihead.files import decode_utf8, output_file
from multihead.interop.loaders import model_source, quiet_hub

DESCRIPTION = """See what every head of a real model does.

Runs the text through the model (by default the bundled all-MiniLM-L6-v2) with its
attention on multihead's fused kernel and summarises every head asked, a block of query
rows at a time beside the kernel, at any length up to the model's positions (8,192 tokens
for SmolLM2) in bounded memory: entropy (nats), mean distance, first-token (sink) mass,
mass beyond 1K / 4K tokens back, and the role scores (previous-token, current-token,
first-token, delimiter, duplicate-token, induction, prefix-matching on repeated random
tokens). Prints the ranked role table with the summaries. --html writes a self-contained
page (no network): the head view of the weights up to 512 tokens, and past that every
head's summaries with its pattern as block sums and each query's top keys; --png
heatmaps of the first 512 tokens.

examples:
  multihead inspect "The cat sat on the mat." --html view.html
  multihead inspect "The cat sat on the mat." --only-layers 0 --only-heads 2 --png head.png
  multihead inspect "When Mary and John went to the store, John gave a drink to Mary" --roles
  multihead inspect "Some text" --model path/to/hf-model-folder --json
  multihead inspect --text-file book.txt --model smollm2 --max-tokens 8192 --json
"""

TOP = 10  # rows of the role table without --roles
_MAX_STDIN = 16 * 2**20
PAGE_TOKENS = 512  # the head view and the PNGs draw the weights of at most this many first tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("text", nargs="?",
                        help='the text to look at, e.g. "The cat sat on the mat." ("-" reads stdin)')
    parser.add_argument("--text-file", metavar="PATH",
                        help="read the text from this UTF-8 file instead (long texts: see --max-tokens)")
    add_model(parser, "minilm")
    # --only-layers, a selection; --n-layers N (plan, lab) is a count of layers.
    parser.add_argument("--only-layers", metavar="LIST", dest="layers",
                        help="capture only these layers, comma-separated, ranges allowed, e.g. 0,3 or 0-2 "
                             "(default: all)")
    parser.add_argument("--only-heads", metavar="LIST", dest="heads",
                        help="capture only these heads in each layer, e.g. 2,5 or 0-3,7 (default: all)")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="keep at most N tokens (default and limit: the model's positions, e.g. 8192 for "
                             "smollm2); every head is summarised at any length in bounded memory")
    parser.add_argument("--html", metavar="PATH",
                        help="write the self-contained HTML page to PATH (the head view up to 512 tokens; past that "
                             "the summaries page: every head, its pattern as block sums, top-k rows)")
    parser.add_argument("--png", metavar="PATH",
                        help="write heatmaps to PATH: a layer x head grid, or one labelled head if one is captured")
    parser.add_argument("--all", action="store_true", dest="all_heads",
                        help="also print the full table: every head with all its role scores and summaries "
                             "(default: the summary, per role its top heads)")
    parser.add_argument("--roles", action="store_true",
                        help="the same as --all (the full table; kept for scripts that use it)")
    parser.add_argument("--table", metavar="PATH",
                        help="write the full table (every head: its role, every score, its summaries) as JSON to "
                             "PATH, with the causal check where there is one")
    parser.add_argument("--tl-scores", action="store_true",
                        help="also show TransformerLens' head-detector scores (tl_prev, tl_dup, tl_ind: its \"mul\" "
                             "score over all rows, BOS included, as detect_head computes it) beside multihead's; "
                             "implies --roles")
    add_json(parser,
             help="print JSON (tokens, ranked roles with every score, per-head summaries, files written) "
             "instead of tables")
    add_threads(parser)


def _indices(flag: str, value: str | None) -> list[int] | None:
    """'0,3' -> [0, 3]; '0-3,7' -> [0, 1, 2, 3, 7]. An empty item ('1,,2', '1,') or a
    backwards range is refused: it is a typo, not a request. Order and duplicates are left
    to capture(), which checks the ranges against the model."""
    if value is None:
        return None
    usage = f"{flag} takes comma-separated integers or ranges, e.g. {flag} 0,3 or {flag} 0-3,7"
    out = []
    for raw in value.split(","):
        item = raw.strip()
        lo, dash, hi = item.partition("-")
        try:
            if not item:
                raise ValueError("an empty item")
            if dash and lo.strip():  # a range a-b (a leading '-' is a negative number: left to int())
                a, b = int(lo), int(hi)
                if b < a:
                    raise ValueError(f"the range {item!r} runs backwards")
                if b - a >= 2**16:
                    raise ValueError(f"the range {item!r} is longer than any model's layers or heads")
                out += range(a, b + 1)
            else:
                out.append(int(item))
        except ValueError as err:
            why = str(err) if str(err).startswith(("an empty", "the range")) else f"{item!r} is not an integer"
            raise UsageError(f"{usage}; received {value!r} ({why})") from None
    return out


def _text_argument(args: argparse.Namespace) -> str:
    """The text from the positional argument, stdin ("-") or --text-file (exactly one)."""
    if args.text_file is not None:
        if args.text is not None:
            raise UsageError("give the text or --text-file, not both")
        from pathlib import Path

        path = Path(args.text_file).expanduser()
        if path.is_dir():
            raise UsageError(f"--text-file {args.text_file!r} is a directory; give a UTF-8 text file")
        if not path.exists():
            raise UsageError(f"--text-file {args.text_file!r}: no such file")
        # anything else that exists (a file, a pipe, a device such as /dev/zero) is read up to the limit
        from multihead.files import read_at_most

        try:
            data = read_at_most(path, _MAX_STDIN + 1)  # (a pipe or device may return short reads)
        except OSError as err:
            raise UsageError(f"--text-file {args.text_file!r}: cannot read it ({err.strerror or err})") from None
        text = _decoded(data, f"--text-file {args.text_file!r}",
                        "the model reads at most its positions' worth of tokens (cut the file)")
        if not text.strip():
            raise UsageError(f"--text-file {args.text_file!r} is empty")
        return text
    if args.text is None:
        raise UsageError('give a text, e.g. multihead inspect "The cat sat on the mat.", "-" for stdin, '
                         "or --text-file PATH")
    return _read_text(args.text)


def _decoded(data: bytes, label: str, too_long: str) -> str:
    """The UTF-8 text of `data` (read up to _MAX_STDIN + 1 bytes from `label`), refused when longer."""
    if len(data) > _MAX_STDIN:
        raise UsageError(f"{label} is longer than {_MAX_STDIN // 2**20} MiB; {too_long}")
    return decode_utf8(data, label, "give UTF-8 text")


def _read_text(text: str) -> str:
    if text == "-":
        data = sys.stdin.buffer.read(_MAX_STDIN + 1) if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        text = _decoded(data, "the text on stdin", "inspect looks at a few hundred tokens (--max-tokens)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        # a command-line argument that was not UTF-8 reaches Python as lone surrogates
        raise UsageError(f"the text is not valid UTF-8 (character {err.start}: "
                         f"{text[err.start]!r}); give UTF-8 text") from None
    if not text.strip():
        raise UsageError('text is empty; give a sentence, e.g. multihead inspect "The cat sat on the mat."')
    return text


def main(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack, torch_threads(args.threads):
        return _main(args, stack)


def _main(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    text = _text_argument(args)
    layers = _indices("--only-layers", args.layers)
    heads = _indices("--only-heads", args.heads)
    src, taken = model_source(args.model), {}
    html_path = output_file("--html", args.html, "view.html", source=src, taken=taken)
    png_path = output_file("--png", args.png, "heads.png", source=src, taken=taken)
    table_path = output_file("--table", args.table, "heads.json", source=src, taken=taken)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1; received {args.max_tokens}")

    from multihead.interop.loaders import InspectError, TruncationWarning, resolve_model

    try:
        resolve_model(args.model)  # a bad --model is refused before anything heavy loads
    except InspectError as err:
        raise UsageError(str(err)) from None
    _status(f"multihead inspect: loading {args.model} (the first import of torch and transformers takes "
            "a few seconds) ...")
    cap, long_page = None, False
    try:
        stack.enter_context(quiet_hub(logs=True))  # the command's noise off, put back after
        from multihead.inspect.capture import capture
        from multihead.inspect.roles import head_roles, induction_scores
        from multihead.inspect.stream import TOP_K, summaries
        from multihead.interop.loaders import load_model

        model = load_model(args.model)
        _status(f"multihead inspect: running {model.name} on {len(text):,} characters ...")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TruncationWarning)
            # each query's top-k keys and the block-summed patterns are for the page only
            summ = summaries(model, text, layers=layers, heads=heads, max_tokens=args.max_tokens,
                             transformer_lens=args.tl_scores, progress=None, patterns=html_path is not None,
                             top_k=TOP_K if html_path is not None else 0)
        _status("multihead inspect: prefix matching on repeated random tokens ...")
        prefix = induction_scores(model)
        long_page = html_path is not None and len(summ.tokens) > PAGE_TOKENS
        if (html_path is not None and not long_page) or png_path is not None:  # weights of the first PAGE_TOKENS
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TruncationWarning)
                cap = capture(text, model=model, layers=layers, heads=heads,
                              max_tokens=min(len(summ.tokens), PAGE_TOKENS))
    except InspectError as err:
        raise UsageError(str(err)) from None
    finally:
        _status(None)
    for w in caught:
        if issubclass(w.category, TruncationWarning):
            print(f"multihead inspect: warning: {w.message}", file=sys.stderr)
    roles = head_roles(summ, prefix_matching=prefix, transformer_lens=args.tl_scores)
    check = _causal_check(args, model, prefix, summ)

    written, png_error = _write_files(args, summ, roles, cap, check, long_page, (html_path, png_path, table_path))
    if args.json:
        print(json.dumps(_as_json(summ, roles, written, check), indent=1, default=str))
        return _png_verdict(png_error, written)
    if args.all_heads or args.roles or args.tl_scores:
        print(format_roles(roles, full=True, summaries=summ))
        print()
    from multihead.inspect.summary import format_summary

    print(format_summary(summ, roles, written, check=check, long_page=long_page, model_arg=args.model))
    return _png_verdict(png_error, written)


def _write_files(args: argparse.Namespace, summ, roles, cap, check, long_page: bool, paths) -> tuple[dict, str | None]:
    """The page, the PNG and the table asked for: ({kind: path written}, the PNG's error or None)."""
    html_path, png_path, table_path = paths
    written = {}
    if html_path is not None and long_page:  # every head's summaries, patterns as block sums, top-k rows
        from multihead.inspect.summaries_html import save_summaries_html

        save_summaries_html(summ, html_path, roles=roles)
        written["html"] = str(html_path.resolve())
    elif html_path is not None:
        from multihead.inspect.html import save_html

        save_html(cap, html_path, roles=roles, max_tokens=PAGE_TOKENS)
        written["html"] = str(html_path.resolve())
    png_error = None
    if png_path is not None:
        from multihead.inspect.png import save_grid, save_head

        try:
            if len(cap.layers) == 1 and len(cap.heads) == 1:
                save_head(cap, cap.layers[0], cap.heads[0], png_path)
            else:
                save_grid(cap, png_path, roles=roles)
            written["png"] = str(png_path.resolve())
        except ImportError as err:  # no matplotlib: the rest of the run still stands
            png_error = f"--png {args.png} was not written: {str(err).splitlines()[0]}"

    if table_path is not None:
        from multihead.files import write_text

        written["table"] = str(table_path.resolve())
        write_text(table_path, json.dumps(_as_json(summ, roles, written, check), indent=1, default=str) + "\n")
    return written, png_error


def _causal_check(args: argparse.Namespace, model, prefix, summ) -> dict | str | None:
    """The induction heads' causal check, on a decoder LM, when the `multihead` command handed
    inspect one (`args.induction_check`: heads' ablations, which inspect, a tool of its own,
    does not import): the top heads by prefix matching ablated against as many random heads.
    None on a model without next-token logits or without a check; a str: why it did not run."""
    check = getattr(args, "induction_check", None)
    if not getattr(model, "is_causal_lm", getattr(model, "causal", False)):
        return None
    if len(summ.layers) < summ.n_layers or len(summ.heads) < summ.n_heads:
        return "it ranks every head: run without --only-layers / --only-heads"
    if check is None:
        return None
    _status("multihead inspect: the causal check (the induction heads ablated) ...")
    try:
        ranked = sorted(((layer, h) for layer in summ.layers for h in summ.heads),
                        key=lambda c: -float(prefix[c[0], c[1]]))
        return check(model, ranked)
    finally:
        _status(None)


def _png_verdict(png_error: str | None, written: dict) -> int:
    """0, or (a PNG was asked and matplotlib is missing) one error line after the table
    and the HTML view, which were produced: exit 2."""
    if png_error is None:
        return 0
    made = "the table and the HTML view were produced" if "html" in written else "the table was produced"
    raise UsageError(f"{png_error} ({made})")


def _as_json(summ, roles, written, check=None) -> dict:
    return {
        "model": summ.model,
        "n_layers": summ.n_layers,
        "n_heads": summ.n_heads,
        "layers": summ.layers,
        "heads": summ.heads,
        "tokens": summ.tokens,
        "token_ids": summ.token_ids,
        "meta": summ.meta,
        "roles": [{"rank": i + 1, "layer": r.layer, "head": r.head, "role": r.role, "score": r.score,
                   "runner_up": r.runner_up or None, "runner_up_score": r.runner_up_score if r.runner_up else None,
                   "scores": r.scores} for i, r in enumerate(roles)],
        "summaries": summ.to_json()["summaries"],
        "causal_check": check if isinstance(check, dict) else None,
        "files": written,
    }


_SHORT = {"previous_token": "prev", "next_token": "next", "current_token": "self", "first_token": "first",
          "delimiter": "delim", "duplicate_token": "dup", "induction": "induct", "prefix_matching": "prefix",
          "entropy": "entropy", "tl_previous_token": "tl_prev", "tl_duplicate_token": "tl_dup",
          "tl_induction": "tl_ind"}


def _status(text: str | None) -> None:
    """A progress line on a terminal (stderr), replaced by the next one; None clears it.

    Importing transformers takes seconds: say so at once rather than sit silent. Nothing
    is written when stderr is not a terminal, so logs and pipes stay clean.
    """
    if not sys.stderr.isatty():
        return
    sys.stderr.write("\r\033[K" + (text or ""))
    sys.stderr.flush()


# The summaries shown beside the roles: (name, column header, format)
_SUMMARY_COLUMNS = (("entropy", "H(nats)", "{:>7.2f}"), ("mean_distance", "dist", "{:>7.1f}"),
                    ("first_token_mass", "sink", "{:>6.2f}"), ("beyond_1k", ">1k", "{:>5.2f}"),
                    ("beyond_4k", ">4k", "{:>5.2f}"))


def format_roles(roles, *, full: bool = False, summaries=None) -> str:
    """The ranked role table as text: the top rows, or every head with every score; with
    `summaries` (a HeadSummaries), each head's entropy, mean distance, sink mass and mass
    beyond 1K / 4K tokens back too (the columns a text too short to show are left out)."""
    shown = roles if full else roles[:TOP]
    cols = [c for c in _SHORT if any(c in r.scores for r in shown)] if full else []
    sums = [c for c in _SUMMARY_COLUMNS if summaries is not None and c[0] in summaries.scores]
    head = f"{'rank':>4} {'layer':>5} {'head':>4}  {'role':<15} {'score':>5}  {'runner-up':<14}"
    head += "".join(f" {_SHORT[c]:>7}" for c in cols)
    head += "".join(" " + f"{label:>{len(fmt.format(0.0))}}" for _, label, fmt in sums)
    lines = [head.rstrip()]
    for i, r in enumerate(shown):
        second = f"{_SHORT.get(r.runner_up, r.runner_up)}={r.runner_up_score:.2f}" if r.runner_up else "-"
        line = f"{i + 1:>4} {r.layer:>5} {r.head:>4}  {r.role:<15} {r.score:>5.2f}  {second:<14}"
        line += "".join(f" {r.scores[c]:>7.2f}" if c in r.scores else f" {'-':>7}" for c in cols)
        if sums:
            values = summaries.head(r.layer, r.head)
            line += "".join(" " + fmt.format(values[name]) for name, _, fmt in sums)
        lines.append(line.rstrip())
    if not full and len(roles) > len(shown):
        lines.append(f"... {len(roles) - len(shown)} more heads (--roles shows every head and every score)")
    return "\n".join(lines)
