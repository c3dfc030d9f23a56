"""What the CPU kernels choose from the machine they run on: one frozen `MachinePlan` per
process, derived from the cache sizes the OS reports (Linux sysfs), visible as
`machine_plan()` and replaced by `set_machine_plan` (a plan, or None: read the OS again).
What neither the caches nor a constant decide (which engine runs a decode step, or a call
under a sliding window) is measured once per process, on the first call that needs it, and
kept beside the plan (`measured_choices()`; a plan's field fixes it instead).

A choice that follows the caches is a rule over their sizes, written so that a core with a
2 MiB L2 (a Xeon's since Sapphire Rapids, the kind of machine the constants were measured
on) gets exactly the constant tuned there, and another machine the rule's value. What does
not follow them (the tile cost model's rates, the explicit engine's tile edge, measured
best on a 1 MiB L2 as on a 2 MiB one) is a field with its measured default, so that it is
visible and can be replaced too.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from multihead.checks import check_positive_int

__all__ = ["FASTEST_MARGIN", "FASTEST_ROUNDS", "MachinePlan", "cpu_fields", "fastest", "machine_plan",
           "measured_choices", "read_caches", "recalled", "remember", "set_machine_plan"]

CACHE_ROOT = Path("/sys/devices/system/cpu/cpu0/cache")
# what a machine whose caches cannot be read is taken to have: the caches the constants were tuned
# on, so that such a machine keeps today's choices
DEFAULT_L2 = 2 << 20
DEFAULT_L3 = 32 << 20


@dataclass(frozen=True)
class MachinePlan:
    """The machine-dependent choices of the CPU kernels, and the cache sizes they come from.

    l2_bytes, l3_bytes: one instance of the L2 and L3 that cpu0 uses, as the OS reports it
    (not divided among the CPUs that share it: a kernel thread sees the whole cache);
    source: "sysfs", "default" (nothing readable) or "set" (given to `set_machine_plan`).
    The derived choices are properties, so that they never disagree with the sizes;
    `with_choices` fixes one (kept in `overrides`) or replaces a field.
    """

    l2_bytes: int = DEFAULT_L2
    l3_bytes: int = DEFAULT_L3
    source: str = "default"
    # the tile cost model (`planner._least_cost`): per-thread flop rate and per-call seconds, fitted
    # together at D = 64; a rate, not a cache size, so no rule over the caches gives it
    flops_per_thread: float = 20e9
    call_seconds: float = 5e-4
    # the explicit tile engine's tile edge (`explicit_tiles`): 256 was the fastest for softcap at
    # length on the 2 MiB L2 and on a 1 MiB L2 too (128 and 512 slower on both), so no cache rule:
    # a tile's Python and dispatch, not its (t, t) temporaries' cache, is what the edge trades
    explicit_tile: int = 256
    # the engine of a plain decode step on the CPU (`decode.step`): "flash" (torch's fused kernel,
    # split over the threads), "gemm" (two batched GEMMs, the keys the tall operand; a step whose K/V
    # stream from beyond the L2 only) or "native" (multihead's own C kernel, `kernels.native`,
    # float32); None: timed on the first such step of each dtype, thread count, query rows, head
    # width and side of the L2, and kept for the process. Which wins is the BLAS's, the compiler's
    # and the core's, not the caches': measured
    decode_engine: str | None = None
    # the engine of a call under a relative mask (causal, sliding windows) in float32 with nothing
    # requiring grad (`kernels.band`): "fused" (torch's flash kernel over the kept rectangles,
    # `fused_tiles`) or "native" (multihead's own C kernel); None: timed on the first such call of
    # each dtype, thread count, head width, group size and band width, and kept for the process
    band_engine: str | None = None
    overrides: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        for name in ("l2_bytes", "l3_bytes", "explicit_tile"):
            check_positive_int(f"MachinePlan.{name}", getattr(self, name))
        for name, value in self.overrides:
            if name not in _CHOICES:
                raise ValueError(f"MachinePlan override {name!r} is not a choice; valid: {', '.join(_CHOICES)}")
            check_positive_int(f"MachinePlan override {name}", value)
        if self.decode_engine not in DECODE_ENGINES:
            raise ValueError(f"MachinePlan.decode_engine must be one of {', '.join(map(repr, DECODE_ENGINES))}; "
                             f"received {self.decode_engine!r}")
        if self.band_engine not in BAND_ENGINES:
            raise ValueError(f"MachinePlan.band_engine must be one of {', '.join(map(repr, BAND_ENGINES))}; "
                             f"received {self.band_engine!r}")

    @functools.cached_property  # read by every decode step: computed once per plan (a frozen one)
    def min_split_bytes(self) -> int:
        """K and V bytes of one K/V head from which a decode step splits its keys over the
        threads (`decode.key_splits`): one core's L2. Below it a head's K/V stays in the L2
        from step to step, the step is short and the split's merge (a few small ops, a fixed
        cost) takes more than the idle thread saves; above it the step streams K/V from L3 or
        memory and the saving grows with the bytes. On a 2 MiB L2: 2 MiB, twice the crossover
        measured there (benchmarks/decode_split.py)."""
        return self._chosen("min_split_bytes", self.l2_bytes)

    def _chosen(self, name: str, derived: int) -> int:
        for n, value in self.overrides:
            if n == name:
                return value
        return derived

    def with_choices(self, **choices) -> MachinePlan:
        """This plan with some choices fixed: a derived one (`min_split_bytes=`) or a field
        (`explicit_tile=`, `flops_per_thread=`, `call_seconds=`, `decode_engine=`, `band_engine=`)."""
        valid = (*_CHOICES, *_FIELDS)
        for name in choices:
            if name not in valid:
                raise ValueError(f"MachinePlan choice {name!r} is not one; valid: {', '.join(valid)}")
        derived = {n: v for n, v in choices.items() if n in _CHOICES}
        kept = tuple((n, v) for n, v in self.overrides if n not in derived)
        fields = {n: v for n, v in choices.items() if n in _FIELDS}
        return dataclasses.replace(self, **fields, overrides=kept + tuple(sorted(derived.items())), source="set")

    def as_dict(self) -> dict:
        """The sizes, the rates and every choice, for a benchmark's JSON."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "overrides"}
        d.update({name: getattr(self, name) for name in _CHOICES})
        d["overridden"] = [n for n, _ in self.overrides]
        d["measured"] = measured_choices()
        return d


