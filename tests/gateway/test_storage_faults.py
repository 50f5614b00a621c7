"""A full, read-only or damaged disk under the gateway's data directory, on a real small filesystem
(a tmpfs the test mounts; tests/storage_rig.py): every write that cannot be made is refused in
OpenAI's error shape (507 insufficient_storage with Retry-After, or 503), nothing stored before is
lost, chat goes on, a batch waits with its reason instead of completing short, and writes work again
once space is freed, without a restart."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Batch

from cloud.serving.in_process import InProcessBackend
from gateway.access.keys import KeyStore
from gateway.batch import runner as runner_module
from gateway.batch.files import FileStore
from gateway.config import GatewayConfig
from gateway.openai.response_store import ResponseStore
from gateway.ops.preflight import check_data_dir
from shared.storage_faults import StorageFault

from ..storage_rig import checkpoint, fill, make_room, remount, small_fs
from .batches import chat_line, client_of, jsonl, lines_of, upload, wait
from .conftest import MODEL, Running, run_in_thread


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Path]:
    with small_fs(tmp_path / "fs", 4096) as d:
        yield d


def _gateway(backend: InProcessBackend, data: Path, min_free_mib: float = 0.0) -> Running:
    return run_in_thread(backend, GatewayConfig(port=0, data_dir=data, min_free_mib=min_free_mib))


def _upload_raw(running: Running, content: bytes) -> httpx.Response:
    files = {"file": ("input.jsonl", content)}
    return httpx.post(f"{running.url}/v1/files", files=files, data={"purpose": "batch"}, timeout=60)


def _storage_errors(running: Running, store: str, kind: str) -> float:
    text = httpx.get(f"{running.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'ctxfuse_storage_errors_total{{kind="{kind}",store="{store}"}}'):
            return float(line.split()[-1])
    return 0.0


def _batch(c: openai.OpenAI, file_id: str) -> Batch:
    return c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")


def _chat_works(running: Running) -> None:
    c = client_of(running)
    answer = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert answer.choices[0].message.content is not None


def test_an_upload_that_fills_the_disk_is_refused_with_507_and_nothing_stored_is_lost(
    backend: InProcessBackend, small: Path
) -> None:
    running = _gateway(backend, small)
    try:
        c = client_of(running)
        kept = jsonl([chat_line(f"k{i}") for i in range(20)])
        kept_id = upload(c, kept)
        # larger than the disk: SQLite runs out of room part way through writing it
        big = b'{"pad": "' + b"x" * (5 << 20) + b'"}\n'
        refused = _upload_raw(running, big)
        assert refused.status_code == 507
        error = refused.json()["error"]
        assert error["code"] == "insufficient_storage" and error["type"] == "server_error"
        assert "Files and Batch API store" in error["message"] and str(small) not in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert _storage_errors(running, "batch", "full") >= 1
        # nothing acknowledged is lost or damaged, the refused file left nothing behind
        assert c.files.content(kept_id).content == kept
        assert [f.id for f in c.files.list()] == [kept_id]
        _chat_works(running)  # what needs no disk is still served

        # the refused write's room (its frames in the WAL) takes the next ones: no restart needed
        medium = b"z" * (1 << 20)
        again = upload(c, medium)
        assert c.files.content(again).content == medium
        assert c.files.content(kept_id).content == kept
    finally:
        running.stop()


def test_a_disk_full_to_the_last_page_refuses_every_write_and_takes_them_again_once_freed(
    backend: InProcessBackend, small: Path
) -> None:
    running = _gateway(backend, small)
    try:
        c = client_of(running)
        kept = jsonl([chat_line("k")])
        kept_id = upload(c, kept)
        batch = c.batches.create(
            input_file_id=kept_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert wait(c, batch.id, timeout=60).status == "completed"
        checkpoint(small / "batches.sqlite")  # (a checkpointed WAL: its room is the disk's again)
        fill(small)
        with pytest.raises(openai.InternalServerError) as refused:
            upload(c, jsonl([chat_line("s")]))
        assert refused.value.status_code == 507
        assert refused.value.response.headers["retry-after"]
        with pytest.raises(openai.InternalServerError) as refused_batch:
            _batch(c, kept_id)
        assert refused_batch.value.status_code == 507
        # reads and chat need no disk
        assert c.files.content(kept_id).content == kept
        assert c.batches.retrieve(batch.id).status == "completed"
        _chat_works(running)

        make_room(small)
        assert c.files.content(upload(c, jsonl([chat_line("t")]))).content == jsonl([chat_line("t")])
        again = c.batches.create(
            input_file_id=kept_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert wait(c, again.id, timeout=60).status == "completed"
    finally:
        running.stop()


def test_a_gateway_started_on_a_disk_already_full_serves_and_takes_writes_once_freed(
    backend: InProcessBackend, small: Path
) -> None:
    """Its databases' -shm files went with the last close and cannot be made on a full disk: it still
    starts (no crash loop), reads and chats, refuses writes with 507, and takes them once freed."""
    first = _gateway(backend, small)
    kept = jsonl([chat_line("k")])
    kept_id = upload(client_of(first), kept)
    first.stop()
    fill(small)
    running = _gateway(backend, small)
    try:
        c = client_of(running)
        assert c.files.content(kept_id).content == kept
        _chat_works(running)
        assert _upload_raw(running, jsonl([chat_line("s")])).status_code == 507
        make_room(small)
        assert c.files.content(upload(c, jsonl([chat_line("t")]))).content == jsonl([chat_line("t")])
    finally:
        running.stop()


def test_an_upload_that_would_eat_the_floor_is_refused_before_anything_is_written(
    backend: InProcessBackend, small: Path
) -> None:
    running = _gateway(backend, small, min_free_mib=2.0)
    try:
        c = client_of(running)
        kept_id = upload(c, jsonl([chat_line("a")]))
        refused = _upload_raw(running, b"y" * (2 << 20))  # fits the disk, not the floor it keeps
        assert refused.status_code == 507 and refused.json()["error"]["code"] == "insufficient_storage"
        # the room kept is there for the writes that are not uploads: a batch and its results
        batch = c.batches.create(
            input_file_id=kept_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait(c, batch.id, timeout=60)
        assert done.status == "completed" and len(lines_of(c, done.output_file_id)) == 1
    finally:
        running.stop()


def test_a_batch_whose_disk_fills_waits_with_its_reason_and_completes_once_there_is_room(
    backend: InProcessBackend, small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "STORAGE_RETRY_S", 0.2)
    running = _gateway(backend, small)
    try:
        c = client_of(running)
        n = 30
        file_id = upload(c, [chat_line(f"r{i}", f"Count to {i}.", max_tokens=8) for i in range(n)])
        checkpoint(small / "batches.sqlite")
        fill(small, leave=64 << 10)  # room for the batch and a few results, not for all of them
        batch = c.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        seen = batch
        deadline = time.monotonic() + 90
        while seen.errors is None or not seen.errors.data:
            assert seen.status != "completed", "a batch whose results could not all be stored completed"
            assert time.monotonic() < deadline, f"the batch never showed it waits for its disk: {seen}"
            time.sleep(0.05)
            seen = c.batches.retrieve(batch.id)
        reason = seen.errors.data[0]
        assert reason.code == "insufficient_storage" and reason.message and "paused" in reason.message
        assert seen.status in ("validating", "in_progress", "finalizing")
        assert _storage_errors(running, "batch", "full") >= 1
        _chat_works(running)
        time.sleep(0.5)  # a few retries while the disk is still full: still not complete
        assert c.batches.retrieve(batch.id).status != "completed"

        make_room(small)
        done = wait(c, batch.id, timeout=120)
        assert done.status == "completed" and done.errors is None
        lines = lines_of(c, done.output_file_id)
        assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(n))
        assert all(line["response"]["status_code"] == 200 for line in lines)
    finally:
        running.stop()


def _serve(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """`ctxfuse serve` over `data_dir`, as an operator starts it (it stops at its disk check, before
    the model loads)."""
    cmd = [sys.executable, "-m", "ctxfuse", "serve", "--port", "0", "--data-dir", str(data_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_serve_refuses_a_read_only_data_dir_with_one_line(small: Path) -> None:
    remount(small, "ro")
    try:
        done = _serve(small)
    finally:
        remount(small, "rw")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert str(small) in lines[0] and "read-only" in lines[0] and "writable" in lines[0]


def _damage(path: Path) -> bytes:
    """Flip the header bytes of the database's second page (a b-tree page), as a bad sector would;
    the damaged bytes."""
    data = bytearray(path.read_bytes())
    data[4096] ^= 0xFF
    data[4097] ^= 0xFF
    path.write_bytes(bytes(data))
    return bytes(data)


def test_serve_refuses_a_damaged_database_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    files = FileStore(tmp_path / "batches.sqlite")
    files.put_file("batch", "a.jsonl", b"{}\n" * 2000, owner="t")
    files.close()
    keys = KeyStore(tmp_path / "keys.sqlite")
    keys.create("t")
    keys.close()
    ResponseStore(tmp_path / "responses.sqlite").close()  # (its table's root page is page 2)
    config = GatewayConfig(data_dir=tmp_path)
    for name in ("batches.sqlite", "keys.sqlite", "responses.sqlite"):
        path = tmp_path / name
        good = path.read_bytes()
        damaged = _damage(path)
        with pytest.raises(StorageFault) as found:
            check_data_dir(config)
        assert found.value.kind == "damaged" and str(path) in found.value.operator_message
        assert path.read_bytes() == damaged  # reported, never replaced by an empty one
        if name == "keys.sqlite":
            done = _serve(tmp_path)
            assert done.returncode == 2 and "Traceback" not in done.stderr
            (line,) = done.stderr.strip().splitlines()
            assert str(path) in line and "damaged" in line and "backup" in line
            assert path.read_bytes() == damaged
        path.write_bytes(good)
    check_data_dir(config)  # restored from the "backup": accepted
