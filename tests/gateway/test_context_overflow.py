"""Context limits through the API: the longest context shows in /v1/models; under truncate_middle
a prompt too long for the context is served with its middle dropped, and the response says how
many tokens went."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import openai
import pytest

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend

from .conftest import ENGINE, GATEWAY, MODEL, Served, run_in_thread

LIMIT = 256


@pytest.fixture(scope="module")
def truncating(loaded_model: LoadedModel) -> Iterator[Served]:
    config = replace(
        ENGINE, kv_cache_memory_gib=0.05, max_model_len=LIMIT, context_overflow="truncate_middle"
    )
    backend = InProcessBackend(AsyncEngine(EngineCore(config, loaded_model)))
    running = run_in_thread(backend, GATEWAY)
    yield Served(running.url, backend, running.server)
    running.stop()
    backend.shutdown()


def _long_question() -> str:
    return "Remember the colour teal. " + "Filler words go here. " * 120 + "Which colour was named first?"


def test_models_reports_the_longest_context(truncating: Served) -> None:
    models = truncating.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == LIMIT


def test_truncate_middle_serves_an_overlong_prompt_and_says_so(truncating: Served) -> None:
    client = truncating.client()
    messages = [{"role": "user", "content": _long_question()}]
    full = len(truncating.backend.encode_chat(messages).token_ids)
    assert full > LIMIT
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    usage = r.usage
    assert usage is not None and usage.prompt_tokens == LIMIT - 8
    details = usage.prompt_tokens_details
    assert details is not None and details.model_extra is not None
    assert details.model_extra["truncated_tokens"] == full - (LIMIT - 8)
    # without max_tokens the prompt keeps 7/8 of the context and the answer gets the rest
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == LIMIT - LIMIT // 8


def test_truncate_middle_still_refuses_max_tokens_that_leave_no_room(truncating: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        truncating.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=LIMIT,
        )
    assert info.value.code == "context_length_exceeded"


def test_the_default_policy_refuses_an_overlong_prompt(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4
        )
    assert info.value.code == "context_length_exceeded"
