"""Files that must survive a crash or power loss whole (the CA's keys, certificates, CRL, index)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace `path` with `data` so that a crash or power loss at any moment leaves either the old
    file or the whole new one, never a part, and never a moment with wider permissions than `mode`."""
    # the file is born with `mode` (O_EXCL on a fresh name), filled and synced, then renamed over the
    # target; syncing the directory makes the rename itself survive power loss
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
