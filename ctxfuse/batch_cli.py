"""The Batch API options of `ctxfuse serve`: where the gateway keeps uploaded files, batches and their
results."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_batch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch API (/v1/files, /v1/batches)")
    g.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="directory of the batch database: files, batches, results, idempotency keys; one gateway "
        "process per directory, a second refuses to start (default CTXFUSE_HOME/gateway)",
    )
