"""A device behind a load balancer: its document uploaded through one replica goes by reference
through the other, because the edge link's chunks live in the Redis the replicas share
(gateway/edge/chunk_store_redis.py).

The device is the real agent's uplink (edge/uplink.py: dedup against what the gateway acknowledged,
zstd, the 409 path), one per replica's edge listener, sharing the device's one record of acknowledged
chunks, as one agent whose connections land on either replica. Bytes are what the uplink sent: had
replica B lacked the chunks, it would have answered 409 and the uplink would have sent them all again.
"""

from __future__ import annotations

import asyncio
import random
import string
from pathlib import Path

from edge.acked import AckedChunks
from edge.encode import chunk_strings
from edge.uplink import Uplink
from gateway.edge.chunk_store_redis import ChunkKeys
from gateway.shared_state.redis_link import RedisLink
from shared.tls import client_context
from tests.gateway.replicas.rig import DEVICE, MODEL, Cluster, ReplicaProcess

THRESHOLD = 2048  # the agent's default chunk_threshold (edge/config.py)


def document(seed: int, nbytes: int) -> str:
    """Text that zstd cannot shrink much (random words of random letters), so that the first upload is
    about its size and the references are the share that dedup leaves."""
    rng = random.Random(seed)
    words = ("".join(rng.choices(string.ascii_letters, k=rng.randint(2, 9))) for _ in range(nbytes // 6))
    return " ".join(words)


async def upload(
    replicas: list[ReplicaProcess], tls_dir: Path, body: dict[str, object], acked: Path
) -> list[tuple[int, int]]:
    """Send `body` through each replica's edge listener in turn; (status, bytes the uplink sent) each."""
    record = AckedChunks(acked, max_entries=100_000)
    tls = client_context(tls_dir, DEVICE)
    sent = []
    for replica in replicas:
        uplink = Uplink(replica.edge_url, tls, record, THRESHOLD, connect_timeout_s=10)
        try:
            resp = await uplink.forward("completions", body)
            await resp.aread()
            await resp.aclose()
            sent.append((resp.status_code, uplink.uploaded_bytes))
        finally:
            await uplink.close()
    return sent


def test_a_document_uploaded_through_one_replica_goes_by_reference_through_the_other(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.replicas[0], cluster.replicas[1]
    body: dict[str, object] = {
        "model": MODEL,
        "prompt": document(7, 48 * 1024) + "\n\nSummary:",
        "max_tokens": 1,
        "temperature": 0,
    }
    (a_status, first), (b_status, second) = asyncio.run(
        upload([a, b], cluster.tls_dir, body, tmp_path / "acked.sqlite")
    )
    assert (a_status, b_status) == (200, 200)
    assert second <= 0.05 * first, (first, second)  # B had every chunk: only references travelled

    link = RedisLink(cluster.redis_url)
    digests = chunk_strings("completions", body, THRESHOLD).digests
    assert len(digests) > 10
    # in Redis, not in a replica's own file (on one host both replicas' default file is the same one)
    held = [link.sync.hexists(ChunkKeys.of(link).data, d) for d in digests]
    link.close()
    assert all(held), f"{held.count(False)} of {len(digests)} chunks are not in the shared Redis"
