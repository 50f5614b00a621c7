"""The batch runner's life over a data directory: a batch interrupted by a restart resumes and runs
each request once, a batch past its window expires, and one runner (one gateway process) holds a data
directory at a time; batches run side by side, each isolated from the others. (Runners of several
replicas over one Redis: test_batch_leases.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from cloud.serving.in_process import InProcessBackend
from gateway.backends.local import engine_gateway
from gateway.batch import runner as batch_runner
from gateway.batch.executor import Answer, upstream_executor
from gateway.batch.input import BatchItem, parse_batch_input
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.config import GatewayConfig
from gateway.server import build_server
from shared.batch_protocol import Batch as StoredBatch
from shared.batch_protocol import BatchCreateRequest, FileObject
from shared.dir_lock import DirInUse

from .batches import chat_line, client_of, jsonl, lines_of, start, tag_of, wait
from .conftest import run_in_thread


def test_a_batch_interrupted_by_a_restart_resumes_and_runs_each_request_once(
    backend: InProcessBackend, tmp_path: Path
) -> None:
    config = GatewayConfig(port=0, data_dir=tmp_path)
    first = run_in_thread(backend, config)
    c = client_of(first)
    batch = start(c, [chat_line(f"r{i}", f"Write {i} words.", max_tokens=24) for i in range(10)])
    bkey = {"Idempotency-Key": "restart-key"}
    args: Any = {"input_file_id": batch.input_file_id, "endpoint": "/v1/chat/completions"}
    keyed = c.batches.create(**args, completion_window="24h", extra_headers=bkey)
    wait(c, batch.id, until={"in_progress"})
    while (counts := c.batches.retrieve(batch.id).request_counts) is None or counts.completed < 1:
        time.sleep(0.02)
    first.stop()  # the runner stops with the app, aborting what runs
    store = BatchStore(tmp_path / "batches.sqlite")
    left = len(store.pending(batch.id))
    store.close()
    assert 0 < left < 10  # stopped midway
    second = run_in_thread(backend, config)
    try:
        c = client_of(second)
        assert c.batches.create(**args, completion_window="24h", extra_headers=bkey).id == keyed.id
        done = wait(c, batch.id, timeout=60)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.total) == (10, 10)
        ids = [x["custom_id"] for x in lines_of(c, done.output_file_id)]
        assert ids == [f"r{i}" for i in range(10)]  # each exactly once
        wait(c, keyed.id, timeout=60)
    finally:
        second.stop()


def stored_batch(path: Path, n: int) -> StoredBatch:
    """A batch written through the store as a gateway would have left it: in progress, none run."""
    store = BatchStore(path)
    try:
        f = store.put_file("batch", "in.jsonl", jsonl([chat_line(f"e{i}") for i in range(n)]), owner="t")
        assert isinstance(f, FileObject)
        req = BatchCreateRequest(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = store.create_batch(req, owner="t")
        assert isinstance(b, StoredBatch)
        items = parse_batch_input(store.file_content(f.id) or b"", b.endpoint)
        assert store.start(b.id, [i for i in items if isinstance(i, BatchItem)]) is not None
        return b
    finally:
        store.close()


async def run_until(runner: BatchRunner, batch_id: str, status: str, timeout_s: float = 20) -> None:
    await runner.start()
    try:
        deadline = time.monotonic() + timeout_s
        while (b := runner.store.get_batch(batch_id)) is None or b.status != status:
            assert time.monotonic() < deadline, b
            await asyncio.sleep(0.02)
    finally:
        await runner.stop()


def test_a_batch_past_its_window_expires_and_its_unrun_requests_fail_as_batch_expired(
    backend: InProcessBackend, tmp_path: Path
) -> None:
    path = tmp_path / "batches.sqlite"
    b = stored_batch(path, 3)
    store = BatchStore(path)
    store.put_result(b.id, 1, True, b'{"custom_id": "e0"}')  # ran while the window was open
    store.close()
    assert b.expires_at is not None
    after_window = float(b.expires_at + 1)
    gateway = engine_gateway(backend, GatewayConfig(port=0, data_dir=tmp_path))
    runner = BatchRunner(upstream_executor(gateway), path, clock=lambda: after_window)
    asyncio.run(run_until(runner, b.id, "expired"))
    store = BatchStore(path)
    try:
        done = store.get_batch(b.id)
        assert done is not None and done.status == "expired" and done.expired_at
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (3, 1, 2)
        assert store.file_content(done.output_file_id or "") == b'{"custom_id": "e0"}\n'
        errors = [json.loads(x) for x in (store.file_content(done.error_file_id or "") or b"").splitlines()]
        assert [(x["custom_id"], x["error"]["code"], x["response"]) for x in errors] == [
            ("e1", "batch_expired", None),
            ("e2", "batch_expired", None),
        ]
    finally:
        store.close()


def test_a_second_runner_over_one_data_dir_refuses_to_start_naming_the_owner(
    backend: InProcessBackend, tmp_path: Path
) -> None:
    path = tmp_path / "batches.sqlite"
    BatchStore(path).close()  # the dir holds a database: a runner opens it at start
    gateway = engine_gateway(backend, GatewayConfig(port=0, data_dir=tmp_path))
    first, second = (
        BatchRunner(upstream_executor(gateway), path),
        BatchRunner(upstream_executor(gateway), path),
    )

    async def both() -> None:
        await first.start()
        with pytest.raises(DirInUse) as err:
            await second.start()
        assert str(tmp_path) in err.value.message and f"pid {os.getpid()} " in err.value.message
        await first.stop()
        await second.start()  # the first has let go
        await second.stop()

    asyncio.run(both())


def test_a_gateway_does_not_start_over_a_data_dir_another_process_holds(
    backend: InProcessBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    BatchStore(tmp_path / "batches.sqlite").close()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from shared.dir_lock import lock_dir;"
            " lock = lock_dir(pathlib.Path(sys.argv[1]), 'holder'); print('held', flush=True);"
            " sys.stdin.read()",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        server = build_server(backend, GatewayConfig(port=0, data_dir=tmp_path), announce=False)
        exits: list[object] = []

        def run() -> None:
            try:
                server.run()
            except SystemExit as exc:  # as `ctxfuse serve` exits
                exits.append(exc.code)

        thread = threading.Thread(target=run, name="refused-gateway")
        thread.start()
        thread.join(30)
        assert exits == [3] and not server.started
        assert str(tmp_path) in caplog.text and f"pid {holder.pid} holder" in caplog.text
    finally:
        holder.kill()  # kill -9: the kernel drops its lock
        holder.wait()
    running = run_in_thread(backend, GatewayConfig(port=0, data_dir=tmp_path))
    running.stop()


# -- batches side by side, isolated from each other -------------------------------------------------


def stored_batches(path: Path, tags: list[list[str]]) -> list[str]:
    """Batches written through the store (as the routes would), oldest first: one per list, a request
    per tag, its tag as the message text; the ids."""
    store = BatchStore(path)
    try:
        ids = []
        for k, batch_tags in enumerate(tags):
            lines = [chat_line(f"b{k}-r{i}", tag) for i, tag in enumerate(batch_tags)]
            f = store.put_file("batch", f"in{k}.jsonl", jsonl(lines), owner="t")
            assert isinstance(f, FileObject)
            req = BatchCreateRequest(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            b = store.create_batch(req, owner="t")
            assert isinstance(b, StoredBatch)
            ids.append(b.id)
        return ids
    finally:
        store.close()


async def run_until_done(runner: BatchRunner, ids: list[str], timeout_s: float = 30) -> list[StoredBatch]:
    """Start the runner, wait (a hang guard, not a speed bound) until every batch is done, stop it."""
    await runner.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            got = [runner.store.get_batch(i) for i in ids]
            if all(b is not None and b.status in ("completed", "failed") for b in got):
                return [b for b in got if b is not None]
            assert time.monotonic() < deadline, [b.status if b else None for b in got]
            await asyncio.sleep(0.02)
    finally:
        await runner.stop()


def test_a_poisoned_batch_ends_failed_with_its_reason_and_the_next_batch_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_runner, "RETRY_S", 0.01)
    path = tmp_path / "batches.sqlite"
    poisoned, healthy = stored_batches(path, [["fine", "poison"], ["fine too"]])
    calls: list[str] = []

    async def execute(endpoint: str, body: bytes, rid: str, priority: int, owner: str) -> Answer:
        calls.append(tag_of(body))
        if tag_of(body) == "poison":  # an answer the runner cannot store: an error it does not expect
            return Answer(200, cast(bytes, None))
        return Answer(200, b'{"ok": true}')

    # one batch at a time: the poisoned one, oldest, takes the only slot first
    runner = BatchRunner(execute, path, max_running=1)
    failed, done = asyncio.run(run_until_done(runner, [poisoned, healthy]))
    assert failed.status == "failed" and failed.errors is not None
    assert [(e.code, "TypeError" in e.message) for e in failed.errors.data] == [("server_error", True)]
    assert calls.count("poison") == batch_runner.ATTEMPTS  # retried a bounded number of times
    assert calls.count("fine") == 1  # its result was stored on the first attempt and kept
    store = BatchStore(path)
    try:
        kept = store.file_content(failed.output_file_id or "") or b""
        assert [json.loads(x)["custom_id"] for x in kept.splitlines()] == ["b0-r0"]
    finally:
        store.close()
    assert done.status == "completed" and done.request_counts.completed == 1


def test_batches_run_side_by_side_never_more_than_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "batches.sqlite"
    ids = stored_batches(path, [[f"b{k}", f"b{k}"] for k in range(6)])
    in_flight: dict[str, int] = {}
    most: list[int] = [0]
    all_in = asyncio.Event()

    async def execute(endpoint: str, body: bytes, rid: str, priority: int, owner: str) -> Answer:
        tag = tag_of(body)
        in_flight[tag] = in_flight.get(tag, 0) + 1
        most[0] = max(most[0], len(in_flight))
        if len(in_flight) == 3:
            all_in.set()
        try:
            # the first requests wait until three batches have one in flight: only side by side can
            await asyncio.wait_for(all_in.wait(), 20)  # (a hang guard)
        finally:
            in_flight[tag] -= 1
            if not in_flight[tag]:
                del in_flight[tag]
        return Answer(200, b'{"ok": true}')

    runner = BatchRunner(execute, path, concurrency=1, max_running=3)
    done = asyncio.run(run_until_done(runner, ids))
    assert [b.status for b in done] == ["completed"] * 6
    assert [b.request_counts.completed for b in done] == [2] * 6
    assert most[0] == 3  # reached, never passed


def test_a_cancel_wakes_the_batch_it_names_while_others_run(tmp_path: Path) -> None:
    """Each running batch waits on a wake of its own: a cancel reaches the batch it names even while
    other batches (and the loop) wait too."""
    path = tmp_path / "batches.sqlite"
    first, second = stored_batches(path, [["hold"], ["hold"]])
    started = asyncio.Event()
    release = asyncio.Event()

    async def execute(endpoint: str, body: bytes, rid: str, priority: int, owner: str) -> Answer:
        started.set()
        await release.wait()
        return Answer(200, b'{"ok": true}')

    async def scenario() -> tuple[str | None, str | None]:
        runner = BatchRunner(execute, path, max_running=2)
        await runner.start()
        try:
            await asyncio.wait_for(started.wait(), 20)
            while any(
                (b := runner.store.get_batch(i)) is None or b.status != "in_progress" for i in (first, second)
            ):
                await asyncio.sleep(0.01)
            runner.store.transition(first, "cancelling", only_from=("in_progress",))
            runner.wake()
            while (b := runner.store.get_batch(first)) is not None and b.status != "cancelled":
                await asyncio.sleep(0.01)  # the first ends while its request still hangs
            now = runner.store.get_batch(second)
            release.set()
            return (b.status if b else None), (now.status if now else None)
        finally:
            await runner.stop()

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == ("cancelled", "in_progress")
