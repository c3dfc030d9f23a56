"""Writing and reading the files multihead makes and takes, safely.

Every file the library writes (results.json, checkpoints, HTML pages, PNGs) goes
through `atomic_path`: the content is written to a temporary file in the same folder and
moved over the target with one `os.replace`, so a reader, a crash or Ctrl-C sees the old
file or the new one, never a truncated or half-written one. A new file gets the mode a
plain `open()` would give it (0666 less the umask, usually 0644), not the owner-only
0600 of `tempfile.mkstemp` (or of safetensors); a replaced file keeps its own mode, as
`open(path, "w")` would leave it (a private 0600 page stays private).

`read_json` is the one way a user's JSON file (a Hugging Face config.json, a lab
checkpoint's config) is read: the bytes read are bounded (so `/dev/zero` is refused,
not read forever), and every way the file can be wrong (unreadable, not UTF-8, not JSON,
nested too deeply, a number too large to be a setting) is a ValueError that names the
file and, where there is one, the field.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from multihead.errors import UsageError

__all__ = ["MAX_JSON_BYTES", "atomic_path", "check_out_apart", "decode_utf8", "output_file", "read_json",
           "usual_mode", "writable_target", "write_bytes", "write_json", "write_text"]

MAX_JSON_BYTES = 16 * 2**20  # a config.json is a few KB; the largest tokenizer configs are a few MB
_MAX_DEPTH = 64  # configs nest a few levels; deeper is not a config (and would exhaust the stack)
_MAX_INT_DIGITS = 30  # 10**30: above any count, size or token id a config can hold


def usual_mode(folder: bool = False) -> int:
    """0666 less the process umask: the mode `open(path, "w")` gives a new file (0777 less
    the umask for a folder, as `mkdir` gives)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without an error, give it
    the usual mode and move it over `path` in one os.replace. On an error (or Ctrl-C) the
    temporary file is removed and `path` is left as it was.

    For writers that want a file name (matplotlib's savefig, safetensors' save_file):

        with atomic_path("plot.png") as tmp:
            fig.savefig(tmp, format="png")
    """
    path = writable_target(path)
    folder = path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _mode_for(path: Path) -> int:
    """The mode the replaced file had (a user's 0600 stays 0600), else the usual mode."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return usual_mode()


def writable_target(path: str | os.PathLike) -> Path:
    """The file an atomic write may replace: `path` with symlinks followed (the write goes to
    the link's target, as open() would), refused (ValueError) when something other than a
    regular file is there. An os.replace over /dev/null or a named pipe would put a plain
    file in its place."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file (a device, pipe or socket)"
        raise ValueError(f"{path} is {kind}; multihead writes only regular files and will not replace it")
    return path


def _input_folder(source: str | os.PathLike) -> tuple[Path, Path]:
    """(the input resolved, the folder a tool never writes in: the input's own, or the one
    holding the input file: a model's files belong together)."""
    src = Path(os.path.realpath(Path(source).expanduser()))
    return src, src.parent if src.is_file() else src


def output_file(flag: str, value: str | None, example: str, *, source: str | os.PathLike | None = None,
                taken: dict[Path, str] | None = None) -> Path | None:
    """A command-line output file (`--png`, `--html`), checked before any work is done: not a
    folder, device, pipe or socket, in a folder that exists and can be written, not a read-only
    file, not inside the folder of `source` (the model the command reads: writing there could
    replace its weights), not a file another flag of the same command writes (`taken`: resolved
    path -> flag, filled in here). None stays None. Errors are `UsageError`s naming the flag,
    with `example` as a valid value."""
    from multihead.errors import UsageError

    if value is None:
        return None
    path = Path(value).expanduser()
    resolved = Path(os.path.realpath(path))
    if source is not None:
        src, folder = _input_folder(source)
        if resolved == src or folder in resolved.parents:
            raise UsageError(f"{flag} {value!r} is inside the model's own folder {str(folder)!r}; multihead never "
                             f"writes there: give a path elsewhere, e.g. {flag} {example}")
    if taken is not None:
        if resolved in taken:
            raise UsageError(f"{flag} {value!r} is the file {taken[resolved]} writes too; give each its own file")
        taken[resolved] = flag
    if path.is_dir():
        raise UsageError(f"{flag} {value!r} is a folder; give a file name, e.g. {flag} {example}")
    if path.exists() and not resolved.is_file():
        raise UsageError(f"{flag} {value!r} is not a regular file (a device, pipe or socket); give a file name, "
                         f"e.g. {flag} {example}")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {value!r}: the folder {str(path.parent)!r} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {value!r}: cannot write in the folder {str(path.parent)!r} (permission denied)")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {value!r}: the file exists and is read-only")
    return path


def check_out_apart(flag: str, out: str | os.PathLike, source: str | os.PathLike, *, tool: str,
                    what: str = "the model", file_only: bool = False) -> tuple[Path, Path]:
    """(out, the input's folder), both resolved, after refusing an output folder that is the
    input's folder, inside it, or holds it: a tool that writes there could overwrite its
    input, and one that replaces the folder (`--force`) would delete it. `source` is a
    folder or a file (its folder is what is protected: a model's files belong together;
    with `file_only`, as for a text file, only the file, so --out may sit beside it).
    Errors are `UsageError`s naming `flag`, `tool` and `what` the input is."""
    from multihead.errors import UsageError

    resolved = Path(os.path.realpath(Path(out).expanduser()))
    src, folder = _input_folder(source)
    if file_only and src.is_file():
        if resolved == src or resolved in src.parents:
            raise UsageError(f"{flag} {str(out)!r} holds {what} {str(src)!r}; replacing it would delete {what}: "
                             "give another folder")
        return resolved, folder
    if resolved == folder or folder in resolved.parents:
        raise UsageError(f"{flag} {str(out)!r} is inside {what}'s own folder {str(folder)!r}; {tool} never "
                         "writes there: give another folder")
    if resolved in folder.parents:
        raise UsageError(f"{flag} {str(out)!r} holds {what}'s own folder {str(folder)!r}; replacing it would "
                         f"delete {what}: give another folder")
    return resolved, folder


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (see `atomic_path`), flushed to disk; return the path."""
    path = writable_target(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` as UTF-8, atomically. The text is encoded before the file is touched, so
    text that cannot be encoded (lone surrogates) raises UnicodeEncodeError and leaves an
    existing file as it was."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 2) -> Path:
    """Write `obj` as JSON (no NaN or Infinity, which JSON lacks), atomically."""
    return write_text(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


def read_json(path: str | os.PathLike, *, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES):
    """The parsed content of a user's JSON file; every failure is a ValueError naming it.

    Refused, with the file (and the field where there is one) in the message: a file that
    cannot be read (missing, a folder, no permission), one longer than `max_bytes` (only
    `max_bytes + 1` bytes are ever read, so a device like /dev/zero is refused at once),
    bytes that are not UTF-8, text that is not JSON, nesting deeper than 64 levels,
    NaN/Infinity, and integers of more than 30 digits (no setting is that large; such
    numbers only overflow later, far from the file).
    """
    label = os.fspath(path)
    try:
        data = read_at_most(path, max_bytes + 1)
    except IsADirectoryError:
        raise ValueError(f"{label} is a folder; expected a {what}") from None
    except OSError as err:
        raise ValueError(f"cannot read {what} {label}: {err.strerror or err}") from None
    if len(data) > max_bytes:
        raise ValueError(f"{label} is larger than {max_bytes // 2**20} MiB; a {what} is a few KB "
                         "(is it the right file?)")
    text = decode_utf8(data, label, f"a {what} is UTF-8 JSON", encoding="utf-8-sig")
    depth = _max_depth(text) if text.count("[") + text.count("{") > _MAX_DEPTH else 0
    if depth > _MAX_DEPTH:
        raise ValueError(f"{label} nests {depth} levels deep; a {what} nests a few (at most {_MAX_DEPTH})")

    def bad_constant(name: str):
        raise ValueError(f"{label}: {name} is not a valid JSON number (JSON has no NaN or Infinity)")

    try:
        obj = json.loads(text, parse_constant=bad_constant)
    except json.JSONDecodeError as err:
        raise ValueError(f"{label} is not JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
                         f"expected a {what}") from None
    except RecursionError:  # pragma: no cover - _max_depth refuses deep nesting first
        raise ValueError(f"{label} nests too deeply for a {what}") from None
    except ValueError as err:  # NaN/Infinity (named above), or an integer past Python's 4300 digits
        if str(err).startswith(label):
            raise
        raise ValueError(f"{label} is not a usable {what}: {str(err)[:120]}") from None
    _check_numbers(obj, label, "")
    return obj


def decode_utf8(data: bytes, label: str, valid: str, *, encoding: str = "utf-8") -> str:
    """`data` as text; bytes that are not UTF-8 raise a UsageError (a ValueError) that names
    `label`, the first bad byte and its offset, then says `valid`."""
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as err:
        raise UsageError(f"{label} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                         f"{valid}") from None


def read_at_most(path: str | os.PathLike, n: int) -> bytes:
    """The first n bytes of a user's file (all of it when shorter): never more is read, so a
    device like /dev/zero costs n bytes. OSError as open() raises it."""
    with open(path, "rb") as f:
        return _read_at_most(f, n)


def _read_at_most(f, n: int) -> bytes:
    """Up to n bytes: reads until EOF or n, since a device or pipe may return short reads."""
    chunks, size = [], 0
    while size < n:
        chunk = f.read(n - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _max_depth(text: str) -> int:
    """The deepest [ / { nesting of JSON text, not counting brackets inside strings."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > _MAX_DEPTH:  # enough to refuse; do not scan a huge file further
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _check_numbers(obj, label: str, where: str) -> None:
    """Refuse numbers no setting can hold, naming the field (`a.b[2]`)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_numbers(v, label, f"{where}.{k}" if where else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_numbers(v, label, f"{where}[{i}]")
    elif isinstance(obj, bool):
        return
    elif isinstance(obj, int):
        if len(str(abs(obj))) > _MAX_INT_DIGITS:
            raise ValueError(f"{label}: field {where or '(top level)'!r} is a {len(str(abs(obj)))}-digit number; "
                             f"no setting is that large (at most {_MAX_INT_DIGITS} digits)")
    elif isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"{label}: field {where or '(top level)'!r} is {obj} (a number too large for a float); "
                         "expected a finite number")
