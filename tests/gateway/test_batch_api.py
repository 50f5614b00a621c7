"""The Batch API end to end: the official `openai` client against a real gateway and the real model,
each gateway over its own data directory. Generated text is kept to a few tokens. Also: a batch past
its window expires, and one runner (one gateway process) per data directory."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch

from gateway.backend import InProcessBackend
from gateway.batch_input import BatchItem, parse_batch_input
from gateway.batch_routes import MAX_FILE_BYTES
from gateway.batch_runner import BatchRunner
from gateway.batch_store import BatchStore
from gateway.config import GatewayConfig
from gateway.server import build_server
from gateway.state import Gateway
from shared.batch_protocol import Batch as StoredBatch
from shared.batch_protocol import BatchCreateRequest, FileObject
from shared.dir_lock import DirInUse

from .conftest import MODEL, Running, run_in_thread

DONE = {"completed", "failed", "cancelled", "expired"}


def client_of(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def gw(backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    running = run_in_thread(backend, GatewayConfig(port=0, data_dir=tmp_path_factory.mktemp("batches")))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(gw: Running) -> openai.OpenAI:
    return client_of(gw)


def chat_line(custom_id: str, text: str = "Say hi.", max_tokens: int = 3, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **body},
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def upload(client: openai.OpenAI, lines: list[dict[str, Any]] | bytes, **kw: Any) -> str:
    content = lines if isinstance(lines, bytes) else jsonl(lines)
    return client.files.create(file=("input.jsonl", content), purpose="batch", **kw).id


def start(
    client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions"
) -> Batch:
    file_id = upload(client, lines)
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def wait(client: openai.OpenAI, batch_id: str, until: set[str] = DONE, timeout: float = 30) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch still {batch.status} after {timeout}s: {batch}")
        time.sleep(0.05)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines()]


def test_chat_batch_completes_with_one_real_completion_per_custom_id(client: openai.OpenAI) -> None:
    batch = start(client, [chat_line(f"req-{i}", f"Count to {i}.") for i in range(3)])
    assert batch.status == "validating" and batch.endpoint == "/v1/chat/completions"
    done = wait(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 3, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    out = lines_of(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == ["req-0", "req-1", "req-2"]  # in input order
    for x in out:
        assert x["error"] is None and x["id"].startswith("batch_req_")
        assert x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert 1 <= body["usage"]["completion_tokens"] <= 3
    assert client.files.retrieve(done.output_file_id or "").purpose == "batch_output"


def test_a_batch_request_with_an_image_runs_through_the_image_pipeline(
    client: openai.OpenAI, vision_files: object
) -> None:
    import base64

    from edge.bench.pictures import encoded, traffic_light

    url = "data:image/png;base64," + base64.b64encode(encoded(traffic_light())).decode()
    line = chat_line("img", max_tokens=2)
    line["body"]["messages"] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    bad = chat_line("broken", max_tokens=2)
    bad["body"]["messages"] = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url[:78]}}]}
    ]
    done = wait(client, start(client, [line, bad]).id)
    (out,) = lines_of(client, done.output_file_id)
    assert out["custom_id"] == "img" and out["response"]["status_code"] == 200
    assert out["response"]["body"]["usage"]["prompt_tokens"] > 40  # the image's rendered block is in it
    (err,) = lines_of(client, done.error_file_id)
    assert err["custom_id"] == "broken" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["code"] == "invalid_image"


def test_completions_batch(client: openai.OpenAI) -> None:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": p, "max_tokens": 2},
        }
        for i, p in enumerate(["Once upon", "The sky is"])
    ]
    done = wait(client, start(client, lines, endpoint="/v1/completions").id)
    assert done.status == "completed"
    out = lines_of(client, done.output_file_id)
    assert {x["custom_id"] for x in out} == {"c0", "c1"}
    assert all(x["response"]["body"]["object"] == "text_completion" for x in out)


def test_a_request_the_route_refuses_goes_to_the_error_file(client: openai.OpenAI) -> None:
    lines = [chat_line("good"), chat_line("bad", max_tokens=0), chat_line("other-model", model="gpt-x")]
    done = wait(client, start(client, lines).id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    assert [x["custom_id"] for x in lines_of(client, done.output_file_id)] == ["good"]
    errors = {x["custom_id"]: x["response"] for x in lines_of(client, done.error_file_id)}
    assert errors["bad"]["status_code"] == 400 and errors["bad"]["body"]["error"]["param"] == "max_tokens"
    assert errors["other-model"]["status_code"] == 404


def test_bad_lines_fail_the_batch_naming_each_line(client: openai.OpenAI) -> None:
    good = json.dumps(chat_line("a")).encode()
    wrong_url = json.dumps({**chat_line("c"), "url": "/v1/completions"}).encode()
    content = b"\n".join([good, b"{not json", good, wrong_url, b'{"custom_id": "d", "method": "POST"}'])
    file_id = upload(client, content)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait(client, batch.id)
    assert done.status == "failed" and done.failed_at and done.errors and done.errors.data
    assert [(e.line, e.code) for e in done.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_url"),
        (5, "invalid_request"),
    ]
    assert done.output_file_id is None and done.request_counts and done.request_counts.total == 0


def test_refusals_name_the_field(client: openai.OpenAI, gw: Running) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert exc.value.body["param"] == "purpose"  # type: ignore[index]
    file_id = upload(client, [chat_line("a")])
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    assert exc.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    r = httpx.post(f"{gw.url}/v1/files", content=b"not a form", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_cancel_stops_the_batch_and_a_done_batch_cannot_be_cancelled(client: openai.OpenAI) -> None:
    batch = start(client, [chat_line(f"r{i}", max_tokens=48) for i in range(12)])
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.request_counts is not None
    assert done.request_counts.completed + done.request_counts.failed < 12
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: the same answer
    finished = wait(client, start(client, [chat_line("x")]).id)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(finished.id)


def test_list_is_newest_first_with_a_cursor(client: openai.OpenAI) -> None:
    first, second = start(client, [chat_line("l1")]), start(client, [chat_line("l2")])
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    after = client.batches.list(limit=1, after=second.id)
    assert [b.id for b in after.data] == [first.id]
    files = client.files.list(purpose="batch")
    assert first.input_file_id in {f.id for f in files.data}
    wait(client, first.id), wait(client, second.id)


def test_uploads_may_exceed_the_json_body_limit_up_to_the_file_limit(client: openai.OpenAI) -> None:
    big = b"{}\n" * (9 * 2**20)  # 27 MiB: over the gateway's 16 MiB JSON body limit
    assert client.files.retrieve(upload(client, big)).bytes == len(big)
    with pytest.raises(openai.APIStatusError) as exc:
        upload(client, b"{}\n" * (MAX_FILE_BYTES // 3 + 2**20))
    assert exc.value.status_code == 413


def test_interactive_requests_go_first(client: openai.OpenAI) -> None:
    batch = start(client, [chat_line(f"s{i}", max_tokens=48) for i in range(8)])
    wait(client, batch.id, until={"in_progress"})
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert answer.choices[0].message.content is not None
    assert client.batches.retrieve(batch.id).status == "in_progress"  # not stuck behind the batch
    client.batches.cancel(batch.id)
    wait(client, batch.id)


def test_file_delete(client: openai.OpenAI) -> None:
    file_id = upload(client, [chat_line("d")])
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def test_idempotency_key_replays_the_first_result_and_refuses_a_different_body(
    client: openai.OpenAI,
) -> None:
    key = {"Idempotency-Key": "file-key-1"}
    content = jsonl([chat_line("i1"), chat_line("i2")])
    file_id = upload(client, content, extra_headers=key)
    assert upload(client, content, extra_headers=key) == file_id
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        upload(client, jsonl([chat_line("other")]), extra_headers=key)
    assert exc.value.body == {  # type: ignore[comparison-overlap]
        "message": exc.value.body["message"],  # type: ignore[index]
        "type": "invalid_request_error",
        "param": None,
        "code": "idempotency_key_reused",
    }
    before = len(client.batches.list(limit=100).data)
    args: Any = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    bkey = {"Idempotency-Key": "batch-key-1"}
    first = client.batches.create(**args, extra_headers=bkey)
    again = client.batches.create(**args, extra_headers=bkey)
    assert again.id == first.id
    with pytest.raises(openai.UnprocessableEntityError):
        client.batches.create(**args, metadata={"x": "y"}, extra_headers=bkey)
    done = wait(client, first.id)
    assert len(client.batches.list(limit=100).data) == before + 1  # one batch made
    assert [x["custom_id"] for x in lines_of(client, done.output_file_id)] == ["i1", "i2"]  # run once
    assert client.batches.create(**args, extra_headers=bkey).status == "completed"  # still the first


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
        f = store.put_file("batch", "in.jsonl", jsonl([chat_line(f"e{i}") for i in range(n)]))
        assert isinstance(f, FileObject)
        req = BatchCreateRequest(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = store.create_batch(req)
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
    gateway = Gateway(backend, GatewayConfig(port=0, data_dir=tmp_path))
    runner = BatchRunner(gateway, path, clock=lambda: after_window)
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
    gateway = Gateway(backend, GatewayConfig(port=0, data_dir=tmp_path))
    first, second = BatchRunner(gateway, path), BatchRunner(gateway, path)

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
