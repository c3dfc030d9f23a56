"""Progress of a long scan: items (heads) done, their rate and the time left.

`progress=` of the scans takes None/False (silent), True (a line on stderr, redrawn in
place, only when stderr is a terminal: logs and pipes stay quiet) or a callable
`progress(done, total, eta_s)` (eta_s None until measured), for a caller's own display.

The work per item is not even (a variant of layer 0 runs every block, one of the last
layer one), so the time left is priced by each forward's cost (`costs`, in any unit),
from the rate since the first forward (which pays for start-up), and said only once a
second forward is measured. The rate shown is items per second since the start.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def check_progress(progress, name: str = "progress"):
    if progress is None or isinstance(progress, bool) or callable(progress):
        return progress
    raise TypeError(f"{name} must be None, True/False or a callable(done, total, eta_s); received "
                    f"{type(progress).__name__}")


class ScanProgress:
    """Reports the end of each of a list of forwards (each carrying some items)."""

    def __init__(self, progress, total: int, costs: list[float], label: str, *, stream=None,
                 clock: Callable[[], float] = time.perf_counter):
        self.callback = progress if callable(progress) else None
        self.stream = sys.stderr if stream is None else stream
        self.draw = progress is True and bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.label, self.clock = total, label, clock
        self.costs = [max(float(c), 1e-12) for c in costs]
        self.left = sum(self.costs)
        self.done = 0
        self.forwards = 0
        self.start = clock()
        self.anchor: tuple[float, float] | None = None  # (time, cost left) after the first forward
        self._last = -1.0

    @property
    def active(self) -> bool:
        return self.callback is not None or self.draw

    def eta(self, now: float) -> float | None:
        if self.anchor is None or self.forwards < 2:
            return None
        t0, left0 = self.anchor
        spent = left0 - self.left
        return 0.0 if self.left <= 0 else None if spent <= 0 else (now - t0) / spent * self.left

    def step(self, items: int, cost: float) -> None:
        """One forward is done, carrying `items` items, of `cost` (one of `costs`)."""
        now = self.clock()
        self.left -= max(float(cost), 1e-12)
        self.forwards += 1
        self.done += items
        if self.anchor is None:
            self.anchor = (now, self.left)
        eta = self.eta(now)
        if self.callback is not None:
            self.callback(self.done, self.total, eta)
        if self.draw and (now - self._last >= 0.2 or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            line = (f"{self.label}: {self.done}/{self.total} heads, {rate:.3g} heads/s, "
                    f"ETA {'(measuring)' if eta is None else _fmt(eta)}")
            self.stream.write("\r\033[K" + line + ("\n" if self.done >= self.total else ""))
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (on a terminal only, like the bar)."""
        if self.draw:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """After an error: end the redrawn line."""
        if self.draw and self.done < self.total and self.forwards:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}" if s < 3600 else f"{s // 3600}h{s // 60 % 60:02d}"
