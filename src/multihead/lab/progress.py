"""The lab's plain-text progress bar: one line per training (steps, loss, tokens/s, ETA),
and the count and ETA across the several trainings of one experiment (`Overall`).

The ETA is honest rather than early: no estimate until a few warm-up steps are done (the
first step pays for start-up, and an evaluation before step 1 had made the first ETA of
`lab induction` read 6h39 for a 9-minute run) and as many again are measured, then the
remaining steps times the average time per step since the warm-up, which counts the
periodic evaluations in the proportion they occur. When the rate is first known, one
line says the expected total.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["Overall", "Progress", "RateEstimate"]


def warmup_steps(total: int) -> int:
    """Steps left out of the rate: 2 to 20, about 5% of the total."""
    return max(2, min(20, total // 20))


class RateEstimate:
    """Seconds per step, measured from the end of a warm-up: (t - t_w) / (step - step_w)."""

    def __init__(self, total: int):
        self.total = max(1, int(total))
        self.warm = warmup_steps(self.total)
        self.anchor: tuple[int, float] | None = None  # (step, time) at the end of the warm-up

    def observe(self, step: int, now: float) -> None:
        if self.anchor is None and step >= min(self.warm, self.total - 1):
            self.anchor = (step, now)

    def seconds_per_step(self, step: int, now: float) -> float | None:
        """None while warming up, and until as many steps again are measured after it: the
        first interval after the warm-up can hold an evaluation (lab induction evaluates
        every 20 steps), and one interval alone would price every step like it."""
        if self.anchor is None or step - self.anchor[0] < min(self.warm, self.total - self.anchor[0]):
            return None
        return (now - self.anchor[1]) / (step - self.anchor[0])

    def eta(self, step: int, now: float) -> float | None:
        if step >= self.total:
            return 0.0
        rate = self.seconds_per_step(step, now)
        return None if rate is None else rate * (self.total - step)


class Progress:
    """A plain-text progress bar on stderr: steps, loss, tokens/s and ETA.

    On a terminal it redraws one line; otherwise (logs, CI, tests) it prints a line about
    every 10% so that logs stay short. `enabled=False` silences it. `clock` is for tests.
    """

    def __init__(self, total: int, label: str = "", *, stream=None, enabled: bool = True, width: int = 24,
                 overall: Overall | None = None, clock: Callable[[], float] = time.perf_counter):
        self.total = max(1, int(total))
        self.overall = overall
        self._base = overall.done if overall is not None else 0
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.width = width
        self.clock = clock
        self.start = clock()
        self.tokens = 0
        self.rate = RateEstimate(self.total)
        self.expected_s: float | None = None  # the total time, once the rate is known
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1
        self._last_draw = 0.0

    def update(self, step: int, loss: float, tokens: int = 0) -> None:
        """Report that `step` steps (of `total`) are done, the last loss, and tokens seen."""
        self.tokens += tokens
        now = self.clock()
        self.rate.observe(step, now)
        if self.overall is not None:
            self.overall.done = self._base + step
            self.overall.observe(now)
        announce = False
        if self.expected_s is None and step < self.total:
            eta = self.rate.eta(step, now)
            if eta is not None:
                self.expected_s = (now - self.start) + eta
                announce = True
        if not self.enabled:
            return
        if announce and self.overall is not None:
            # several runs: one line for them all, once (a line per run was noise)
            announce = not self.overall.announced
            if announce:
                self.overall.announced = True
                every = (now - self.overall.start) + (self.overall.eta(now) or 0.0)
                every = max(every, (now - self.overall.start) + self.expected_s - (now - self.start)
                            + (self.overall.total - self.overall.done - (self.total - step))
                            * self.rate.seconds_per_step(step, now))
                self._write_line(f"all {self.overall.runs} runs: expected about {_fmt_time(every)} in all "
                                 f"({self.rate.seconds_per_step(step, now):.3g} s/step in the first run after "
                                 f"{self.rate.anchor[0]} warm-up steps)", now, newline=True)
        elif announce:
            self._write_line(f"{self.label}: expected about {_fmt_time(self.expected_s)} in all "
                             f"({self.rate.seconds_per_step(step, now):.3g} s/step after "
                             f"{self.rate.anchor[0]} warm-up steps)", now, newline=True)
        decile = 10 * step // self.total
        if self._tty:
            if step < self.total and now - self._last_draw < 0.1 and not announce:
                return
        elif decile == self._last_decile and step < self.total:
            return
        self._last_decile, self._last_draw = decile, now
        self._write_line(self.line(step, loss, now), now, newline=not self._tty or step >= self.total)

    def _write_line(self, text: str, now: float, newline: bool) -> None:
        self.stream.write(("\r\033[K" if self._tty else "") + text + ("\n" if newline else ""))
        self.stream.flush()

    def line(self, step: int, loss: float, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        frac = min(step / self.total, 1.0)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        eta = self.rate.eta(step, now)
        line = (f"{self.label} [{bar}] {step}/{self.total} loss {loss:.4f} "
                f"{self.tokens / elapsed:,.0f} tok/s ETA {_fmt_eta(eta)}")
        if self.overall is not None:
            every = self.overall.eta(now)
            if every is not None and eta is not None:
                # the runs so far may have been faster (fewer heads): never less than this run's
                every = max(every, eta + self.overall.rate.seconds_per_step(self.overall.done, now)
                            * max(self.overall.total - self.overall.done - (self.total - step), 0))
            line += f" | all {self.overall.runs} runs ETA {_fmt_eta(every)}"
        return line

    def close(self, note: str = "") -> None:
        if self.enabled and self._tty:
            self.stream.write("\n" if not note else f"  {note}\n")
            self.stream.flush()


class Overall:
    """Progress across the several trainings of one experiment (heads trains 15 models):
    `next_label()` numbers them k/N and every progress line adds the ETA of them all,
    from the rate since a warm-up of the first run (model building and evaluations between
    runs are counted in the proportion they occur)."""

    def __init__(self, runs: int, steps: int, clock: Callable[[], float] = time.perf_counter):
        self.runs = max(1, int(runs))
        self.total = max(1, int(steps))
        self.done = 0
        self.k = 0
        self.clock = clock
        self.start = clock()
        self.rate = RateEstimate(self.total)
        self.rate.warm = warmup_steps(self.total // self.runs)
        self.announced = False  # the expected total of all runs is said once

    def next_label(self, label: str) -> str:
        self.k += 1
        return f"[{self.k}/{self.runs}] {label}"

    def observe(self, now: float | None = None) -> None:
        self.rate.observe(self.done, self.clock() if now is None else now)

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left for every run (None while warming up)."""
        return self.rate.eta(self.done, self.clock() if now is None else now)


def _fmt_eta(seconds: float | None) -> str:
    return "(measuring)" if seconds is None else _fmt_time(seconds)


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds // 3600}h{seconds // 60 % 60:02d}"
