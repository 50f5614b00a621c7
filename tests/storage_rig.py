"""Real small filesystems for the storage-fault tests: a tmpfs of a few MiB mounted by the test (root
only, as CI runs; skipped with the reason elsewhere), filled to the last byte by a ballast file whose
deletion gives the space back, and remounted read-only and back."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> str | None:
    """None when the mount command worked, else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


@contextmanager
def small_fs(path: Path, size_kib: int = 4096) -> Iterator[Path]:
    """A tmpfs of `size_kib` at `path` (made), unmounted after the block."""
    if os.geteuid() != 0:
        pytest.skip("a real small filesystem needs a tmpfs mounted by the test: run as root (CI does)")
    path.mkdir(parents=True, exist_ok=True)
    why = _mount("-t", "tmpfs", "-o", f"size={size_kib}k,mode=0755", "tmpfs", str(path))
    if why is not None:
        pytest.skip(f"cannot mount a tmpfs here ({why}); CI runs these as root with the capability")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def fill(path: Path, leave: int = 0) -> Path:
    """Fill the filesystem holding `path` until at most `leave` bytes are free (to the last page when
    0), with one ballast file; delete it (or call make_room) to give the space back."""
    ballast = path / f"ballast-{len(list(path.glob('ballast-*')))}"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for piece in (1 << 16, 4096, 1):
            while free_bytes(path) > leave:
                try:
                    os.write(fd, b"\0" * max(1, min(piece, free_bytes(path) - leave)))
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return ballast


def make_room(path: Path) -> None:
    """Give back all the space the ballast files took."""
    for ballast in path.glob("ballast-*"):
        ballast.unlink()


def remount(path: Path, mode: str) -> None:
    """Remount the test's tmpfs at `path` "ro" or "rw"."""
    why = _mount("-o", f"remount,{mode}", str(path))
    if why is not None:
        raise RuntimeError(f"remount {mode} failed: {why}")


def checkpoint(db: Path) -> None:
    """Fold a WAL database's log into it and cut the -wal file to nothing, from a second connection:
    the writes from now on need new room on the disk (a WAL reuses its own file's room otherwise)."""
    con = sqlite3.connect(db)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        con.close()
