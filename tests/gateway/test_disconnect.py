"""A client that goes away, streaming or not, aborts its request in the engine at once: nothing keeps
running and every KV block it held is free again."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .conftest import MODEL, Served, wait_idle

LONG_ANSWER = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]


def _running_metric(served: Served) -> float:
    for line in httpx.get(f"{served.url}/metrics").text.splitlines():
        if line.startswith("ctxfuse_requests_running "):
            return float(line.split()[1])
    raise AssertionError("ctxfuse_requests_running missing")


def test_streaming_client_disconnect_aborts_and_frees_blocks(served: Served) -> None:
    wait_idle(served.backend, served.backend.stats().num_free_blocks)
    free = served.backend.stats().num_free_blocks
    body = {"model": MODEL, "messages": LONG_ANSWER, "max_tokens": 1000, "stream": True, "temperature": 0}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{served.base_url}/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
            if seen >= 3:
                break
        assert served.backend.stats().num_running == 1
    took = wait_idle(served.backend, free, timeout=5)
    assert took < 2.0  # far less than the ~1000 tokens it asked for would take
    assert _running_metric(served) == 0


def test_non_streaming_client_disconnect_aborts_and_frees_blocks(served: Served) -> None:
    wait_idle(served.backend, served.backend.stats().num_free_blocks)
    free = served.backend.stats().num_free_blocks
    body = {"model": MODEL, "messages": LONG_ANSWER, "max_tokens": 1000, "temperature": 0}
    errors: list[BaseException] = []

    def call() -> None:
        try:
            httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
        except httpx.ReadTimeout as exc:  # the client gives up and closes its connection
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 5
    while served.backend.stats().num_running == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    t.join(timeout=10)
    assert errors, "the request finished before the client left; make it longer"
    took = wait_idle(served.backend, free, timeout=5)
    assert took < 2.0
    assert _running_metric(served) == 0


@pytest.mark.parametrize("stream", [True, False])
def test_server_serves_normally_after_a_disconnect(served: Served, stream: bool) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "stream": stream,
    }
    r = httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    assert r.text.rstrip().endswith("data: [DONE]") if stream else r.json()["choices"]
