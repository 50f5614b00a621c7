"""The Batch API options of `ctxfuse serve`: where the gateway keeps uploaded files, batches and their
results."""

from __future__ import annotations

import argparse
from pathlib import Path

from ctxfuse.cli_values import non_negative_float, non_negative_int, positive_float, positive_int


def add_batch_options(p: argparse.ArgumentParser) -> None:
    from gateway.config import GatewayConfig

    g = p.add_argument_group("batch API (/v1/files, /v1/batches)")
    g.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="directory of the batch database: files, batches, results, idempotency keys; one gateway "
        "process per directory, a second refuses to start (default CTXFUSE_HOME/gateway); with "
        "--redis-url those live in Redis, shared by every replica",
    )
    d = GatewayConfig()
    g.add_argument(
        "--max-running-batches",
        type=positive_int,
        default=d.max_running_batches,
        help="batches run side by side, each a few requests at a time at low priority; a batch that "
        f"keeps failing is failed on its own and holds one of these (default {d.max_running_batches})",
    )
    g.add_argument(
        "--batch-lease",
        type=positive_float,
        default=d.batch_lease_s,
        metavar="SECONDS",
        help="with --redis-url: a batch runs on one replica at a time, which renews its lease every third "
        "of this; a replica that dies (or loses Redis) has its batches taken over by another this long "
        f"after its last renewal (default {d.batch_lease_s:g})",
    )
    g.add_argument(
        "--min-free-mib",
        type=non_negative_float,
        default=d.min_free_mib,
        metavar="MIB",
        help="an upload that would leave less free space than this on the data dir's disk is refused "
        "with 507 insufficient_storage, so batches can still write their results and keys and stored "
        f"responses be made (default {d.min_free_mib:g}; 0: no floor)",
    )
    g.add_argument(
        "--file-ttl-days",
        type=non_negative_int,
        default=d.file_ttl_days,
        help="days a file uploaded or produced from now on is kept when its request sets no "
        "expires_after (output_expires_after for a batch's results); 0 keeps it until deleted, as "
        f"OpenAI does (default {d.file_ttl_days})",
    )
