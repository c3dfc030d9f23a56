"""What machine a benchmark ran on: CPU model (lscpu), cores, torch threads, memory, versions."""

from __future__ import annotations

import os
import platform
import subprocess

import torch


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.SubprocessError):
        pass
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "mem_total_bytes": mem_total, "torch": torch.__version__, "python": platform.python_version()}
