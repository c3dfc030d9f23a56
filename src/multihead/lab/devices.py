"""Where and how reproducibly a lab experiment runs: the device (`--device auto|cpu|cuda`),
the seeds, and the description of the machine that results.json records."""

from __future__ import annotations

import os
import platform
import random

import torch

from multihead.errors import UsageError

__all__ = ["load_average", "machine_info", "resolve_device", "seed_everything"]


def resolve_device(name: str | None) -> torch.device:
    """'auto' (or None) -> cuda when present, else cpu; 'cpu' / 'cuda' as asked."""
    name = "auto" if name is None else str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked but torch sees no CUDA device; valid here: cpu, auto")
    if name not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {name!r}; valid: auto, cpu, cuda")
    return torch.device(name)


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, torch (and CUDA); return a CPU generator for the data."""
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _cpu_model() -> str:
    """The CPU's model name as Linux reports it (/proc/cpuinfo), else what platform says."""
    from multihead.kernels.machine import cpu_fields

    return cpu_fields("model name").get("model name") or platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, None where the OS has none."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(device: torch.device | str = "cpu") -> dict:
    """What results.json says of the machine: the CPU model, its cores, the L2 and L3 of cpu0
    (as the kernels read them), torch's threads and the load average at the start;
    `results.write_json_atomic` adds the load at each write, so the last one is the run's end."""
    from multihead.kernels.machine import read_caches

    caches = read_caches()
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "l2_bytes": caches[0] if caches else None,
        "l3_bytes": caches[1] if caches else None,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": load_average(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info
