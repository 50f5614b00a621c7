"""One owner per state directory: an exclusive, non-blocking `flock` on `<dir>/ctxfuse.lock`.

Two processes over one batch database (the gateway's data dir, the agent's outbox) would both run
or forward the same batches, so the second one must not start. The kernel drops the lock when its
holder dies, kill -9 included, so a crashed owner never blocks the next one. The file names its
holder (pid and role) so the refusal can say who holds it; the name is only a hint (read without
the lock), the lock itself is the truth.

flock locks belong to an open file, not to a process: a second lock_dir in the same process is
refused too.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import CtxfuseError

LOCK_NAME = "ctxfuse.lock"


@dataclass(frozen=True, slots=True)
class HeldBy:
    """The directory is locked by another owner; `holder` is what it wrote ("pid role"), if read."""

    directory: Path
    holder: str


class DirInUse(CtxfuseError):
    """Another process owns the directory (503 if it reaches a route)."""

    status = 503
    type = "server_error"

    def __init__(self, held: HeldBy, what: str) -> None:
        who = f"pid {held.holder}" if held.holder else "an unknown process"
        super().__init__(
            f"the {what} {held.directory} is in use by another process ({who}); two owners would run "
            f"its batches twice: stop that process or give this one another directory",
            code="dir_in_use",
        )
        self.held = held


class DirLock:
    """A held lock; `release` (or the process ending) gives it up."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops its flock
            self._fd = None


def lock_dir(directory: Path, role: str) -> DirLock | HeldBy:
    """Take `directory`'s lock for this process, or say who holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return HeldBy(directory, _holder(path))
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {role}\n".encode())
    return DirLock(fd, path)


def _holder(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
