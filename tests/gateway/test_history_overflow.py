"""A chat too long for the context under `--context-overflow drop_old_turns`, through the real gateway
and engine: the oldest turns are dropped (the fewest that make room for max_tokens), the system
prompt and the latest question kept, and usage says how many tokens and messages went, whole and
streamed. The Responses API's truncation asks for the same per request ("auto") or refuses ("disabled")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import msgspec
import openai
import pytest
from prometheus_client import CollectorRegistry

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.model.text_side import describe_text_side
from cloud.serving.in_process import InProcessBackend
from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.engine import FleetEngine
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.metrics import FleetMetrics
from gateway.openai.chat import plan_chat
from shared.protocol import ChatCompletionRequest

from .conftest import ENGINE, GATEWAY, MODEL, Served, run_in_thread

LIMIT = 256
MAX_TOKENS = 8
SYSTEM = {"role": "system", "content": "You answer in one word."}


@pytest.fixture(scope="module")
def dropping(loaded_model: LoadedModel) -> Iterator[Served]:
    config = replace(ENGINE, kv_cache_memory_gib=0.05, max_model_len=LIMIT, context_overflow="drop_old_turns")
    backend = InProcessBackend(AsyncEngine(EngineCore(config, loaded_model)))
    running = run_in_thread(backend, GATEWAY)
    yield Served(running.url, backend, running.server)
    running.stop()
    backend.shutdown()


def _turns(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        out.append({"role": "user", "content": f"Note {i}: the river passes the old mill at dawn."})
        out.append({"role": "assistant", "content": f"Noted, item {i}."})
    return [*out, {"role": "user", "content": "Which colour is the sky?"}]


def _details(usage: Any) -> dict[str, Any]:
    details = usage.prompt_tokens_details
    assert details is not None and details.model_extra is not None
    return details.model_extra


def test_old_turns_are_dropped_to_fit_and_usage_says_what_went(dropping: Served) -> None:
    backend, client = dropping.backend, dropping.client()
    turns = _turns(10)
    full = len(backend.encode_chat([SYSTEM, *turns]).token_ids)
    assert full + MAX_TOKENS > LIMIT

    r = client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, *turns],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert r.usage is not None and r.choices[0].finish_reason in ("stop", "length")
    dropped = _details(r.usage)["truncated_messages"]
    assert dropped > 0 and dropped % 2 == 0  # whole turns: a question with its answer
    # what ran is the system prompt and the newest turns, and one turn more would not have fit
    kept = backend.encode_chat([SYSTEM, *turns[dropped:]]).token_ids
    one_more = backend.encode_chat([SYSTEM, *turns[dropped - 2 :]]).token_ids
    assert r.usage.prompt_tokens == len(kept) <= LIMIT - MAX_TOKENS < len(one_more)
    assert _details(r.usage)["truncated_tokens"] == full - len(kept)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, *turns],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = [chunk for chunk in stream][-1]
    assert last.usage is not None and last.usage.prompt_tokens == len(kept)
    details = _details(last.usage)
    assert (details["truncated_messages"], details["truncated_tokens"]) == (dropped, full - len(kept))


def test_what_no_dropping_can_fit_is_refused_naming_why(dropping: Served) -> None:
    client = dropping.client()
    messages: Any = [SYSTEM, *_turns(1)[:-1], {"role": "user", "content": "Tell me about rivers. " * 60}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert "latest turn" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_turns(10), max_completion_tokens=LIMIT)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_completion_tokens"


def test_responses_truncation_auto_drops_turns_and_disabled_refuses(dropping: Served) -> None:
    client = dropping.client()
    items: Any = _turns(10)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=items, max_output_tokens=MAX_TOKENS, truncation="disabled")
    assert info.value.code == "context_length_exceeded"
    r = client.responses.create(
        model=MODEL, input=items, max_output_tokens=MAX_TOKENS, truncation="auto", temperature=0
    )
    assert r.truncation == "auto" and r.usage is not None
    assert r.usage.input_tokens + MAX_TOKENS <= LIMIT
    extra = r.usage.input_tokens_details.model_extra
    assert extra is not None and extra["truncated_messages"] > 0 and extra["truncated_tokens"] > 0


def test_drop_old_turns_on_a_completion_is_refused_by_name(dropping: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        dropping.client().completions.create(
            model=MODEL, prompt="Hello", max_tokens=2, extra_body={"ctxfuse": {"drop_old_turns": True}}
        )
    assert info.value.param == "ctxfuse.drop_old_turns"


def test_a_router_drops_the_same_turns_from_its_workers_text_side(dropping: Served) -> None:
    """The fleet's router plans chats itself: with the policy a worker reports, it sends that worker
    the same token ids the worker's own gateway would have run, and reports the same drop."""
    worker = dropping.backend
    side = describe_text_side(
        worker.model_name,
        worker.tokenizer,
        worker.chat_template,
        max_model_len=worker.max_model_len,
        context_overflow=worker.context_overflow,
    )
    config = FleetConfig(backends=(BackendSpec(name="w", url="http://127.0.0.1:9"),))  # never called
    fleet = Fleet(config, None, None, FleetMetrics(CollectorRegistry()))
    router = FleetEngine(fleet, side, worker.tokenizer, worker.chat_template)
    body = {"model": MODEL, "messages": [SYSTEM, *_turns(10)], "max_tokens": MAX_TOKENS}
    req = msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)
    planned, local = plan_chat(req, router), plan_chat(req, worker)
    assert planned.dropped_messages > 0
    assert (planned.prompt_ids, planned.dropped_messages, planned.dropped_tokens) == (
        local.prompt_ids,
        local.dropped_messages,
        local.dropped_tokens,
    )
