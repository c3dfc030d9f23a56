"""The CPU kernels multihead compiles itself: `decode_step.c` (the native decode engine,
`decode.native`), built on first use with the machine's C compiler for the machine's own
vector width, kept in a cache folder and loaded with ctypes. Optional: where there is no
compiler, the build fails or ``MULTIHEAD_NATIVE=0`` is set, `library()` is None, the
reason is in `unavailable()`, and the decode step keeps its torch engines.

The build: ``$CC`` (else ``cc``) ``-O3 -march=native -fno-math-errno -fopenmp -shared
-fPIC``. ``-fopenmp`` links ``libgomp.so.1``, the soname torch's own OpenMP runtime has, so
in a process where torch is loaded the kernel's parallel loop runs on torch's thread pool
(no second pool spinning against it) and follows `torch.set_num_threads`. The library's
name holds a hash of the source, the flags, the compiler (its path, size and time) and the
CPU's model and flags, so a changed machine or source builds anew; it is written to a temporary name and
renamed, so a process never loads half a file. The folder: ``$MULTIHEAD_CACHE/native``,
else ``$XDG_CACHE_HOME/multihead/native``, else ``~/.cache/multihead/native``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path

from multihead.kernels.machine import cpu_fields

__all__ = ["FLAGS", "HEADERS", "SOURCES", "band_rows", "build", "cache_dir", "declare", "library", "reset",
           "unavailable", "vector_width"]

SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode_step.c", "band.c"))
HEADERS = (Path(__file__).with_name("vec.h"),)  # what the sources include: part of the build's key
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
_BUILD_SECONDS = 120  # a build that has not finished by then is taken as failed

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_WHY: str | None = None  # why there is no library; None: not tried yet, or loaded
_TRIED = False
_WIDTH: int | None = None  # the loaded library's floats per vector, read once at load
_BAND_ROWS: int | None = None  # the query rows of its band kernel's block, read once at load


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    root = os.environ.get("MULTIHEAD_CACHE")
    if root:
        return Path(root) / "native"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "multihead" / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _cpu_identity() -> str:
    """The CPU's model and flags (what -march=native reads), where the OS says them."""
    return "\n".join(f"{name}: {value}" for name, value in cpu_fields("model name", "flags").items())


def _compiler_identity(cc: str) -> str:
    """The compiler's path, size and time (a changed compiler builds anew), read without
    running it: a process's first `library()` costs a few file reads, not a subprocess."""
    st = os.stat(os.path.realpath(cc))
    return f"{os.path.realpath(cc)} {st.st_size} {st.st_mtime_ns}"


def build(directory: str | os.PathLike | None = None, sources: str | os.PathLike | None = None) -> Path:
    """Compile `SOURCES` into one library in `directory` (default `cache_dir()`) unless the same build is
    there, and return the library's path. `sources`: a folder holding files of the same names
    to build instead (another revision's kernels, `benchmarks/native_ab.py`). Raises
    RuntimeError naming the compiler and its output where there is no compiler or it fails."""
    import hashlib  # (a build's modules, imported when one is asked for: `import multihead` stays light)
    import subprocess

    from multihead.files import atomic_path

    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler: {os.environ.get('CC') or 'cc'!r} is not on PATH (set CC to one)")
    given = [f if sources is None else Path(sources) / f.name for f in (*SOURCES, *HEADERS)]
    compiled = given[:len(SOURCES)]
    files = [f.read_bytes() for f in given]
    key = hashlib.sha256(b"\0".join([*files, " ".join(FLAGS).encode(), _compiler_identity(cc).encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]
    folder = Path(directory) if directory is not None else cache_dir()
    target = folder / f"native-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:  # another process sees the whole library or none
        try:
            done = subprocess.run([cc, *FLAGS, *map(str, compiled), "-o", str(tmp), "-lm"], capture_output=True,
                                  text=True, timeout=_BUILD_SECONDS)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{cc} took over {_BUILD_SECONDS} s to build {_names()}") from e
        if done.returncode != 0:
            raise RuntimeError(f"{cc} could not build {_names()} (exit {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return target


def _names() -> str:
    return " and ".join(f.name for f in SOURCES)


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on the first call of the process; None where it
    cannot be had (`unavailable()` says why). The second and later calls cost a global read."""
    if _LIB is not None or _TRIED:
        return _LIB
    return _load()


def _load() -> ctypes.CDLL | None:
    global _LIB, _WHY, _TRIED, _WIDTH, _BAND_ROWS
    with _LOCK:
        if _TRIED:
            return _LIB
        try:
            if os.environ.get("MULTIHEAD_NATIVE", "1").strip().lower() in ("0", "no", "false", "off"):
                raise RuntimeError("MULTIHEAD_NATIVE is set to turn it off")
            import torch  # noqa: F401  (torch's libgomp is loaded first, so the kernel binds to it)

            lib = declare(_open(build()))
            _LIB, _WHY, _WIDTH, _BAND_ROWS = lib, None, lib.mh_vector_width(), lib.mh_band_rows()
        except (OSError, RuntimeError) as e:
            _LIB, _WHY, _WIDTH, _BAND_ROWS = None, str(e), None, None
        _TRIED = True
        return _LIB


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with its entries' argument and result types set (what ctypes needs to pass
    strides as longs and the scale as a float)."""
    lib.mh_decode_step.restype = ctypes.c_int
    lib.mh_decode_step.argtypes = (
        [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long] * 3
        + [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int]
        + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_long])
    lib.mh_vector_width.restype = ctypes.c_int
    lib.mh_band.restype = ctypes.c_int
    lib.mh_band.argtypes = (
        [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long] * 3
        + [ctypes.c_int] * 3 + [ctypes.c_long] * 2 + [ctypes.c_int, ctypes.c_float]
        + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])
    lib.mh_band_rows.restype = ctypes.c_int
    lib.mh_bad_rows.restype = ctypes.c_int
    lib.mh_bad_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]
    return lib


def _open(path: Path) -> ctypes.CDLL:
    """The library at `path`; where the loader refuses the file (cut short or damaged outside
    the atomic write: a full disk, a copied cache folder), it is removed and built once more,
    and the second refusal is the one raised."""
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(build(path.parent)))


def vector_width() -> int | None:
    """The floats per vector the library was compiled for (16 with AVX-512, else 8): the head
    widths the decode engine takes are its multiples. None where there is no library."""
    return _WIDTH if library() is not None else None


def band_rows() -> int | None:
    """The query rows of the band kernel's block (4 vectors of rows): a call with fewer
    computes padded rows. None where there is no library."""
    return _BAND_ROWS if library() is not None else None


def unavailable() -> str | None:
    """Why `library()` is None (after it was asked), else None."""
    return _WHY


def reset() -> None:
    """Forget the loaded library, so that the next `library()` builds or loads again (tests
    that change ``MULTIHEAD_NATIVE`` or ``CC``). A library already loaded stays mapped."""
    global _LIB, _WHY, _TRIED, _WIDTH, _BAND_ROWS
    with _LOCK:
        _LIB, _WHY, _TRIED, _WIDTH, _BAND_ROWS = None, None, False, None, None
