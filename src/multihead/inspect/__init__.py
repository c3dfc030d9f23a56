"""See what every head of a real model does: capture per-head weights, score head roles,
draw them (self-contained HTML, PNG).

    from multihead.inspect import capture, head_roles, save_html
    cap = capture("The cat sat on the mat.")          # bundled all-MiniLM-L6-v2
    roles = head_roles(cap)                             # ranked: layer 0 head 2 first
    save_html(cap, "view.html", roles)                  # render_html(cap, roles): the page as a str

Importing this package (and the `multihead` command) stays light: torch, transformers
and matplotlib load only when a function needs them; the other names load on first use.
"""

from __future__ import annotations

from multihead._lazy import lazy_exports

# Imported now, not lazily: the function `capture` shares its name with the module
# `multihead.inspect.capture`, and importing that module later would otherwise leave the
# module, not the function, as `multihead.inspect.capture`. The module is torch-free.
from multihead.inspect.capture import capture

_MODULES = {
    "multihead.inspect.capture_types": ("AttentionCapture", "HeadRole"),
    "multihead.inspect.stream": ("HeadSummaries", "summaries"),
    "multihead.inspect.roles": ("head_roles", "role_scores", "induction_scores"),
    "multihead.inspect.html": ("render_html", "save_html", "notebook_html"),
    "multihead.inspect.summaries_html": ("render_summaries_html", "save_summaries_html"),
    "multihead.inspect.png": ("save_grid", "save_head"),
}

__getattr__, __dir__, _EXPORTS = lazy_exports(__name__, _MODULES, globals())
__all__ = ["capture", *_EXPORTS]
