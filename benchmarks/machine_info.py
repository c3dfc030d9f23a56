"""What machine a benchmark ran on (CPU model from lscpu, cores, torch threads, memory,
versions), and how a benchmark writes its JSON (atomically, mode 0644)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

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


def write_json(path: str | os.PathLike, report: dict) -> Path:
    """`report` as indented JSON at `path`: a temporary file in the same folder, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(report, f, indent=1)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)
    return path
