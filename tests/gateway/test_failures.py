"""Failures the real engine will not produce on demand, through a scripted backend on a real server:
an engine error mid-stream, a full queue, a missing API key, a draining server."""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from cloud.serving.in_process import InProcessBackend
from gateway.config import GatewayConfig

from .conftest import Running, run_in_thread
from .fake_backend import FakeBackend, out

HI = [{"role": "user", "content": "hi"}]
KEY = "sekret-key"


@pytest.fixture(scope="module")
def fake(backend: InProcessBackend) -> FakeBackend:
    return FakeBackend(backend.tokenizer)


@pytest.fixture(scope="module")
def fake_server(fake: FakeBackend) -> Iterator[Running]:
    running = run_in_thread(fake, GatewayConfig(port=0))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def keyed_server(fake: FakeBackend) -> Iterator[Running]:
    running = run_in_thread(fake, GatewayConfig(port=0, api_key=KEY))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def content_server(fake: FakeBackend) -> Iterator[Running]:
    running = run_in_thread(fake, GatewayConfig(port=0, log_content=True))
    yield running
    running.stop()


def client(url: str, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=10)


def test_engine_error_after_first_byte_is_an_error_event_not_done(
    fake: FakeBackend, fake_server: Running
) -> None:
    fake.script = [out("Hel"), out("", finish="error", error="engine error: RuntimeError: boom")]
    body = {"model": "fake", "messages": HI, "stream": True}
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert '"content":"Hel"' in events[-2]
    assert events[-1].startswith('data: {"error":') and "boom" in events[-1]
    assert "[DONE]" not in r.text
    assert fake.generations[-1].closed
    with pytest.raises(openai.APIError, match="boom"):
        for _ in client(fake_server.url).chat.completions.create(model="fake", messages=HI, stream=True):  # type: ignore[arg-type]
            pass


def test_engine_error_without_streaming_is_a_500_server_error(
    fake: FakeBackend, fake_server: Running
) -> None:
    fake.script = [out("Hel"), out("", finish="error", error="engine error: boom")]
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json={"model": "fake", "messages": HI})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert fake.generations[-1].closed


def test_full_queue_is_429_with_retry_after(fake: FakeBackend, fake_server: Running) -> None:
    fake.queue_full = True
    try:
        for path, body in [
            ("/v1/chat/completions", {"model": "fake", "messages": HI}),
            ("/v1/chat/completions", {"model": "fake", "messages": HI, "stream": True}),
            ("/v1/completions", {"model": "fake", "prompt": "hi"}),
        ]:
            r = httpx.post(f"{fake_server.url}{path}", json=body)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client(fake_server.url).chat.completions.create(model="fake", messages=HI)  # type: ignore[arg-type]
    finally:
        fake.queue_full = False


def test_api_key_is_required_on_api_routes_only(fake: FakeBackend, keyed_server: Running) -> None:
    fake.script = [out("ok", finish="stop")]
    url = keyed_server.url
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}]:
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").models.list()
    assert [m.id for m in client(url, KEY).models.list().data] == ["fake"]
    answer = client(url, KEY).chat.completions.create(model="fake", messages=HI)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "ok"
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
    for open_path in ["/health", "/ready", "/metrics"]:
        assert httpx.get(f"{url}{open_path}").status_code == 200


def test_draining_server_is_not_ready_and_refuses_new_work(fake_server: Running) -> None:
    gateway = fake_server.server.gateway
    gateway.draining = True
    try:
        assert httpx.get(f"{fake_server.url}/ready").status_code == 503
        r = httpx.post(f"{fake_server.url}/v1/chat/completions", json={"model": "fake", "messages": HI})
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert httpx.get(f"{fake_server.url}/health").status_code == 200
    finally:
        gateway.draining = False
    assert httpx.get(f"{fake_server.url}/ready").status_code == 200


def _request_log(url: str, body: dict[str, Any]) -> MutableMapping[str, Any]:
    """The log line the gateway writes for one chat request (written just after the response)."""
    with capture_logs() as logs:
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
        deadline = time.monotonic() + 5
        while not any(e.get("event") == "request" for e in logs) and time.monotonic() < deadline:
            time.sleep(0.01)
    (entry,) = [e for e in logs if e.get("event") == "request"]
    assert entry["request_id"] == r.headers["x-request-id"]
    return entry


@pytest.mark.parametrize("stream", [False, True])
def test_request_log_has_id_and_usage_but_no_content_by_default(
    fake: FakeBackend, fake_server: Running, stream: bool
) -> None:
    fake.script = [out("secret answer", finish="stop")]
    body = {"model": "fake", "messages": [{"role": "user", "content": "secret prompt"}], "stream": stream}
    entry = _request_log(fake_server.url, body)
    assert entry["status"] == 200 and entry["completion_tokens"] == 1 and entry["prompt_tokens"] == 3
    assert "secret" not in repr(entry)


def test_log_content_puts_prompt_and_completion_in_the_log(
    fake: FakeBackend, content_server: Running
) -> None:
    fake.script = [out("secret answer", finish="stop")]
    body = {"model": "fake", "messages": [{"role": "user", "content": "secret prompt"}]}
    entry = _request_log(content_server.url, body)
    assert entry["prompt"] == [{"role": "user", "content": "secret prompt"}]
    assert entry["completion"] == ["secret answer"]
