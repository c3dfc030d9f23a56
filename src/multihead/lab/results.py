"""The results.json every lab experiment writes: its skeleton, its atomic write and the
schema it is checked against.

One JSON object (experiment, versions, date, machine, device, seed, config, results,
plots, checkpoint, diverged, notes), replaced in one `os.replace`: a reader sees the old
file or the new one, never half of one.

Details: docs/lab.md, "results.json: the keys and the write".
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from multihead.errors import UsageError
from multihead.files import write_text
from multihead.lab.devices import load_average, machine_info, resolve_device
from multihead.lab.lock import LockHeld, pid_lock

__all__ = ["ResultsSchemaError", "check_results", "finished_runs", "lock_out", "new_results", "start_run",
           "write_json_atomic"]


def new_results(experiment: str, config, seed: int, device: torch.device | str) -> dict:
    """The results skeleton: provenance and config first, numbers filled in by the experiment."""
    import multihead

    cfg = asdict(config) if is_dataclass(config) else dict(config)
    return {
        "experiment": experiment,
        "multihead_version": multihead.__version__,
        "torch_version": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_info(device),
        "device": str(torch.device(device)),
        "seed": int(seed),
        "config": _jsonable(cfg),
        "interrupted": False,
        "elapsed_s": 0.0,
        "results": {},
        "plots": [],
        "checkpoint": None,
        "diverged": [],
        "notes": [],
    }


def start_run(experiment: str, config, out_dir: str | os.PathLike, seed: int,
              device: str) -> tuple[torch.device, Path, dict, float]:
    """What every experiment does first: (the device `device` resolves to, `out_dir` made,
    the results skeleton, the `time.perf_counter()` its elapsed_s is counted from)."""
    dev = resolve_device(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return dev, out, new_results(experiment, config, seed, dev), time.perf_counter()


@contextlib.contextmanager
def lock_out(out: str | os.PathLike):
    """One lab run per output folder at a time: hold `.<name>.lock` beside `out` (a file
    with this process's pid, made with O_EXCL) for the block, from before `out` is checked
    until the run is written. Two runs started together on one new folder both found it
    empty and both wrote it, one run's results silently lost; the second now stops at once
    (UsageError: one line, exit 2). A lock left by a killed run is taken over."""
    out = Path(out).absolute()
    held = contextlib.ExitStack()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        held.enter_context(pid_lock(out.parent / f".{out.name}.lock"))
    except LockHeld as e:
        raise UsageError(f"--out {out} is in use by another multihead lab run (pid {e.pid}, lock {e.path}); "
                         f"wait for it to finish, or give another --out") from None
    except OSError:  # a parent that is a file, or not writable: the --out checks name it
        pass
    with held:
        yield


def finished_runs(runs: list[dict]) -> list[dict]:
    """The runs that trained to the end: neither interrupted nor diverged."""
    return [r for r in runs if not r["interrupted"] and r.get("diverged_at") is None]


def write_json_atomic(path: str | os.PathLike, obj) -> Path:
    """Write JSON to `path` through a temporary file in the same folder and os.replace.

    A crash or Ctrl-C mid-write leaves the previous file (or none), never a torn one. A
    results object (its "machine" from `machine_info`) gets the load average of this write as
    machine["loadavg_end"]: a run writes its results last when it ends.
    """
    machine = obj.get("machine") if isinstance(obj, dict) else None
    if isinstance(machine, dict) and "loadavg_start" in machine:
        machine["loadavg_end"] = load_average()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n")


def _jsonable(obj):
    """Plain JSON types; non-finite floats become None (JSON has no NaN)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return _jsonable(obj.item())
    if isinstance(obj, Path):
        return str(obj)
    if is_dataclass(obj):
        return _jsonable(asdict(obj))
    if hasattr(obj, "item"):  # numpy scalars
        return _jsonable(obj.item())
    raise TypeError(f"cannot write {type(obj).__name__} to results.json: {obj!r}")


class ResultsSchemaError(ValueError):
    """A results.json that does not follow the documented schema."""


_TOP = {
    "experiment": str, "multihead_version": str, "torch_version": str, "date": str,
    "machine": dict, "device": str, "seed": int, "config": dict, "interrupted": bool,
    "elapsed_s": (int, float), "results": dict, "plots": list,
}
_OPTIONAL = {"diverged": list, "notes": list}  # absent from files written before they existed
_EXPERIMENTS = ("heads", "kv", "mla", "induction", "uptrain")


def check_results(obj: dict, folder: str | os.PathLike | None = None,
                  required: Iterable[str] = ()) -> dict:
    """Check a results object (or the results.json in `folder`) against the schema.

    Every top-level key of results.json (docs/lab.md) with its type; `results` holds the
    `required` keys; every number anywhere is finite; with `folder`, every plot and the
    checkpoint it names exist there. Returns the object; raises ResultsSchemaError.
    """
    if folder is not None and obj is None:
        obj = json.loads((Path(folder) / "results.json").read_text(encoding="utf-8"))
    if not isinstance(obj, dict):
        raise ResultsSchemaError(f"results must be a JSON object; received {type(obj).__name__}")
    for key, typ in _TOP.items():
        if key not in obj:
            raise ResultsSchemaError(f"results.json lacks {key!r}")
        if not isinstance(obj[key], typ) or (typ is int and isinstance(obj[key], bool)):
            raise ResultsSchemaError(f"results.json {key!r} should be {typ}; received {type(obj[key]).__name__}")
    for key, typ in _OPTIONAL.items():
        if key in obj and not isinstance(obj[key], typ):
            raise ResultsSchemaError(f"results.json {key!r} should be {typ}; received {type(obj[key]).__name__}")
    if obj["experiment"] not in _EXPERIMENTS:
        raise ResultsSchemaError(f"unknown experiment {obj['experiment']!r}; valid: {', '.join(_EXPERIMENTS)}")
    for key in required:
        if key not in obj["results"]:
            raise ResultsSchemaError(f"results.json 'results' lacks {key!r}")

    def walk(v, where):
        if isinstance(v, float) and not math.isfinite(v):
            raise ResultsSchemaError(f"non-finite number at {where}")
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{where}.{k}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{where}[{i}]")

    walk(obj, "$")
    if folder is not None:
        for name in obj["plots"]:
            if not (Path(folder) / name).is_file():
                raise ResultsSchemaError(f"plot {name!r} named in results.json is missing from {folder}")
        ckpt = obj.get("checkpoint")
        if ckpt and not (Path(folder) / ckpt / "config.json").is_file():
            raise ResultsSchemaError(f"checkpoint {ckpt!r} named in results.json is missing from {folder}")
    return obj
