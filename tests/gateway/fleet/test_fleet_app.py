"""The router is the gateway's one app over another upstream: what the app does before an answer
is made (draining, readiness, health) holds through the router exactly as over an engine."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from .openai_stub import StubServer
from .stub_fleet import Running, fleet_of, run_fleet

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def router() -> Iterator[tuple[Running, StubServer]]:
    stub = StubServer("a")
    running = run_fleet(fleet_of(stub))
    yield running, stub
    running.stop()  # type: ignore[operator]
    stub.stop()


def test_a_draining_router_is_not_ready_and_forwards_nothing(router: tuple[Running, StubServer]) -> None:
    running, stub = router
    assert (
        httpx.post(f"{running.url}/v1/chat/completions", json={"model": "stub", "messages": HI}).status_code
        == 200
    )
    seen = len(stub.behaviour.seen)
    running.gateway.draining = True  # as SIGTERM sets it
    try:
        assert httpx.get(f"{running.url}/ready").status_code == 503
        r = httpx.post(f"{running.url}/v1/chat/completions", json={"model": "stub", "messages": HI})
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert len(stub.behaviour.seen) == seen  # the backend never heard of it
        assert httpx.get(f"{running.url}/health").status_code == 200  # draining is not dead
    finally:
        running.gateway.draining = False
    assert httpx.get(f"{running.url}/ready").status_code == 200


def test_the_router_serves_the_gateways_openapi_document(router: tuple[Running, StubServer]) -> None:
    running, _ = router
    paths = httpx.get(f"{running.url}/schema/openapi.json").json()["paths"]
    # the OpenAI routes, the Batch API and the router's own view, from the one app
    assert {"/v1/chat/completions", "/v1/batches", "/v1/files", "/fleet/v1/backends"} <= set(paths)


def test_the_router_sends_each_request_to_a_backend_serving_its_model() -> None:
    alpha, beta = StubServer("a"), StubServer("b")
    alpha.behaviour.models, beta.behaviour.models = ("alpha",), ("beta", "beta-alias")
    running = run_fleet(fleet_of(alpha, beta))
    try:
        for model, backend in (("alpha", "a"), ("beta", "b"), ("beta-alias", "b")) * 3:
            r = httpx.post(f"{running.url}/v1/chat/completions", json={"model": model, "messages": HI})
            assert r.status_code == 200 and r.headers["x-ctxfuse-backend"] == backend
        seen = len(alpha.behaviour.seen) + len(beta.behaviour.seen)
        r = httpx.post(f"{running.url}/v1/chat/completions", json={"model": "gamma", "messages": HI})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "alpha, beta, beta-alias" in r.json()["error"]["message"]
        assert len(alpha.behaviour.seen) + len(beta.behaviour.seen) == seen  # nothing forwarded
    finally:
        running.stop()  # type: ignore[operator]
        alpha.stop()
        beta.stop()
