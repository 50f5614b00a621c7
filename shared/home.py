"""Where ctxfuse keeps its files on a machine: `CTXFUSE_HOME`, else ~/.cache/ctxfuse (models, the
image encoder's files, the gateway's data, the agent's state)."""

from __future__ import annotations

import os
from pathlib import Path


def ctxfuse_home() -> Path:
    return Path(os.environ.get("CTXFUSE_HOME") or Path.home() / ".cache" / "ctxfuse")
