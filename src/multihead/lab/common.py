"""What every lab experiment shares: devices and seeds, the training loop with its
progress bar, clean Ctrl-C and divergence check, the results file (written atomically,
checked by a small schema) and the matplotlib setup (optional: without matplotlib the
results and checkpoint are written and the plots skipped with a note).

A results file is one JSON object:

    {"experiment": "heads", "multihead_version": "0.1.0", "torch_version": "...",
     "date": "2025-...Z", "machine": {...}, "device": "cpu", "seed": 0,
     "config": {...every knob...}, "interrupted": false, "elapsed_s": 12.3,
     "results": {...every number...}, "plots": ["loss.png"], "checkpoint": "model/",
     "diverged": [{"run": "heads H=4 seed 0", "step": 2, "reason": "loss nan"}], "notes": [...]}

"diverged" lists the trainings whose loss (or gradient, or an evaluation) stopped being
a finite number, at the step it happened; they stop there and are left out of the
summaries. "notes" holds one-line remarks such as plots skipped for want of matplotlib.

It is replaced in one `os.replace`, so a reader sees the old file or the new one, never
half of one; an interrupted run writes what it finished with `"interrupted": true`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from multihead._files import atomic_path, write_text
from multihead.errors import UsageError

__all__ = [
    "Overall",
    "PlotsUnavailable",
    "Progress",
    "ResultsSchemaError",
    "StepCallback",
    "check_results",
    "draw_plots",
    "machine_info",
    "new_results",
    "resolve_device",
    "seed_everything",
    "train",
    "write_json_atomic",
]

# A hook called after every training step as callback(run_name, step, loss); the tests
# raise KeyboardInterrupt from it to simulate Ctrl-C at a chosen step.
StepCallback = Callable[[str, int, float], None]


# ---------------------------------------------------------------- device and seeds


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


# ---------------------------------------------------------------- progress and training


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


def train(
    model: torch.nn.Module,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    steps: int,
    *,
    lr: float,
    name: str = "",
    weight_decay: float = 0.0,
    warmup: int = 0,
    callback: StepCallback | None = None,
    evaluate: Callable[[int], dict] | None = None,
    eval_every: int = 0,
    progress: bool = True,
    log_every: int = 1,
    overall: Overall | None = None,
) -> dict:
    """Train `model` for `steps` AdamW steps on next-token cross-entropy.

    Args:
        batches: step -> (inputs (B, T) int, targets (B, T) int, loss mask (B, T) bool or
            None for every position).
        warmup: linear learning-rate warmup steps, then cosine decay to 10%.
        callback: called as callback(name, step, loss) after every step.
        evaluate: called as evaluate(step) at step 0, every `eval_every` steps and at the
            end; its dicts are collected in "evals".
        overall: progress across several trainings (k/N and the ETA of all).

    Returns:
        {"steps": [...], "loss": [...], "evals": [...], "steps_done": n,
         "interrupted": bool, "diverged_at": step or None, "diverged_loss": str or None,
         "seconds": s, "tokens_per_s": r}. Ctrl-C (KeyboardInterrupt, from the user or the
        callback) ends training after the last finished step and is reported, not raised.
        So does divergence: a loss, gradient norm or evaluation that is not a finite number
        (a learning rate far too high) stops training at that step, before the step is
        applied; "loss"/"evals" keep only the finite values before it.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if warmup and step < warmup:
            return lr * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    hist = {"steps": [], "loss": [], "evals": [], "steps_done": 0, "interrupted": False,
            "diverged_at": None, "diverged_loss": None}
    bar = Progress(steps, name, enabled=progress, overall=overall)

    def diverged(step: int, what: str) -> None:
        hist["diverged_at"], hist["diverged_loss"] = step, what
        bar.close(f"diverged at step {step}")
        if progress:
            print(f"{name}: training diverged at step {step} ({what})", file=sys.stderr, flush=True)

    start = time.perf_counter()
    tokens = 0
    model.train()
    step = 0
    try:
        if evaluate is not None:
            hist["evals"].append({"step": 0, **_eval(model, evaluate, 0)})
        for step in range(1, steps + 1):
            x, y, m = batches(step)
            for g in opt.param_groups:
                g["lr"] = lr_at(step - 1)
            logits = model(x)
            loss = _masked_ce(logits, y, m)
            value = float(loss.detach())
            if not math.isfinite(value):
                diverged(step, f"loss {value}")
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            if not math.isfinite(norm):
                diverged(step, f"gradient norm {norm}")
                break
            opt.step()
            tokens += x.numel()
            hist["steps_done"] = step
            if step % log_every == 0 or step == steps:
                hist["steps"].append(step)
                hist["loss"].append(value)
            bar.update(step, value, x.numel())
            if evaluate is not None and ((eval_every and step % eval_every == 0) or step == steps):
                result = _eval(model, evaluate, step)
                if not _all_finite(result):
                    diverged(step, "an evaluation that is not a finite number")
                    break
                hist["evals"].append({"step": step, **result})
            if callback is not None:
                callback(name, step, value)
        else:
            bar.close()
    except KeyboardInterrupt:
        hist["interrupted"] = True
        bar.close("interrupted")
    model.eval()
    hist["seconds"] = time.perf_counter() - start
    hist["tokens_per_s"] = tokens / max(hist["seconds"], 1e-9)
    return hist


