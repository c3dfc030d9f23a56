"""What machine a benchmark ran on, and how a benchmark writes its JSON (atomically, mode 0644).

`machine()`: CPU model and vendor (lscpu), cores, the vector flags that matter to torch's CPU
kernels (avx2, avx512f, amx), the L2 and L3 sizes of cpu0 (sysfs, as the kernels read them),
the kernels' machine plan (`multihead.kernels.machine_plan`), torch's thread count, memory,
versions, and the load average twice: `loadavg_start` when this module was imported (a
benchmark imports it first) and `loadavg_end` when `machine()` is called; a benchmark calls
it when it writes its report, so that the two frame the run. `finish(report)` does that for
a report that took its `machine()` at the start. `plan_choices(**choices)`: a block run with
some of the kernel plan's choices fixed, the plan and what the process had timed kept."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

LOADAVG_START = os.getloadavg() if hasattr(os, "getloadavg") else None
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def _lscpu() -> dict:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def _caches() -> dict:
    try:
        from multihead.kernels.machine import machine_plan, read_caches
    except ImportError:  # run without src on the path: no plan to report
        return {}
    found = read_caches()
    return {"l2_bytes": found[0] if found else None, "l3_bytes": found[1] if found else None,
            "kernel_plan": machine_plan().as_dict()}


def machine() -> dict:
    info = _lscpu()
    model = info.get("Model name") or platform.processor() or platform.machine()
    flags = set(info.get("Flags", "").split())
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    end = os.getloadavg() if hasattr(os, "getloadavg") else None
    try:  # the kernel's transparent huge pages ("[madvise]": only where asked) and whether torch asks
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = None
    return {"cpu": model, "vendor": info.get("Vendor ID"), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "flags": [f for f in _FLAGS if f in flags], **_caches(), "lscpu_l2": info.get("L2 cache"),
            "lscpu_l3": info.get("L3 cache"), "mem_total_bytes": mem_total, "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_start": LOADAVG_START, "loadavg_end": end,
            "transparent_hugepage": thp, "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE")}


def finish(report: dict) -> dict:
    """`report` with its machine (at "machine", or "meta" when that holds the machine's keys)
    taken again now, so that its `loadavg_end` is the run's end; returns `report`."""
    if isinstance(report.get("machine"), dict):
        report["machine"].update(machine())  # keys a benchmark added (a library's version) stay
    elif isinstance(report.get("meta"), dict) and "cpu" in report["meta"]:
        report["meta"].update(machine())
    else:
        report["machine"] = machine()
    return report


def write_json(path: str | os.PathLike, report: dict) -> Path:
    """`report` as indented JSON at `path`: a temporary file in the same folder, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(report, f, indent=1)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)
    return path


def status_kib(field: str) -> int | None:
    """A `/proc/self/status` field in KiB (VmRSS, VmHWM), or None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the present resident size (Linux's clear_refs 5); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def plan_choices(**choices):
    """The kernels' machine plan with `choices` fixed (`MachinePlan.with_choices`: say
    `decode_engine="flash"`) for the block; then the plan as it was and the winners the
    process had timed, which setting a plan forgets (a benchmark's next public call would
    otherwise time its engines again, inside a timed round)."""
    from multihead.kernels import machine_plan, set_machine_plan
    from multihead.kernels.machine import measured_choices, remember

    timed = measured_choices()
    plan = set_machine_plan(machine_plan().with_choices(**choices))
    try:
        yield
    finally:
        set_machine_plan(plan)
        for choice, cases in timed.items():
            for case, winner in cases.items():
                remember(choice, case, winner)
