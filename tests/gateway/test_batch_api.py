"""The Batch API end to end: the official `openai` client against a real gateway and the real model,
each gateway over its own data directory. Generated text is kept to a few tokens. (The runner's life
over a data dir, restarts, expiry and its lock, is in test_batch_runner.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from cloud.serving.in_process import InProcessBackend
from gateway.batch.routes import MAX_FILE_BYTES
from gateway.config import GatewayConfig

from .batches import chat_line, client_of, jsonl, lines_of, start, upload, wait
from .conftest import MODEL, Running, run_in_thread


@pytest.fixture(scope="module")
def gw(backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    running = run_in_thread(backend, GatewayConfig(port=0, data_dir=tmp_path_factory.mktemp("batches")))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(gw: Running) -> openai.OpenAI:
    return client_of(gw)


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


def test_an_embeddings_batch_completes_with_vectors_per_custom_id(client: openai.OpenAI) -> None:
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": x},
        }
        for i, x in enumerate(["a red apple", ["two", "inputs"]])
    ]
    lines.append({**lines[0], "custom_id": "bad", "body": {"model": MODEL, "input": ""}})
    done = wait(client, start(client, lines, endpoint="/v1/embeddings").id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    out = {x["custom_id"]: x["response"]["body"] for x in lines_of(client, done.output_file_id)}
    assert [len(out[c]["data"]) for c in ("e-0", "e-1")] == [1, 2]
    assert all(out[c]["object"] == "list" and len(out[c]["data"][0]["embedding"]) == 576 for c in out)
    error = lines_of(client, done.error_file_id)[0]
    assert error["custom_id"] == "bad" and error["response"]["body"]["error"]["param"] == "input"


def test_a_batch_request_with_an_image_runs_through_the_image_pipeline(
    client: openai.OpenAI, vision_files: object
) -> None:
    import base64

    from gateway.bench.edge.pictures import encoded, traffic_light

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
        client.batches.create(input_file_id=file_id, endpoint="/v1/moderations", completion_window="24h")
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
