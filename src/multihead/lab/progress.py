"""The lab's plain-text progress bar: one line per training (steps, loss, tokens/s, ETA),
and the count and ETA across the several trainings of one experiment (`Overall`)."""

from __future__ import annotations

import sys
import time

__all__ = ["Overall", "Progress"]


class Progress:
    """A plain-text progress bar on stderr: steps, loss, tokens/s and ETA.

    On a terminal it redraws one line; otherwise (logs, CI, tests) it prints a line about
    every 10% so that logs stay short. `enabled=False` silences it.
    """

    def __init__(self, total: int, label: str = "", *, stream=None, enabled: bool = True, width: int = 24,
                 overall: Overall | None = None):
        self.total = max(1, int(total))
        self.overall = overall
        self._base = overall.done if overall is not None else 0
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.width = width
        self.start = time.perf_counter()
        self.tokens = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1
        self._last_draw = 0.0

    def update(self, step: int, loss: float, tokens: int = 0) -> None:
        """Report that `step` steps (of `total`) are done, the last loss, and tokens seen."""
        self.tokens += tokens
        if self.overall is not None:
            self.overall.done = self._base + step
        if not self.enabled:
            return
        now = time.perf_counter()
        decile = 10 * step // self.total
        if self._tty:
            if step < self.total and now - self._last_draw < 0.1:
                return
        elif decile == self._last_decile and step < self.total:
            return
        self._last_decile, self._last_draw = decile, now
        self.stream.write(("\r" if self._tty else "") + self.line(step, loss, now)
                          + ("" if self._tty and step < self.total else "\n"))
        self.stream.flush()

    def line(self, step: int, loss: float, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        frac = min(step / self.total, 1.0)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        eta = elapsed / max(step, 1) * (self.total - step)
        line = (f"{self.label} [{bar}] {step}/{self.total} loss {loss:.4f} "
                f"{self.tokens / elapsed:,.0f} tok/s ETA {_fmt_time(eta)}")
        if self.overall is not None:
            line += f" | all {self.overall.runs} runs ETA {_fmt_time(self.overall.eta(now))}"
        return line

    def close(self, note: str = "") -> None:
        if self.enabled and self._tty:
            self.stream.write("\n" if not note else f"  {note}\n")
            self.stream.flush()


class Overall:
    """Progress across the several trainings of one experiment (heads trains 15 models):
    `next_label()` numbers them k/N and every progress line adds the ETA of them all,
    estimated from the steps done so far."""

    def __init__(self, runs: int, steps: int):
        self.runs = max(1, int(runs))
        self.total = max(1, int(steps))
        self.done = 0
        self.k = 0
        self.start = time.perf_counter()

    def next_label(self, label: str) -> str:
        self.k += 1
        return f"[{self.k}/{self.runs}] {label}"

    def eta(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        return (now - self.start) / max(self.done, 1) * max(self.total - self.done, 0)


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds // 3600}h{seconds // 60 % 60:02d}"
