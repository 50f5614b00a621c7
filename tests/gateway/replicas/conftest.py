"""One cluster for every cross-replica test (the workers' model loads are the cost): one Redis, two
workers, two gateway replicas."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.replicas.rig import Cluster, start_cluster


@pytest.fixture(scope="package")
def cluster(
    redis_server_proc, gguf_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    redis_server_proc.flush()
    c = start_cluster(redis_server_proc.url, gguf_path, tmp_path_factory.mktemp("replicas"))
    try:
        yield c
    finally:
        c.stop()
