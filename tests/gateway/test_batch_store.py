"""The Batch API's store and input rules: results written once, counts read from results, keys that
replay or refuse, state changes that only happen from the states they name, and all of it persisted.

The contract tests run against both backends (batch/store_api.py): SQLite over a data dir and Redis
(a real redis-server, flushed per test), through the `store` fixture; `reopen` gives a second store
over the same state (a restarted gateway, or another replica)."""

from __future__ import annotations

import json
import threading
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.batch import files as file_store
from gateway.batch.files import KEY_REUSED, Idem
from gateway.batch.input import BatchItem, parse_batch_input
from gateway.batch.store import BatchStore
from gateway.batch.store_api import Store
from gateway.batch.store_redis import RedisBatchStore
from gateway.shared_state.redis_link import RedisLink
from shared.batch_protocol import Batch, BatchCreateRequest, BatchError, FileObject

CHAT = "/v1/chat/completions"
Reopen = Callable[..., Store]  # (clock=..., default_ttl_s=...) -> a new store over the same state


def line(custom_id: str, url: str = CHAT, **over: object) -> bytes:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": url, "body": {"x": 1}, **over}
    ).encode()


@pytest.fixture(params=["sqlite", "redis"])
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Reopen]:
    made: list[Store] = []
    links: list[RedisLink] = []
    # a namespace of the test's own: nothing another test leaves in the session's Redis reaches it
    namespace = f"test-{uuid.uuid4().hex}"

    def open_store(**kw: Any) -> Store:
        if request.param == "sqlite":
            s: Store = BatchStore(tmp_path / "db" / "batches.sqlite", **kw)
        else:
            links.append(RedisLink(request.getfixturevalue("redis_url"), namespace=namespace))
            s = RedisBatchStore(links[-1], **kw)
        made.append(s)
        return s

    yield open_store
    for s in made:
        s.close()
    for link in links:
        link.close()


@pytest.fixture
def store(reopen: Reopen) -> Store:
    return reopen()


def new_batch(store: Store, n: int = 3) -> Batch:
    f = store.put_file("batch", "in.jsonl", b"\n".join(line(f"r{i}") for i in range(n)), owner="t")
    assert isinstance(f, FileObject)
    b = store.create_batch(
        BatchCreateRequest(input_file_id=f.id, endpoint=CHAT, completion_window="24h"), owner="t"
    )
    assert isinstance(b, Batch)
    return b


def test_input_lines_parse_in_order_with_their_line_numbers() -> None:
    items = parse_batch_input(line("a") + b"\n\n" + line("b") + b"\n", CHAT)
    assert items == [BatchItem(1, "a", b'{"x": 1}'), BatchItem(3, "b", b'{"x": 1}')]


def test_every_bad_line_is_named() -> None:
    content = b"\n".join(
        [line("a"), b"[1]", line("a"), line("b", method="GET"), line("c", url="/v1/x"), line("d", body=3)]
    )
    errors = parse_batch_input(content, CHAT)
    assert all(isinstance(e, BatchError) for e in errors)
    assert [(e.line, e.code) for e in errors if isinstance(e, BatchError)] == [
        (2, "invalid_request"),
        (3, "duplicate_custom_id"),
        (4, "invalid_method"),
        (5, "mismatched_url"),
        (6, "invalid_request"),
    ]
    assert [e.code for e in parse_batch_input(b"\n \n", CHAT) if isinstance(e, BatchError)] == ["empty_file"]


def test_a_result_is_written_once_and_counts_follow_results(store: Store) -> None:
    b = new_batch(store)
    items = parse_batch_input(store.file_content(b.input_file_id) or b"", CHAT)
    started = store.start(b.id, [i for i in items if isinstance(i, BatchItem)])
    assert started is not None and started.status == "in_progress" and started.in_progress_at
    assert store.put_result(b.id, 2, True, b'{"n":2}')
    assert not store.put_result(b.id, 2, False, b'{"n":"again"}')  # never overwritten
    assert store.put_result(b.id, 1, False, b'{"n":1}')
    assert [i.custom_id for i in store.pending(b.id)] == ["r2"]
    counts = (store.get_batch(b.id) or b).request_counts
    assert (counts.total, counts.completed, counts.failed) == (3, 1, 1)


