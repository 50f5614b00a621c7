"""The Batch API over two gateway replicas sharing one Redis: a file and a batch made through one
replica are read through the other (an Idempotency-Key replays across them), and a batch whose
replica is killed with -9 mid-run is finished by the other once the dead one's lease lapses, every
custom_id answered exactly once."""

from __future__ import annotations

import json
import time
from typing import Any, Final

import openai
import redis

from tests.gateway.replicas.rig import MODEL, Cluster, ReplicaProcess

CHAT: Final = "/v1/chat/completions"


def client(replica: ReplicaProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=replica.base_url, api_key="unused", max_retries=0, timeout=60)


def jsonl(n: int, max_tokens: int) -> bytes:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Count from {i} upwards."}],
                "max_tokens": max_tokens,
            },
        }
        for i in range(n)
    ]
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def create(c: openai.OpenAI, content: bytes, **kw: Any) -> openai.types.Batch:
    f = c.files.create(file=("in.jsonl", content), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h", **kw)


def wait_for(check: Any, timeout_s: float, what: str) -> Any:
    """Poll `check` until it answers something true (a hang guard, not a speed bound)."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return got


def test_a_file_and_a_batch_made_on_one_replica_are_read_on_the_other(cluster: Cluster) -> None:
    a, b = (client(r) for r in cluster.replicas)
    content = jsonl(1, 1)
    key = {"Idempotency-Key": "across-replicas"}
    batch = create(a, content, extra_headers=key)
    assert b.batches.retrieve(batch.id).input_file_id == batch.input_file_id
    assert b.files.retrieve(batch.input_file_id).bytes == len(content)
    assert b.files.content(batch.input_file_id).content == content
    assert batch.id in [x.id for x in b.batches.list().data]
    replayed = b.batches.create(
        input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h", extra_headers=key
    )
    assert replayed.id == batch.id  # the key names its batch on every replica
    done = wait_for(lambda: (x := b.batches.retrieve(batch.id)).status == "completed" and x, 60, "done")
    assert done.request_counts is not None and done.request_counts.completed == 1


def test_a_batch_whose_replica_is_killed_mid_run_is_finished_by_the_other(cluster: Cluster) -> None:
    n = 8
    batch = create(client(cluster.replicas[0]), jsonl(n, 12))  # made on A, which A's runner takes at once
    lease = f"ctxfuse:batch:lease:{batch.id}"
    with redis.Redis.from_url(cluster.redis_url) as r:
        holder = wait_for(lambda: r.get(lease), 30, "no replica took the batch").decode()
    index = next(i for i, x in enumerate(cluster.replicas) if holder.endswith(f":{x.proc.pid}"))
    dead, other = cluster.replicas[index], cluster.replicas[1 - index]
    survivor = client(other)

    def some_stored() -> bool:
        counts = survivor.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed >= 1

    wait_for(some_stored, 60, "no result stored")
    dead.kill()  # kill -9 with requests of the batch in flight
    counts = survivor.batches.retrieve(batch.id).request_counts
    assert counts is not None and 0 < counts.completed < n, counts  # killed midway
    try:
        done = wait_for(
            lambda: (
                (x := survivor.batches.retrieve(batch.id)).status not in ("in_progress", "finalizing") and x
            ),
            90,
            "the surviving replica did not finish the batch",
        )
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
        lines = [
            json.loads(x) for x in survivor.files.content(done.output_file_id or "").content.splitlines()
        ]
        assert [x["custom_id"] for x in lines] == [f"r{i}" for i in range(n)]  # each once, in input order
        assert {x["response"]["status_code"] for x in lines} == {200}
    finally:
        cluster.start_replica(index)  # later tests of the package have two replicas again
