"""Files that must survive a crash or power loss whole (the CA's keys, certificates, CRL, index).

Each file is written aside first (`.NAME.xxxxxxxx.tmp` beside it, born with its final mode), synced,
renamed over the target, and the directory synced. Readers open only the final names, so a temp file
that a power cut left between write and rename is never read: the previous file stays in force. The
next write of the same file removes such leftovers once they are older than any live write could be.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# a write takes milliseconds; a temp file this old belongs to no live writer (a crash or power cut)
STALE_TEMP_S = 600.0


@dataclass(frozen=True, slots=True)
class NewFile:
    path: Path
    data: bytes
    mode: int  # the permissions it is born with, e.g. 0o600 for a key


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace `path` with `data` so that a crash or power loss at any moment leaves either the old
    file or the whole new one, never a part, and never a moment with wider permissions than `mode`."""
    write_in_order([NewFile(path, data, mode)])


def write_in_order(files: Sequence[NewFile]) -> None:
    """Replace each file as `write_atomic` does, publishing them in the order given.

    All are written aside and synced before the first is published, so a disk that refuses any of
    them (full, read-only) raises before anything changed, and leaves no temp file. A crash while
    publishing leaves the files before it new and those after it old: callers order `files` so that
    every such prefix is a state they can read (and repair) again."""
    for directory in dict.fromkeys(f.path.parent for f in files):
        remove_stale_temps(directory, {f.path.name for f in files if f.path.parent == directory})
    staged: list[tuple[Path, Path]] = []  # (temp, target), not yet published
    try:
        for f in files:
            staged.append((_write_aside(f), f.path))
        while staged:
            tmp, path = staged[0]
            os.replace(tmp, path)
            staged.pop(0)
            fsync_dir(path.parent)  # makes the rename itself survive power loss
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise


def _write_aside(f: NewFile) -> Path:
    # O_EXCL on a fresh name: the file is born with `mode`, never wider
    tmp = f.path.with_name(f".{f.path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, f.mode)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(f.data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def is_temp_of(name: str, target: str) -> bool:
    """Whether file `name` is one of `write_atomic`'s temp files for `target`."""
    prefix, suffix = f".{target}.", ".tmp"
    middle = name[len(prefix) : -len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
    return len(middle) == 8 and all(c in "0123456789abcdef" for c in middle)


def remove_stale_temps(directory: Path, targets: set[str], older_than_s: float = STALE_TEMP_S) -> list[Path]:
    """Remove temp files of `targets` in `directory` left by a crash (older than `older_than_s`);
    those removed. Best effort: a directory that cannot be read or written is left to the write that
    follows, which reports it."""
    removed: list[Path] = []
    cutoff = time.time() - older_than_s
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not any(is_temp_of(entry.name, t) for t in targets):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
