"""The fleet gateway over OpenAI-compatible servers that are not ours (small stub servers on
loopback): routing, failover before the first byte, an SSE error event after it, the circuit, text
affinity, and the canary's automatic rollback."""

from __future__ import annotations

import contextlib
import time

import httpx
import openai
import pytest

from gateway.backends.fleet.canary import CanaryPolicy

from .openai_stub import StubServer
from .stub_fleet import fleet_of, run_fleet


def ask(client: openai.OpenAI, text: str = "hello") -> str:
    r = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": text}])
    return r.choices[0].message.content or ""


def test_a_foreign_server_is_found_out_and_routed_to(stubs: tuple[StubServer, StubServer]) -> None:
    fleet = run_fleet(fleet_of(*stubs))
    try:
        assert {b.kind for b in fleet.fleet.backends} == {"openai"}
        answers = {ask(fleet.client()) for _ in range(20)}
        assert answers == {"a", "b"}  # equal backends share the traffic: ties never go to the first
        view = httpx.get(f"{fleet.url}/fleet/v1/backends").json()
        assert [b["kind"] for b in view["backends"]] == ["openai", "openai"]
    finally:
        fleet.stop()  # type: ignore[operator]


def test_a_failing_backend_costs_no_request_and_its_circuit_opens_then_closes(
    stubs: tuple[StubServer, StubServer],
) -> None:
    a, b = stubs
    a.behaviour.fail = True
    fleet = run_fleet(fleet_of(a, b))
    try:
        assert all(ask(fleet.client()) == "b" for _ in range(10))  # every one retried onto b
        backend_a = next(x for x in fleet.fleet.backends if x.name == "a")
        assert backend_a.circuit.state in ("open", "half_open")
        assert "ctxfuse_routing_retries_total" in fleet.metrics()
        a.behaviour.fail = False
        deadline = time.monotonic() + 10
        while backend_a.circuit.state != "closed":  # after the cool-down, a request is the probe
            ask(fleet.client())
            assert time.monotonic() < deadline, backend_a.circuit.state
            time.sleep(0.1)
        assert "a" in {ask(fleet.client()) for _ in range(20)}
    finally:
        fleet.stop()  # type: ignore[operator]


def test_a_stopped_backend_costs_no_request(stubs: tuple[StubServer, StubServer]) -> None:
    a, b = stubs
    fleet = run_fleet(fleet_of(a, b))
    try:
        a.stop()
        assert all(ask(fleet.client()) == "b" for _ in range(10))
    finally:
        fleet.stop()  # type: ignore[operator]


def test_a_stream_that_breaks_after_its_first_byte_ends_with_an_error_event(
    stubs: tuple[StubServer, StubServer],
) -> None:
    a, b = stubs
    a.behaviour.break_stream = b.behaviour.break_stream = True
    fleet = run_fleet(fleet_of(a, b))
    try:
        r = httpx.post(
            f"{fleet.url}/v1/chat/completions",
            json={"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            timeout=30,
        )
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert '"content"' in events[0]  # the first event got through
        assert '"error"' in events[-1] and "mid-stream" in events[-1]
        assert "[DONE]" not in r.text
        stream = fleet.client().chat.completions.create(
            model="stub", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError):
            list(stream)
    finally:
        fleet.stop()  # type: ignore[operator]


def test_requests_sharing_a_long_prefix_stay_on_one_backend(stubs: tuple[StubServer, StubServer]) -> None:
    fleet = run_fleet(fleet_of(*stubs))
    document = "The lease runs for ten years and renews itself unless a party objects. " * 100
    try:
        first = ask(fleet.client(), f"{document}\nQuestion 0")
        assert all(ask(fleet.client(), f"{document}\nQuestion {i}") == first for i in range(1, 12))
        assert 'ctxfuse_routing_decisions_total{decision="affinity_hit"} 11.0' in fleet.metrics()
    finally:
        fleet.stop()  # type: ignore[operator]


def test_a_canary_that_fails_is_rolled_back_and_a_pin_still_reaches_it(
    stubs: tuple[StubServer, StubServer],
) -> None:
    stable, canary = stubs
    canary.behaviour.fail = True
    policy = CanaryPolicy(error_rate=0.05, latency_ratio=3.0, window_s=60, min_requests=5)
    config = fleet_of(stable, canary, versions=("v1", "v2"), weights=(60, 40), canary=policy, max_attempts=1)
    fleet = run_fleet(config, seed=1)
    try:
        # Until the verdict: once the canary's circuit opens it sees one probe per cool-down, so how many
        # requests reach it in a given count of asks depends on the machine's speed. The deadline only
        # guards against a hang.
        deadline = time.monotonic() + 60
        while fleet.fleet.canary.weights["v2"] != 0:
            assert time.monotonic() < deadline, fleet.fleet.canary.state("v2")
            with contextlib.suppress(openai.APIError):  # one attempt: the canary's failures reach the client
                ask(fleet.client())
        assert fleet.fleet.canary.state("v2") == "rolled_back"
        assert all(ask(fleet.client()) == "a" for _ in range(10))
        m = fleet.metrics()
        assert 'ctxfuse_canary_rollbacks_total{version="v2"} 1.0' in m
        assert 'ctxfuse_canary_state{version="v2"} 2.0' in m
        r = httpx.post(
            f"{fleet.url}/v1/chat/completions",
            json={"model": "stub", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Context-Version": "v9"},
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"
    finally:
        fleet.stop()  # type: ignore[operator]


def test_a_pinned_version_goes_to_its_backends(stubs: tuple[StubServer, StubServer]) -> None:
    fleet = run_fleet(fleet_of(*stubs, versions=("v1", "v2"), weights=(90, 10)))
    try:
        client = openai.OpenAI(
            base_url=f"{fleet.url}/v1",
            api_key="x",
            max_retries=0,
            default_headers={"X-Context-Version": "v2"},
        )
        assert all(ask(client) == "b" for _ in range(10))
    finally:
        fleet.stop()  # type: ignore[operator]


def test_a_bad_body_is_the_gateways_400_not_a_backends(stubs: tuple[StubServer, StubServer]) -> None:
    fleet = run_fleet(fleet_of(*stubs))
    try:
        r = httpx.post(f"{fleet.url}/v1/chat/completions", json={"model": "stub", "messages": "nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert not stubs[0].behaviour.seen and not stubs[1].behaviour.seen
    finally:
        fleet.stop()  # type: ignore[operator]
