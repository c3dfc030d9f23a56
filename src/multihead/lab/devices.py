"""Where and how reproducibly a lab experiment runs: the device (`--device auto|cpu|cuda`),
the seeds, and the description of the machine that results.json records."""

from __future__ import annotations

import os
import platform
import random

import torch

from multihead.errors import UsageError

__all__ = ["machine_info", "resolve_device", "seed_everything"]


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


def machine_info(device: torch.device | str = "cpu") -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info