def test_finish_writes_output_and_error_files_in_input_order(store: Store) -> None:
    b = new_batch(store)
    store.start(b.id, [BatchItem(i, f"r{i}", b"{}") for i in (1, 2, 3)])
    for no, ok in ((3, True), (1, True), (2, False)):
        store.put_result(b.id, no, ok, f'{{"line":{no}}}'.encode())
    assert store.finish(b.id, "completed") is not None
    done = store.get_batch(b.id)
    assert done is not None and done.status == "completed" and done.completed_at
    assert store.file_content(done.output_file_id or "") == b'{"line":1}\n{"line":3}\n'
    assert store.file_content(done.error_file_id or "") == b'{"line":2}\n'
    assert store.finish(b.id, "completed") is None  # a done batch stays done, with its files


def test_transitions_happen_only_from_the_states_named(store: Store) -> None:
    b = new_batch(store)
    assert store.transition(b.id, "cancelling", only_from=("validating", "in_progress")) is not None
    assert store.start(b.id, []) is None  # cancelled while validating: its requests are never stored
    assert store.next_active() is not None and store.finish(b.id, "cancelled") is not None
    assert store.next_active() is None
    assert store.transition(b.id, "cancelling", only_from=("validating", "in_progress")) is None


def test_idempotency_key_replays_refuses_and_expires(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    idem = Idem("/v1/files", "k", b"digest-1")
    first = store.put_file("batch", "a.jsonl", b"{}", idem, owner="t")
    assert store.put_file("batch", "a.jsonl", b"{}", idem, owner="t") == first
    assert (
        store.put_file("batch", "b.jsonl", b"[]", Idem("/v1/files", "k", b"digest-2"), owner="t")
        is KEY_REUSED
    )
    assert (
        store.put_file("batch", "b.jsonl", b"[]", Idem("/v1/batches", "k", b"digest-2"), owner="t") != first
    )
    monkeypatch.setattr(file_store, "KEY_TTL_S", -1)  # every key is past its time
    assert store.put_file("batch", "a.jsonl", b"{}", idem, owner="t") != first


def test_racing_retries_with_one_key_create_one_object(store: Store) -> None:
    idem = Idem("/v1/files", "race", b"d")
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda: results.append(store.put_file("batch", "f", b"x", idem, owner="t")))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.id for r in results if isinstance(r, FileObject)}) == 1
    assert len(store.list_files(100, None, None, owner="t")) == 1


def test_state_survives_reopening(reopen: Reopen) -> None:
    store = reopen()
    b = new_batch(store)
    store.start(b.id, [BatchItem(1, "a", b"{}"), BatchItem(2, "b", b"{}")])
    store.put_result(b.id, 1, True, b"{}")
    store.put_file("batch", "k.jsonl", b"{}", Idem("/v1/files", "key", b"d"), owner="t")
    store.close()
    again = reopen()
    assert [i.custom_id for i in again.pending(b.id)] == ["b"]
    assert again.put_file("batch", "other", b"[]", Idem("/v1/files", "key", b"e"), owner="t") is KEY_REUSED
    nxt = again.next_active()
    assert nxt is not None and nxt.id == b.id and nxt.request_counts.completed == 1


def test_pages_are_newest_first_after_a_cursor(store: Store) -> None:
    ids = [new_batch(store, 1).id for _ in range(3)]
    assert [b.id for b in store.list_batches(2, None, owner="t")] == ids[
        ::-1
    ]  # one more than asked: has_more
    assert [b.id for b in store.list_batches(2, ids[1], owner="t")] == [ids[0]]
    assert store.delete_file(store.list_files(1, None, "batch", owner="t")[0].id, owner="t")


def test_every_write_is_on_disk_before_it_is_acknowledged(tmp_path: Path) -> None:
    # synchronous=FULL (2) in WAL: a commit survives power loss, so an acknowledged upload, create or
    # cancel is never rolled back (NORMAL, 1, may lose the last commits)
    store = BatchStore(tmp_path / "batches.sqlite")
    assert store._db.execute("PRAGMA synchronous").fetchone() == (2,)
    assert store._db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    store.close()