_CHOICES = ("min_split_bytes",)  # derived from the caches (properties)
_FIELDS = ("explicit_tile", "flops_per_thread", "call_seconds", "decode_engine", "band_engine")  # with their defaults
DECODE_ENGINES = (None, "flash", "gemm", "native")
BAND_ENGINES = (None, "fused", "native")


def _size(text: str) -> int:
    """sysfs's cache size ("1024K", "32M", "512") in bytes."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def cpu_fields(*names: str) -> dict[str, str]:
    """The first value of each field of Linux's /proc/cpuinfo named here ("model name",
    "flags"), by name; a field it lacks is left out, and nothing where it cannot be read."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                name, sep, value = line.partition(":")
                name = name.strip()
                if sep and name in names and name not in found:
                    found[name] = value.strip()
                    if len(found) == len(names):
                        break
    except OSError:
        pass
    return found


def read_caches(root: str | os.PathLike | None = None) -> tuple[int, int] | None:
    """(L2 bytes, L3 bytes) of cpu0 from `root` (default `CACHE_ROOT`, sysfs's cpu0/cache: index*/level, type,
    size), None where no L2 is there (not Linux, a container hiding sysfs). A machine with no
    L3 (some ARM cores) reports its L2 as its last level too."""
    found: dict[int, int] = {}
    try:
        for index in sorted(Path(CACHE_ROOT if root is None else root).glob("index*")):
            try:
                level = int((index / "level").read_text())
                kind = (index / "type").read_text().strip()
                size = _size((index / "size").read_text())
            except (OSError, ValueError):
                continue
            if kind in ("Unified", "Data") and level in (2, 3):
                found[level] = max(found.get(level, 0), size)
    except OSError:
        return None
    if 2 not in found or found[2] <= 0:
        return None
    return found[2], found.get(3, found[2])


_LOCK = threading.Lock()
_PLAN: MachinePlan | None = None
_MEASURED: dict[str, dict[str, str]] = {}  # choice -> {the case it was timed on: what won}


def measured_choices() -> dict[str, dict[str, str]]:
    """What this process has timed so far: {choice: {case: winner}}, e.g. {"decode_engine":
    {"float32, 2 threads, 4 rows": "gemm"}} (a copy)."""
    with _LOCK:
        return {name: dict(cases) for name, cases in _MEASURED.items()}


def recalled(choice: str, case: str) -> str | None:
    """The winner kept for `case` of `choice`, or None where it was not timed yet."""
    return _MEASURED.get(choice, {}).get(case)


# how the engine choices time their candidates (`fastest`): rounds per engine, alternating (the
# first pays what a process's first call pays), and the share of the incumbent's time another
# must come under, so that a tie keeps the engine with torch's bits
FASTEST_ROUNDS = 3
FASTEST_MARGIN = 0.95


def fastest(runs: dict, incumbent: str, rounds: int = FASTEST_ROUNDS, margin: float = FASTEST_MARGIN) -> str:
    """The name of the fastest of `runs` ({name: a call of no arguments}), each timed `rounds`
    times in turn (the fastest run of each kept), where it beats `incumbent`'s time by
    1 - `margin`; else `incumbent`."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t)
    won = min(best, key=best.get)
    return won if won == incumbent or best[won] < margin * best[incumbent] else incumbent


def remember(choice: str, case: str, winner: str) -> None:
    """Keep what a timing found for the rest of the process (until `set_machine_plan`)."""
    with _LOCK:
        _MEASURED.setdefault(choice, {})[case] = winner


def machine_plan() -> MachinePlan:
    """The process's plan: read from the OS on the first call and kept (a decode step asks
    once per layer per token)."""
    plan = _PLAN
    if plan is not None:
        return plan
    return _read_plan()


def _read_plan() -> MachinePlan:
    global _PLAN
    with _LOCK:
        if _PLAN is None:
            caches = read_caches()
            _PLAN = MachinePlan() if caches is None else MachinePlan(caches[0], caches[1], "sysfs")
        return _PLAN


def set_machine_plan(plan: MachinePlan | None) -> MachinePlan | None:
    """Use `plan` from now on in this process (None: read the OS again at the next call), and
    forget what was timed (`measured_choices`): a new plan is timed afresh where it leaves a
    choice open. Returns the plan in use before, or None if none was read yet, to put back."""
    global _PLAN
    if plan is not None and not isinstance(plan, MachinePlan):
        raise TypeError(f"set_machine_plan takes a MachinePlan or None, got {type(plan).__name__}")
    with _LOCK:
        before, _PLAN = _PLAN, plan
        _MEASURED.clear()
    return before
