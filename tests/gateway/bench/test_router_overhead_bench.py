"""`ctxfuse bench gateway --fleet` without wrk: the router it measures, and the bare relay it is
measured beside, relay the instant upstream's recorded answers unchanged, and its chats hold about the
prompt tokens asked for."""

from __future__ import annotations

import json

import httpx

from gateway.bench.router_overhead import chat_body, key_maker, relays, router_rig, sse_events
from gateway.bench.run import ROUTE


def test_the_router_relays_the_upstreams_recorded_answers_and_chats_hold_the_tokens_asked() -> None:
    keys = key_maker()
    plain, streamed = chat_body(keys, 50, False), chat_body(keys, 50, True)
    assert json.loads(streamed.text)["stream"] is True and "\n" not in plain.text
    with router_rig() as rig, httpx.Client(base_url=rig.router.url, timeout=10) as client:
        got = client.post(ROUTE, content=plain.text, headers={"Content-Type": "application/json"})
        assert got.status_code == 200, got.text
        assert got.content == b"".join(rig.plain.chunks)
        assert got.headers["x-ctxfuse-backend"] == "b0"  # it went through the router
        got = client.post(ROUTE, content=streamed.text, headers={"Content-Type": "application/json"})
        assert got.status_code == 200, got.text
        events = sse_events(got.content)
        assert events == sse_events(b"".join(rig.streamed.chunks))
        assert len(events) > 2 and events[-1] == b"data: [DONE]"
        assert all(e.startswith(b"data: ") for e in events)
        assert relays(rig, plain.text, False) and relays(rig, streamed.text, True)
        assert not relays(rig, plain.text, True)  # the check tells the two answers apart
        assert rig.bare is not None  # the floor beside the router relays the same answers
        for body, streaming in ((plain, False), (streamed, True), (chat_body(keys, 2000, True), True)):
            assert relays(rig, body.text, streaming, via=rig.bare.url), streaming
    long = chat_body(keys, 2000, False)
    assert abs(long.prompt_tokens - 2000) <= 200 and len(json.loads(long.text)["messages"]) > 4


def test_the_router_before_an_instant_worker_plans_the_chat_and_answers_its_text() -> None:
    """Behind the engine seam: the router templates and tokenizes the chat itself (a 2,000-token one
    too), the worker's outputs come back as the same answer, whole and streamed."""
    keys = key_maker()
    with router_rig("worker") as rig:
        for size in (50, 2000):
            for streaming in (False, True):
                assert relays(rig, chat_body(keys, size, streaming).text, streaming), (size, streaming)
        assert not relays(rig, chat_body(keys, 50, False).text, True)
