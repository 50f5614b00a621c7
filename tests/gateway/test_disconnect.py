"""A client that goes away, streaming or not, aborts its request in the engine: the engine ends it
with finish reason "abort" before it has generated what it asked for, and every KV block it held is
free again. (How fast that happens is a timing, not a behaviour: it is not asserted here.)"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from shared.engine_types import RequestOutput

from .conftest import MODEL, Served, wait_idle

LONG_ANSWER = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]
MAX_TOKENS = 1000
# Liveness only: how long to wait for an event before calling the test hung. Never a speed bound.
HANG_GUARD_S = 120.0


@dataclass
class Aborts:
    """What the engine core returned for each abort it applied, recorded on the engine thread."""

    outputs: list[RequestOutput] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)  # some abort ended a request


@pytest.fixture()
def aborts(served: Served, monkeypatch: pytest.MonkeyPatch) -> Iterator[Aborts]:
    core = served.backend.engine.core
    wait_idle(served.backend, core.stats().num_blocks, timeout=HANG_GUARD_S)  # nothing earlier still runs
    real_abort = core.abort
    seen = Aborts()

    def recording_abort(request_id: str) -> list[RequestOutput]:
        outs = real_abort(request_id)
        seen.outputs.extend(outs)
        if outs:
            seen.ended.set()
        return outs

    monkeypatch.setattr(core, "abort", recording_abort)
    yield seen


def _running_metric(served: Served) -> float:
    for line in httpx.get(f"{served.url}/metrics").text.splitlines():
        if line.startswith("ctxfuse_requests_running "):
            return float(line.split()[1])
    raise AssertionError("ctxfuse_requests_running missing")


def _assert_aborted_short_and_freed(served: Served, aborts: Aborts) -> None:
    assert aborts.ended.wait(HANG_GUARD_S), "the engine never aborted the request"
    [out] = aborts.outputs  # one request, one choice, aborted once
    assert out.finished and out.finish_reason == "abort"  # not "length": it did not run to the end
    assert out.num_output_tokens < MAX_TOKENS
    # every block it held is free again
    wait_idle(served.backend, served.backend.stats().num_blocks, timeout=HANG_GUARD_S)
    assert _running_metric(served) == 0


def test_streaming_client_disconnect_aborts_and_frees_blocks(served: Served, aborts: Aborts) -> None:
    body = {
        "model": MODEL,
        "messages": LONG_ANSWER,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "temperature": 0,
    }
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
        assert not aborts.outputs  # still running while the client reads
    _assert_aborted_short_and_freed(served, aborts)


def test_non_streaming_client_disconnect_aborts_and_frees_blocks(served: Served, aborts: Aborts) -> None:
    body = {"model": MODEL, "messages": LONG_ANSWER, "max_tokens": MAX_TOKENS, "temperature": 0}
    conn = http.client.HTTPConnection("127.0.0.1", served.server.bound_port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        # leave once the engine is generating the answer: an event, not a client timeout
        deadline = time.monotonic() + HANG_GUARD_S
        while served.backend.stats().num_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        assert not aborts.outputs
    finally:
        conn.close()  # the client goes away without reading its response
    _assert_aborted_short_and_freed(served, aborts)


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
