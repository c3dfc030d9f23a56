"""A lock file for a lab run's output folder, so two runs never write one folder at once:
created with O_EXCL and holding its owner's pid, taken over when that process is gone."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from multihead.files import usual_mode

__all__ = ["LockHeld", "pid_lock"]


class LockHeld(Exception):
    """`pid_lock` found the lock held by a live process (`pid`)."""

    def __init__(self, path: Path, pid: int):
        super().__init__(f"{path} is held by process {pid}")
        self.path, self.pid = path, pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _lock_owner(path: Path) -> int | None:
    """The pid in a lock file; None when there is none (a lock being written is waited for
    a moment: the owner writes its pid right after creating the file)."""
    import time

    for _ in range(20):
        try:
            text = path.read_text(encoding="ascii", errors="replace").strip()
        except FileNotFoundError:
            return None
        if text:
            return int(text) if text.isdigit() else None
        time.sleep(0.05)
    return None


@contextlib.contextmanager
def pid_lock(path: str | os.PathLike) -> Iterator[Path]:
    """Hold a lock file at `path` for the block: created with O_EXCL, holding this pid, removed
    at the end (error and Ctrl-C included). A lock whose process is gone (killed, crashed) is
    stale and taken over; one held by a live process raises `LockHeld`."""
    path = Path(path)
    for _ in range(3):  # a stale lock is removed, then created again (another taker may win)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, usual_mode())
        except FileExistsError:
            owner = _lock_owner(path)
            if owner is not None and owner != os.getpid() and _alive(owner):
                raise LockHeld(path, owner) from None
            if _lock_owner(path) == owner:  # still the stale one: take it over
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            continue
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{os.getpid()}\n")
        break
    else:
        owner = _lock_owner(path)
        raise LockHeld(path, owner if owner is not None else -1)
    try:
        yield path
    finally:
        if _lock_owner(path) == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
