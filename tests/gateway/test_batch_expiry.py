"""Files expire as OpenAI's do: `expires_after` on an upload, `output_expires_after` on a batch for its
output and error files, and `--file-ttl-days` for files that set none. An expired file is gone from
its expiry on (404, out of lists, unusable as a batch's input) and the runner's sweep deletes it.

Time passes through an injected clock (the runner's, which its store reads), never by sleeping: the
gateway tests move the clock of a real gateway; the store tests give the store their own."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cloud.serving.in_process import InProcessBackend
from ctxfuse.cli import build_parser
from gateway.batch.executor import Answer
from gateway.batch.files import Idem
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.config import GatewayConfig
from shared.batch_protocol import Batch, BatchCreateRequest, ExpiresAfter, FileObject

from .batches import BAD_EXPIRES_AFTER, chat_line, client_of, jsonl, lines_of, upload, wait
from .conftest import Running, run_in_thread

HOUR = 3600


class Clock:
    """Seconds since the epoch: the real time until a test sets `at`."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self) -> float:
        return time.time() if self.at is None else self.at


@pytest.fixture(scope="module")
def gw(backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    running = run_in_thread(backend, GatewayConfig(port=0, data_dir=tmp_path_factory.mktemp("expiry")))
    yield running
    running.stop()


@pytest.fixture
def clock(gw: Running) -> Iterator[Clock]:
    """The gateway's clock, for one test (back to the real time after it)."""
    runner = gw.server.gateway.batches
    assert runner is not None
    clock = Clock()
    runner.clock = clock
    yield clock
    clock.at = None


@pytest.fixture(scope="module")
def client(gw: Running) -> openai.OpenAI:
    return client_of(gw)


def test_an_upload_with_expires_after_shows_expires_at_and_is_gone_from_then_on(
    client: openai.OpenAI, clock: Clock
) -> None:
    content = jsonl([chat_line("a")])
    f = client.files.create(
        file=("in.jsonl", content), purpose="batch", expires_after={"anchor": "created_at", "seconds": HOUR}
    )
    kept = client.files.create(file=("kept.jsonl", content), purpose="batch")
    assert f.expires_at == f.created_at + HOUR and kept.expires_at is None  # OpenAI's default: kept
    assert client.files.retrieve(f.id).expires_at == f.expires_at

    clock.at = f.expires_at - 1  # the last second it lives
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == content
    assert f.id in {x.id for x in client.files.list()}

    clock.at = f.expires_at
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError) as err:
            call(f.id)
        assert err.value.param == "file_id"
    listed = {x.id for x in client.files.list()}
    assert f.id not in listed and kept.id in listed
    with pytest.raises(openai.NotFoundError) as err:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert err.value.param == "input_file_id"


@pytest.mark.parametrize(("fields", "param"), BAD_EXPIRES_AFTER)
def test_a_bad_expires_after_on_an_upload_is_a_400_naming_it_and_stores_nothing(
    gw: Running, client: openai.OpenAI, fields: dict[str, str], param: str
) -> None:
    before = len(client.files.list().data)
    r = httpx.post(
        f"{gw.url}/v1/files",
        data={"purpose": "batch", **fields},
        files={"file": ("in.jsonl", jsonl([chat_line("a")]))},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert len(client.files.list().data) == before


def test_the_openai_client_gets_the_400_for_seconds_out_of_range(client: openai.OpenAI) -> None:
    for seconds in (HOUR - 1, 30 * 24 * HOUR + 1):
        with pytest.raises(openai.BadRequestError) as err:
            client.files.create(
                file=("in.jsonl", b"{}\n"),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": seconds},
            )
        assert err.value.param == "expires_after[seconds]"
    file_id = upload(client, [chat_line("a")])
    for expiry, param in (
        ({"anchor": "created_at", "seconds": 60}, "output_expires_after.seconds"),
        ({"anchor": "now", "seconds": HOUR}, "output_expires_after.anchor"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(
                input_file_id=file_id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                output_expires_after=expiry,  # type: ignore[arg-type]
            )
        assert err.value.param == param


def test_a_batchs_output_and_error_files_carry_output_expires_after(client: openai.OpenAI) -> None:
    file_id = upload(client, [chat_line("good"), chat_line("bad", max_tokens=0)])
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 2 * HOUR},
    )
    done = wait(client, batch.id)
    assert done.status == "completed" and done.output_file_id and done.error_file_id
    for result_id in (done.output_file_id, done.error_file_id):
        f = client.files.retrieve(result_id)
        assert f.expires_at == f.created_at + 2 * HOUR  # anchored at the file's own creation
    assert [x["custom_id"] for x in lines_of(client, done.output_file_id)] == ["good"]
    assert client.files.retrieve(file_id).expires_at is None  # the input keeps its own lifetime


# -- the store and the runner, with their own clock --------------------------------------------


def _rows(path: Path, sql: str) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute(sql).fetchone()[0])
    finally:
        db.close()


