"""`--redis-url`: the state several gateway replicas share (gateway/shared_state/redis_link.py),
for `ctxfuse serve` and for `ctxfuse keys` (which then writes the keys every replica reads)."""

from __future__ import annotations

import argparse

from ctxfuse.cli_values import SecretOption

# a URL may carry a password (redis://:PASSWORD@host:6379/0): also from a file or the environment
REDIS_URL = SecretOption("--redis-url", env="CTXFUSE_REDIS_URL")


def add_redis_option(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shared state (several gateway replicas)")
    REDIS_URL.add(
        g,
        help="keep per-key limits, tenants' keys, the Batch API's files and batches (with leases, so a "
        "batch runs on one replica), stored responses and the edge link's chunks in this Redis, shared "
        "by every replica given the same URL, e.g. redis://redis:6379/0; routers also share their prefix "
        f"notes and canary rollbacks there (default: ${REDIS_URL.env}, else none: this process and its "
        "local SQLite files, one replica); unreachable Redis: what needs it answers 503 (docs/replicas.md)",
        file_help="read --redis-url from this file's first line (keeps a password out of the process list)",
    )
