"""The error a user's mistake raises, one floor below the tools and the CLI.

`UsageError` is a `ValueError`: a tool (plan, inspect, lab) raises it, or any other
`ValueError`, for bad input, naming what was received and what is valid; the `multihead`
command turns every such error into one line on stderr and exit code 2. Tools never
import the CLI to raise it (see ../DESIGN layering: cli -> tools -> library).
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """Bad user input, worded for the command line (a flag, a file): one line, exit code 2."""