def test_the_sweep_deletes_expired_files_and_frees_their_space(tmp_path: Path) -> None:
    path, clock = tmp_path / "batches.sqlite", Clock()
    clock.at = 1_000_000.0
    store = BatchStore(path, clock)
    idem = Idem("/v1/files", "t\x1fk", b"digest")
    big = store.put_file("batch", "big.jsonl", b"x" * 4 * 2**20, idem, HOUR, owner="t")
    later = store.put_file("batch", "later.jsonl", b"{}", None, 2 * HOUR, owner="t")
    kept = store.put_file("batch", "kept.jsonl", b"{}", owner="t")
    assert isinstance(big, FileObject) and isinstance(later, FileObject) and isinstance(kept, FileObject)
    pages = _rows(path, "PRAGMA page_count")

    clock.at += HOUR - 1
    assert store.sweep() == 0 and store.get_file(big.id) is not None

    clock.at += 1  # big has expired: hidden at once, its row still there until the sweep
    assert store.get_file(big.id) is None and store.file_content(big.id) is None
    assert store.content_ref(big.id) is None and not store.delete_file(big.id, owner="t")
    assert [f.id for f in store.list_files(10, None, None, owner="t")] == [kept.id, later.id]
    assert _rows(path, "SELECT COUNT(*) FROM files") == 3
    assert store.sweep() == 1
    assert _rows(path, "SELECT COUNT(*) FROM files") == 2
    assert _rows(path, "SELECT COUNT(*) FROM idempotency") == 0  # the key went with its file
    assert pages - _rows(path, "PRAGMA page_count") >= 4 * 2**20 // _rows(path, "PRAGMA page_size")

    clock.at += HOUR
    assert store.sweep() == 1 and store.get_file(kept.id) is not None
    store.close()


def test_a_key_naming_an_expired_file_makes_a_new_one(tmp_path: Path) -> None:
    clock = Clock()
    clock.at = 1_000_000.0
    store = BatchStore(tmp_path / "batches.sqlite", clock)
    idem = Idem("/v1/files", "t\x1fk", b"digest")
    first = store.put_file("batch", "a.jsonl", b"{}", idem, HOUR, owner="t")
    assert isinstance(first, FileObject)
    assert store.put_file("batch", "a.jsonl", b"{}", idem, HOUR, owner="t") == first  # a replay
    clock.at += HOUR  # expired, not yet swept
    again = store.put_file("batch", "a.jsonl", b"{}", idem, HOUR, owner="t")
    assert isinstance(again, FileObject) and again.id != first.id and again.expires_at == clock.at + HOUR
    store.close()


def test_the_default_lifetime_applies_to_files_that_set_none(tmp_path: Path) -> None:
    config = GatewayConfig(file_ttl_days=2)
    assert config.file_ttl_s == 2 * 24 * HOUR and GatewayConfig().file_ttl_s is None
    args = build_parser().parse_args(["serve", "--file-ttl-days", "2"])
    assert args.file_ttl_days == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--file-ttl-days", "-1"])
    store = BatchStore(tmp_path / "batches.sqlite", default_ttl_s=config.file_ttl_s)
    plain = store.put_file("batch", "a.jsonl", b"{}", owner="t")
    own = store.put_file("batch", "b.jsonl", b"{}", None, HOUR, owner="t")
    assert isinstance(plain, FileObject) and isinstance(own, FileObject)
    assert plain.expires_at == plain.created_at + 2 * 24 * HOUR and own.expires_at == own.created_at + HOUR
    store.close()


async def _not_called(endpoint: str, raw: bytes, rid: str, priority: int, owner: str) -> Answer:
    raise AssertionError("no request should run")


async def _until(runner: BatchRunner, done: object, timeout_s: float = 20) -> None:
    """Start the runner and wait until `done()` holds (the timeout is a hang guard only)."""
    await runner.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not done():  # type: ignore[operator]
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    finally:
        await runner.stop()


def test_the_runner_sweeps_expired_files_when_it_starts(tmp_path: Path) -> None:
    path = tmp_path / "batches.sqlite"
    store = BatchStore(path)
    f = store.put_file("batch", "a.jsonl", b"{}", None, HOUR, owner="t")
    store.close()
    assert isinstance(f, FileObject) and f.expires_at is not None
    runner = BatchRunner(_not_called, path, clock=lambda: float(f.expires_at or 0))
    asyncio.run(_until(runner, lambda: _rows(path, "SELECT COUNT(*) FROM files") == 0))


def test_a_batch_whose_input_expired_before_it_ran_fails_validation_saying_so(tmp_path: Path) -> None:
    path = tmp_path / "batches.sqlite"
    store = BatchStore(path)
    f = store.put_file("batch", "in.jsonl", jsonl([chat_line("a")]), None, HOUR, owner="t")
    assert isinstance(f, FileObject) and f.expires_at is not None
    req = BatchCreateRequest(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after=ExpiresAfter(anchor="created_at", seconds=HOUR),
    )
    b = store.create_batch(req, owner="t")
    store.close()
    assert isinstance(b, Batch)
    runner = BatchRunner(_not_called, path, clock=lambda: float(f.expires_at or 0))

    def failed() -> bool:
        got = runner.store.get_batch(b.id)
        return got is not None and got.status == "failed"

    asyncio.run(_until(runner, failed))
    store = BatchStore(path)
    done = store.get_batch(b.id)
    store.close()
    assert done is not None and done.errors is not None
    (error,) = done.errors.data
    assert (error.code, error.param) == ("invalid_file", "input_file_id")
    assert f.id in error.message and "expired" in error.message
