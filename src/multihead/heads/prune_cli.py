"""`multihead heads prune`: remove heads physically from a copy of a model and save it.

The heads are given as layer.head pairs (--remove) or as a by-importance point of a
`heads importance --prune-curve` run (--curve FILE --at UNIT:FRACTION); the pruned copy is
saved with save_pretrained into a new folder, written whole or not at all, never the
model's own. See docs/heads.md.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from multihead.cli_args import add_json, add_model, add_out, add_threads
from multihead.errors import UsageError


def add_prune_arguments(subparsers) -> argparse.ArgumentParser:
    """Add the `prune` subcommand to `multihead heads`' subparsers; returns its parser."""
    p = subparsers.add_parser("prune", help="remove heads and save the model",
                       allow_abbrev=False,
                       description="Remove heads physically from a copy of the model and save_pretrained it "
                                   "(transformers models whose config carries head_dim, with the same head count "
                                   "left in every layer). The model's own folder is never written; --out must be "
                                   "new or empty unless --force.")
    add_model(p, "minilm")
    p.add_argument("--remove", metavar="LIST",
                   help="heads to remove as layer.head, comma-separated, e.g. 0.1,0.5,1.1,1.5")
    p.add_argument("--curve", metavar="FILE", help="instead of --remove: a results.json of `heads importance "
                                                  "--prune-curve` on this model, with --at")
    p.add_argument("--at", metavar="UNIT:FRACTION", help="with --curve: the by-importance point to prune, e.g. "
                                                         "groups:0.3 or heads:0.5")
    p.add_argument("--pad", action="store_true",
                   help="lay every layer out as the widest, with inert (all-zero) heads, so that a transformers "
                        "config's one head count holds any removal (implied by --curve)")
    add_out(p, "a new (or empty) folder to save the pruned model in", required=True)
    p.add_argument("--force", action="store_true",
                   help="replace --out when it already holds files (never the model's own folder)")
    add_json(p, help="print the result as JSON (heads removed, head counts, parameters, --out) instead of a line")
    add_threads(p)
    return p


def _pairs(value: str) -> list[tuple[int, int]]:
    out = []
    for item in value.split(","):
        layer, dot, head = item.strip().partition(".")
        try:
            if not dot:
                raise ValueError
            out.append((int(layer), int(head)))
        except ValueError:
            raise UsageError(f"--remove takes layer.head pairs, comma-separated, e.g. --remove 0.1,2.3; received "
                             f"{value!r} ({item.strip()!r} is not layer.head)") from None
    return out


def _prune_target(args) -> tuple[Path, Path]:
    """(--out resolved, the model's own folder), refused before any load when --out is the
    model's folder, inside it or above it, a file, or a folder that holds files (without --force)."""
    from multihead.files import check_out_apart
    from multihead.interop.loaders import resolve_model

    _, source, _, _ = resolve_model(args.model)
    out, source_dir = check_out_apart("--out", args.out, source, tool="prune")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out!r} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"--out {args.out!r} exists and is not empty ({len(list(out.iterdir()))} entries); give a "
                         "new folder, or --force to replace it")
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out!r}: the folder {str(out.parent)!r} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {args.out!r}: cannot write in the folder {str(out.parent)!r} (permission denied)")
    return out, source_dir


def _save_atomically(out: Path, save) -> None:
    """`save(folder)` into a new folder beside `out`, then renamed over it: a reader, a crash or
    Ctrl-C sees the old folder or the whole new one, never a half-written model."""
    import shutil
    import tempfile

    from multihead.files import usual_mode

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    old = None
    try:
        save(tmp)
        os.chmod(tmp, usual_mode(folder=True))
        for f in tmp.rglob("*"):  # transformers writes model.safetensors 0600 (a temporary file renamed)
            if f.is_file():
                os.chmod(f, usual_mode())
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.rename(out, old / "replaced")
        os.rename(tmp, out)
    except BaseException:
        if old is not None and not out.exists() and (old / "replaced").exists():
            os.rename(old / "replaced", out)  # put the user's folder back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _curve_point(args) -> list[tuple[int, int]]:
    """The heads of `--curve FILE --at UNIT:FRACTION` (a by-importance point of the curve)."""
    if args.remove:
        raise UsageError("give --remove or --curve with --at, not both")
    if not args.at:
        raise UsageError("--curve needs --at UNIT:FRACTION, e.g. --at groups:0.3")
    unit, _, frac = args.at.partition(":")
    try:
        r = json.loads(Path(args.curve).read_text(encoding="utf-8"))
        curves = r["curves"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--curve {args.curve!r}: not a results.json of `heads importance --prune-curve` on a "
                         f"grouped-query decoder ({type(err).__name__}: {err})") from None
    try:
        f = float(frac)
    except ValueError:
        f = None
    points = {p["fraction"]: p for p in curves.get(unit, {}).get("importance", [])}
    if unit not in curves or f not in points:
        valid = ", ".join(f"{u}:{p['fraction']:g}" for u in curves for p in curves[u]["importance"])
        raise UsageError(f"--at {args.at!r} is not a point of {args.curve}; valid: {valid}")
    return [tuple(p) for p in points[f]["removed"]]


def _prune(args) -> dict:
    from multihead import heads

    if args.curve:
        pairs, pad = _curve_point(args), True
    elif args.remove:
        pairs, pad = _pairs(args.remove), args.pad
    else:
        raise UsageError("give the heads to remove: --remove layer.head,... or --curve FILE --at UNIT:FRACTION")
    if args.at and not args.curve:
        raise UsageError("--at picks a point of --curve FILE; give --curve too")
    out, _ = _prune_target(args)
    # a copy of its own: the session's cached model (another run, another tool) stays whole
    from multihead.interop.loaders import load_model

    loaded = load_model(args.model, fresh=True)
    model = loaded.model
    if not hasattr(model, "save_pretrained"):
        raise UsageError("prune --out saves transformers models; a lab checkpoint's heads can be pruned in Python "
                         "with multihead.heads.prune(model, heads)")
    before = sum(p.numel() for p in model.parameters())
    heads.prune(model, pairs, pad=pad)

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    _save_atomically(out, save)
    cfg = model.config
    return {"model": getattr(loaded, "name", args.model), "removed": [list(p) for p in pairs], "out": str(out),
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "params_before": before, "params": sum(p.numel() for p in model.parameters())}


def run_prune(args) -> int:
    """Run `multihead heads prune` from parsed arguments; 0 on success (mistakes raise UsageError)."""
    r = _prune(args)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"removed {len(r['removed'])} heads; saved to {r['out']} ({r['num_attention_heads']} query / "
          f"{r['num_key_value_heads']} key-value heads per layer; {r['params']:,} parameters, "
          f"{r['params_before']:,} before)")
    return 0
