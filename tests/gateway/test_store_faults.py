"""The gateway's other stores on a full disk (a real tmpfs, tests/storage_rig.py) or after a power cut:
the API keys, the stored responses of the Responses API and the edge link's chunk store refuse what
they cannot write with the store's StorageFault (507 through the API), keep what they held, and write
again once there is room; a power cut mid-write leaves the last committed state."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cloud.serving.in_process import InProcessBackend
from gateway.access.keys import KeyStore
from gateway.batch.files import FileStore
from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from shared import sqlite_store
from shared.chunking import digest as chunk_digest
from shared.storage_faults import StorageFault

from ..storage_rig import checkpoint, fill, make_room, small_fs
from .conftest import MODEL, run_in_thread


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Path]:
    with small_fs(tmp_path / "fs", 2048) as d:
        yield d


def test_a_key_cannot_be_made_on_a_full_disk_but_every_key_made_still_works(small: Path) -> None:
    keys = KeyStore(small / "keys.sqlite")
    try:
        record, secret = keys.create("acme")
        checkpoint(small / "keys.sqlite")
        fill(small)
        with pytest.raises(StorageFault) as refused:
            keys.create("acme")
        assert refused.value.status == 507 and refused.value.store == "keys"
        found = keys.lookup(secret)  # authentication needs no disk
        assert found is not None and found.id == record.id
        make_room(small)
        _, second = keys.create("acme")
        assert keys.lookup(second) is not None and keys.lookup(secret) is not None
    finally:
        keys.close()


def test_the_chunk_store_refuses_a_chunk_it_cannot_write_and_keeps_the_others(small: Path) -> None:
    chunks = ChunkStore(small / "chunks.sqlite", max_bytes=64 << 20)
    try:
        first, big = b"first chunk", b"x" * 200_000
        chunks.put(chunk_digest(first), first, tenant="t")
        checkpoint(small / "chunks.sqlite")
        fill(small)
        with pytest.raises(StorageFault) as refused:
            chunks.put_many({chunk_digest(big): big}, tenant="t")
        assert refused.value.kind == "full" and refused.value.store == "chunks"
        assert chunks.get_many([chunk_digest(first)], tenant="t") == {chunk_digest(first): first}
        assert chunks.count == 1  # the failed write counted nothing
        make_room(small)
        chunks.put_many({chunk_digest(big): big}, tenant="t")
        assert chunks.count == 2
    finally:
        chunks.close()


def test_a_damaged_chunk_store_is_set_aside_and_an_empty_one_takes_its_place(tmp_path: Path) -> None:
    """The chunk store is a cache (a chunk it lacks is asked of the device again): a damaged one is
    kept beside for a look and the gateway starts; the batch database is never treated so."""
    path = tmp_path / "chunks.sqlite"
    chunks = ChunkStore(path, max_bytes=1 << 20)
    for i in range(40):
        data = bytes([i]) * 1000
        chunks.put(chunk_digest(data), data, tenant="t")
    chunks.close()
    data = bytearray(path.read_bytes())
    data[4096] ^= 0xFF  # the second page's b-tree header
    path.write_bytes(bytes(data))
    again = ChunkStore(path, max_bytes=1 << 20)
    try:
        assert again.count == 0
        (aside,) = tmp_path.glob("chunks.sqlite.damaged-*")
        assert aside.read_bytes() == bytes(data)
    finally:
        again.close()


def test_a_power_cut_mid_write_leaves_the_last_committed_state(tmp_path: Path) -> None:
    """A copy of the database and its WAL taken while the gateway runs is what a power cut leaves;
    a torn frame of a write that never committed is appended to its WAL."""
    live = tmp_path / "live"
    files = FileStore(live / "batches.sqlite")
    kept = files.put_file("batch", "kept.jsonl", b"kept\n" * 1000, owner="t")
    cut = tmp_path / "cut"
    cut.mkdir()
    for name in ("batches.sqlite", "batches.sqlite-wal"):
        shutil.copy(live / name, cut / name)
    files.close()
    with open(cut / "batches.sqlite-wal", "ab") as wal:
        wal.write(b"\x37\x7f\x06\x82" + b"torn" * 1000)  # half a frame, no valid checksum
    after = FileStore(cut / "batches.sqlite")  # opening checks it: sound
    try:
        assert after.file_content(kept.id) == b"kept\n" * 1000
        assert after.put_file("batch", "next.jsonl", b"n\n", owner="t")  # and it takes writes
    finally:
        after.close()


def test_a_response_that_cannot_be_stored_is_refused_and_a_stream_ends_failed_not_cut(
    backend: InProcessBackend, small: Path
) -> None:
    running = run_in_thread(backend, GatewayConfig(port=0, data_dir=small))
    url = f"{running.url}/v1/responses"
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4}
    try:
        first = httpx.post(url, json=body, timeout=60)
        assert first.status_code == 200
        kept = first.json()["id"]
        checkpoint(small / "responses.sqlite")
        fill(small)
        refused = httpx.post(url, json=body, timeout=60)
        assert refused.status_code == 507
        assert refused.json()["error"]["code"] == "insufficient_storage"
        events = []
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as streamed:
            assert streamed.status_code == 200
            for line in streamed.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        types = [e["type"] for e in events]
        assert types[-1] == "response.failed" and "error" in types
        error = next(e for e in events if e["type"] == "error")
        assert error["code"] == "insufficient_storage"
        assert httpx.get(f"{url}/{kept}", timeout=10).json()["id"] == kept  # kept before: still there
        make_room(small)
        assert httpx.post(url, json=body, timeout=60).status_code == 200
    finally:
        running.stop()


def test_a_large_database_damaged_past_its_open_check_answers_its_reads_as_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond QUICK_CHECK_MAX_BYTES only the header and schema are read when opening: a page damaged
    further in is met by a read, which raises the store's "damaged" fault (a 503), never a bare
    sqlite3 error (a 500)."""
    path = tmp_path / "batches.sqlite"
    files = FileStore(path)
    made = [files.put_file("batch", f"{i}.jsonl", bytes([i % 250]) * 3000, owner="t") for i in range(60)]
    files.close()
    data = bytearray(path.read_bytes())
    last = len(data) // 4096 - 1
    data[last * 4096 : last * 4096 + 8] = b"\xff" * 8  # the last page's b-tree header
    path.write_bytes(bytes(data))
    monkeypatch.setattr(sqlite_store, "QUICK_CHECK_MAX_BYTES", 0)
    damaged = FileStore(path)
    try:
        with pytest.raises(StorageFault) as found:
            for f in made:
                damaged.file_content(f.id)
            damaged.list_files(10_000, None, None, owner="t")
        assert found.value.kind == "damaged" and found.value.status == 503
        assert found.value.code == "storage_damaged" and str(path) in found.value.operator_message
    finally:
        damaged.close()
