"""Batch runners of several replicas over one Redis (`--redis-url`): one runner drives a batch under
its lease, another takes it over once the lease lapses, and a Redis outage holds a batch back without
failing it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.batch import runner as batch_runner
from gateway.batch.executor import Answer, Executor
from gateway.batch.input import BatchItem, parse_batch_input
from gateway.batch.lease import RedisLeases
from gateway.batch.runner import BatchRunner
from gateway.batch.store_redis import RedisBatchStore
from gateway.shared_state.redis_link import RedisLink, SharedStateDown
from shared.batch_protocol import Batch as StoredBatch
from shared.batch_protocol import BatchCreateRequest, FileObject

from .batches import chat_line, jsonl, tag_of


def redis_batch(url: str, n: int) -> tuple[RedisBatchStore, RedisLink, str]:
    """A batch of n requests (tags r0..), stored in Redis in progress as a replica would leave it."""
    link = RedisLink(url)
    store = RedisBatchStore(link)
    lines = [chat_line(f"r{i}", f"r{i}") for i in range(n)]
    f = store.put_file("batch", "in.jsonl", jsonl(lines), owner="t")
    assert isinstance(f, FileObject)
    req = BatchCreateRequest(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = store.create_batch(req, owner="t")
    assert isinstance(b, StoredBatch)
    items = parse_batch_input(store.file_content(f.id) or b"", b.endpoint)
    assert store.start(b.id, [i for i in items if isinstance(i, BatchItem)]) is not None
    return store, link, b.id


def replica_link(url: str, name: str) -> RedisLink:
    """A link as replica `name` (one test process plays several replicas)."""
    link = RedisLink(url)
    link.replica = name
    return link


async def until(check: Callable[[], bool], timeout_s: float = 20) -> None:
    """Wait for `check` (a hang guard, not a speed bound)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_one_replica_drives_a_batch_and_another_takes_over_once_its_lease_lapses(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runs a request, then its loop freezes (a stalled replica) with a request in flight; B, which
    could not get the lease while A renewed it, takes the batch once the lease lapses and finishes it.
    A, thawed, starts nothing more: its lease ran out by its own clock. Each line has one result."""
    monkeypatch.setattr(batch_runner, "POLL_S", 0.05)
    ttl = 1.0
    store, link, batch_id = redis_batch(redis_url, 5)
    ran: dict[str, list[str]] = {"A": [], "B": []}
    gate = threading.Event()  # holds A's second request in flight

    def executor(name: str) -> Executor:
        async def execute(endpoint: str, body: bytes, rid: str, priority: int, owner: str) -> Answer:
            ran[name].append(tag_of(body))
            if name == "A" and len(ran["A"]) == 2:
                await asyncio.to_thread(gate.wait, 30)
            return Answer(200, json.dumps({"by": name}).encode())

        return execute

    a_link, b_link = replica_link(redis_url, "A"), replica_link(redis_url, "B")
    a = BatchRunner(executor("A"), tmp_path / "a.sqlite", concurrency=1, redis=a_link, lease_s=ttl)
    b = BatchRunner(executor("B"), tmp_path / "b.sqlite", concurrency=1, redis=b_link, lease_s=ttl)
    a_loop = asyncio.new_event_loop()
    a_thread = threading.Thread(target=a_loop.run_forever, name="replica-a")
    a_thread.start()
    leases = RedisLeases(link)

    async def scenario() -> None:
        asyncio.run_coroutine_threadsafe(a.start(), a_loop).result(10)
        await until(lambda: len(ran["A"]) == 2)  # r0 stored, r1 in flight on A
        await b.start()
        try:
            await asyncio.sleep(2 * ttl)  # B polls all along; A renews all along
            assert ran["B"] == [] and leases.holder(batch_id) == "A"
            a_loop.call_soon_threadsafe(time.sleep, 3 * ttl)  # A stalls: no renewal, nothing runs
            await until(lambda: (s := store.get_batch(batch_id)) is not None and s.status == "completed")
        finally:
            gate.set()  # A's request ends (its result is refused: r1 has B's)
            asyncio.run_coroutine_threadsafe(a.stop(), a_loop).result(20)
            await b.stop()

    try:
        asyncio.run(scenario())
    finally:
        a_loop.call_soon_threadsafe(a_loop.stop)
        a_thread.join(10)
        a_loop.close()
    assert ran["A"] == ["r0", "r1"]  # thawed, A took nothing more
    assert ran["B"] == ["r1", "r2", "r3", "r4"]  # r1 had no result when A stalled: it ran again
    done = store.get_batch(batch_id)
    assert done is not None and done.request_counts.completed == 5
    out = [json.loads(x) for x in (store.file_content(done.output_file_id or "") or b"").splitlines()]
    assert [(x["custom_id"], x["response"]["body"]["by"]) for x in out] == [
        ("r0", "A"),
        ("r1", "B"),
        ("r2", "B"),
        ("r3", "B"),
        ("r4", "B"),
    ]
    assert leases.holder(batch_id) is None  # B let go when done
    for each in (link, a_link, b_link):
        each.close()


def test_a_redis_outage_holds_a_batch_back_without_failing_it(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis stops answering (CLIENT PAUSE) while a batch runs: the result of the request in flight
    cannot be stored, the lease cannot be renewed; the runner waits it out and finishes the batch,
    which never fails for it. The request whose result was lost runs again."""
    monkeypatch.setattr(batch_runner, "POLL_S", 0.05)
    monkeypatch.setattr(batch_runner, "RETRY_S", 0.05)
    store, link, batch_id = redis_batch(redis_url, 3)
    ran: list[str] = []

    async def execute(endpoint: str, body: bytes, rid: str, priority: int, owner: str) -> Answer:
        ran.append(tag_of(body))
        if len(ran) == 1:  # every client's commands wait 3 s: longer than a call's 2 s timeout
            await asyncio.to_thread(link.sync.client_pause, 3000)
        return Answer(200, b'{"ok": true}')

    runner = BatchRunner(
        execute, tmp_path / "x.sqlite", concurrency=1, redis=RedisLink(redis_url), lease_s=1.0
    )

    def completed() -> bool:
        try:
            return (b := store.get_batch(batch_id)) is not None and b.status == "completed"
        except SharedStateDown:
            return False  # (this test's own look at Redis waits the outage out too)

    async def scenario() -> None:
        await runner.start()
        try:
            await until(completed, 30)
        finally:
            await runner.stop()

    asyncio.run(scenario())
    assert ran[0] == "r0" and ran.count("r0") == 2 and sorted(set(ran)) == ["r0", "r1", "r2"]
    done = store.get_batch(batch_id)
    assert done is not None and done.errors is None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
    out = [
        json.loads(x)["custom_id"]
        for x in (store.file_content(done.output_file_id or "") or b"").splitlines()
    ]
    assert out == ["r0", "r1", "r2"]
    link.close()
