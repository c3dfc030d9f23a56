"""What the `multihead heads` commands share: the bound on counts, the check that inputs fit
the model's vocabulary, and the token after a text, each a one-line UsageError when it fails;
and --threads, the CPU threads torch uses for the run.
"""

from __future__ import annotations

import contextlib

from multihead.errors import UsageError

THREADS_HELP = "CPU threads for torch during the run (default: torch's own, one per core)"
MAX_COUNT = 100_000  # pairs, sequences or tokens: beyond it a run would not end (a 400-digit --n loops)


def check_count(flag: str, value: int, low: int) -> None:
    """UsageError unless low <= value <= MAX_COUNT (a huge value shown by its first digits)."""
    if not low <= value <= MAX_COUNT:
        shown = value if len(str(value)) <= 20 else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise UsageError(f"{flag} must be between {low} and {MAX_COUNT:,}; received {shown}")


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
    from multihead.heads.tokens import check_ids_fit

    try:
        for x in inputs:
            check_ids_fit(model, x)
    except ValueError as err:
        raise UsageError(f"--model: {err}") from None


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
