"""Two gateways over one Redis and one engine, as two replicas behind a load balancer: what one
stores the other serves. Keys made in Redis are honoured by both; a conversation begun on one continues
on the other (`previous_response_id`), is retrievable and deletable there, and stays invisible to
another tenant; a gateway whose Redis cannot be reached refuses keyed work with a 503."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from gateway.access.keys_redis import RedisKeyStore
from gateway.shared_state.redis_link import RedisLink
from tests.redis_rig import unreachable_url

from .conftest import GATEWAY, MODEL, Running, run_in_thread

GREEDY = {"model": MODEL, "temperature": 0.0}


@pytest.fixture
def replicas(backend, redis_url: str, tmp_path: Path) -> Iterator[tuple[Running, Running]]:  # type: ignore[no-untyped-def]
    a = run_in_thread(backend, replace(GATEWAY, data_dir=tmp_path / "a", redis_url=redis_url))
    b = run_in_thread(backend, replace(GATEWAY, data_dir=tmp_path / "b", redis_url=redis_url))
    yield a, b
    a.stop()
    b.stop()


def _client(running: Running, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_a_conversation_begun_on_one_replica_continues_on_the_other(
    replicas: tuple[Running, Running], redis_url: str
) -> None:
    keys = RedisKeyStore(RedisLink(redis_url))
    _, acme = keys.create("acme")
    _, globex = keys.create("globex")
    on_a, on_b = _client(replicas[0], acme), _client(replicas[1], acme)
    first = on_a.responses.create(input="Name a colour.", max_output_tokens=3, **GREEDY)
    assert on_b.responses.retrieve(first.id).output_text == first.output_text
    second = on_b.responses.create(
        input="And another?", previous_response_id=first.id, max_output_tokens=3, **GREEDY
    )
    items = [i.type for i in on_a.responses.input_items.list(second.id).data]
    assert items.count("message") >= 3  # first input, its answer, the new input
    with pytest.raises(openai.NotFoundError):
        _client(replicas[1], globex).responses.retrieve(first.id)
    on_b.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        on_a.responses.retrieve(first.id)


def test_a_response_not_stored_on_one_replica_is_a_clear_400_on_the_other(
    replicas: tuple[Running, Running], redis_url: str
) -> None:
    _, acme = RedisKeyStore(RedisLink(redis_url)).create("acme")
    r = _client(replicas[0], acme).responses.create(input="Hi", max_output_tokens=1, store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        _client(replicas[1], acme).responses.create(
            input="And?", previous_response_id=r.id, max_output_tokens=1, **GREEDY
        )


def test_a_gateway_whose_redis_is_unreachable_refuses_keyed_work_with_503(backend, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    running = run_in_thread(backend, replace(GATEWAY, data_dir=tmp_path, redis_url=unreachable_url()))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        answer = httpx.post(
            f"{running.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer cfk_0123456789ab_" + "x" * 43},
            timeout=60,
        )
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "service_unavailable"
        assert "Redis" in answer.json()["error"]["message"]
        assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200
    finally:
        running.stop()