def _eval(model: torch.nn.Module, evaluate: Callable[[int], dict], step: int) -> dict:
    was = model.training
    model.eval()
    with torch.no_grad():
        out = evaluate(step)
    model.train(was)
    return out


def _all_finite(obj) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(v) for v in obj)
    return True


def diverged_entry(run: str, hist: dict) -> dict | None:
    """The results' "diverged" entry of a training history, or None when it did not diverge."""
    if hist.get("diverged_at") is None:
        return None
    return {"run": run, "step": hist["diverged_at"], "reason": hist["diverged_loss"]}


def _masked_ce(logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
    if m is None:
        return loss.mean()
    m = m.flatten().to(loss.dtype)
    return (loss * m).sum() / m.sum().clamp_min(1)


# ---------------------------------------------------------------- results


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


def write_json_atomic(path: str | os.PathLike, obj) -> Path:
    """Write JSON to `path` through a temporary file in the same folder and os.replace.

    A crash or Ctrl-C mid-write leaves the previous file (or none), never a torn one.
    """
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
_EXPERIMENTS = ("heads", "kv", "mla", "induction")


def check_results(obj: dict, folder: str | os.PathLike | None = None,
                  required: Iterable[str] = ()) -> dict:
    """Check a results object (or the results.json in `folder`) against the schema.

    Every top-level key of the module docstring with its type; `results` holds the
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


# ---------------------------------------------------------------- plotting


class PlotsUnavailable(ImportError):
    """matplotlib cannot be imported: the plots are skipped, the numbers are kept."""


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (imported lazily)."""
    try:
        import matplotlib
    except ImportError as err:
        raise PlotsUnavailable("plots skipped: matplotlib is not installed (pip install matplotlib; in a multihead "
                               "checkout, pip install -e '.[lab]')") from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 110, "axes.grid": True, "grid.alpha": 0.3,
                         "axes.spines.top": False, "axes.spines.right": False, "font.size": 10})
    return plt


def save_figure(fig, path: Path) -> str:
    """Save (atomically, like results.json) and close; return the file name."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", bbox_inches="tight")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path.name


def draw_plots(res: dict, makers: Iterable[Callable[[], str]]) -> None:
    """Draw each plot (a function returning its file name) into res["plots"].

    Called after results.json and the checkpoint are written, so a missing matplotlib
    costs the plots only: they are skipped with one note in res["notes"] (which the
    command prints).
    """
    plots = []
    try:
        for make in makers:
            plots.append(make())
    except PlotsUnavailable as err:
        res.setdefault("notes", []).append(str(err))
    res["plots"] = plots