def test_result_files_are_written_a_page_at_a_time_not_built_in_memory(store: Store) -> None:
    n, size = 400, 32 * 1024  # 12.5 MiB of results
    b = new_batch(store)
    store.start(b.id, [BatchItem(i, f"r{i}", b"{}") for i in range(1, n + 1)])
    for i in range(1, n + 1):
        store.put_result(b.id, i, True, b"%06d" % i + b"x" * (size - 6))
    tracemalloc.start()
    try:
        done = store.finish(b.id, "completed")
        assert done is not None, f"the batch is no longer active: {store.get_batch(b.id)}"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a page or two of results in Python memory (the next page is read while the last is still held:
    # 4 MiB here), never all of them (12.5 MiB, twice over once joined into one file)
    assert peak < 8 * 2**20
    done = store.get_batch(b.id)
    assert done is not None and done.output_file_id is not None
    ref = store.content_ref(done.output_file_id)
    assert ref is not None and ref.size == n * (size + 1)
    first = store.read_content(ref, 0, 6)
    last = store.read_content(ref, (n - 1) * (size + 1), 6)
    assert (first, last) == (b"000001", b"%06d" % n)
    assert store.read_content(ref, ref.size - 1, 10) == b"\n"


# -- tenants, expiry, pieces: the same on both backends -----------------------------------------


def test_another_tenants_file_and_batch_are_not_found(store: Store) -> None:
    b = new_batch(store)  # owner "t"
    assert store.get_batch(b.id, "t") is not None and store.get_batch(b.id, "u") is None
    assert store.get_file(b.input_file_id, "u") is None and store.content_ref(b.input_file_id, "u") is None
    assert not store.delete_file(b.input_file_id, owner="u")
    assert store.list_files(10, None, None, owner="u") == [] and store.list_batches(10, None, owner="u") == []
    assert store.transition(b.id, "cancelling", owner="u") is None
    assert store.owner_of(b.id) == "t" and store.get_file(b.input_file_id, "t") is not None


def test_an_expired_file_is_gone_at_once_and_the_sweep_deletes_it_with_its_key(reopen: Reopen) -> None:
    now = [1_000_000.0]
    store = reopen(clock=lambda: now[0])
    idem = Idem("/v1/files", "exp", b"d")
    f = store.put_file("batch", "a.jsonl", b"{}", idem, 3600, owner="t")
    kept = store.put_file("batch", "b.jsonl", b"[]", owner="t")
    assert isinstance(f, FileObject) and isinstance(kept, FileObject) and f.expires_at == 1_000_000 + 3600
    now[0] = f.expires_at - 1
    assert store.get_file(f.id) is not None and store.sweep() == 0
    now[0] = f.expires_at
    assert store.get_file(f.id) is None and store.file_content(f.id) is None
    assert [x.id for x in store.list_files(10, None, None, owner="t")] == [kept.id]
    again = store.put_file("batch", "a.jsonl", b"{}", idem, 3600, owner="t")  # the key went with its file
    assert isinstance(again, FileObject) and again.id != f.id
    assert store.sweep() == 1 and store.sweep() == 0  # (the new one lives an hour from the clock's now)
    assert store.get_file(kept.id) is not None


def test_content_is_stored_and_read_in_pieces_across_their_bounds(store: Store) -> None:
    content = bytes(range(256)) * (3 * 2**20 // 256 + 7)  # three 1 MiB pieces and a bit
    f = store.put_file("batch", "big.jsonl", content, owner="t")
    assert isinstance(f, FileObject) and f.bytes == len(content)
    ref = store.content_ref(f.id, "t")
    assert ref is not None and ref.size == len(content)
    for offset, size in ((0, 10), (2**20 - 3, 7), (2 * 2**20 - 1, 2**20 + 2), (len(content) - 4, 100)):
        assert store.read_content(ref, offset, size) == content[offset : offset + size]
    assert store.file_content(f.id) == content
    assert store.delete_file(f.id, owner="t") and store.read_content(ref, 0, 10) is None


def test_racing_creates_of_a_batch_with_one_key_make_one_batch(reopen: Reopen) -> None:
    first = reopen()
    f = first.put_file("batch", "in.jsonl", line("a"), owner="t")
    assert isinstance(f, FileObject)
    req = BatchCreateRequest(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    idem = Idem("/v1/batches", "t\x1fk", b"d")
    stores = [first, reopen(), reopen()]  # (with Redis, three replicas' stores)
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda s=s: results.append(s.create_batch(req, idem, owner="t")))
        for s in stores * 3
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.id for r in results if isinstance(r, Batch)}) == 1 and len(results) == 9
    assert len(first.list_batches(100, None, owner="t")) == 1
    assert first.create_batch(req, Idem("/v1/batches", "t\x1fk", b"other"), owner="t") is KEY_REUSED


def test_racing_results_for_one_line_store_one(store: Store) -> None:
    b = new_batch(store)
    store.start(b.id, [BatchItem(1, "a", b"{}")])
    stored: list[bool] = []
    threads = [
        threading.Thread(target=lambda i=i: stored.append(store.put_result(b.id, 1, i % 2 == 0, b"%d" % i)))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(stored) == [False] * 7 + [True]
    counts = (store.get_batch(b.id) or b).request_counts
    assert counts.completed + counts.failed == 1 and store.pending(b.id) == []
    assert not store.put_result(b.id, 9, True, b"{}")  # no such request: nothing stored
