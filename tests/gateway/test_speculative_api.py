"""Speculative decoding through the API: with `--speculative ngram`, and from OpenAI's predicted
outputs (`prediction`) on any engine. The OpenAI client reads the drafts the model accepted and
rejected in `usage.completion_tokens_details`, streamed and whole, and the acceptance counters in
/metrics; the text is the one it gets without."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

import httpx
import openai
import pytest

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend

from .conftest import ENGINE, GATEWAY, MODEL, Served, run_in_thread

DOC = "\n".join(f"Line {i}: the {i * 3} grey geese flew over lake number {i + 9} at dawn." for i in range(12))
ASK = [{"role": "user", "content": f"{DOC}\n\nCopy lines 4 to 6 exactly as written."}]


@pytest.fixture(scope="module")
def spec_served(loaded_model: LoadedModel) -> Iterator[Served]:
    backend = InProcessBackend(AsyncEngine(EngineCore(replace(ENGINE, speculative="ngram"), loaded_model)))
    running = run_in_thread(backend, GATEWAY)
    yield Served(running.url, backend, running.server)
    running.stop()
    backend.shutdown()


def counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{name}_total (\S+)$", metrics, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_usage_and_metrics_report_the_drafts(spec_served: Served) -> None:
    client = spec_served.client()
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0)  # type: ignore[arg-type]
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    details = whole.usage.completion_tokens_details
    assert details.accepted_prediction_tokens and details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens is not None and details.rejected_prediction_tokens >= 0
    assert details.accepted_prediction_tokens < whole.usage.completion_tokens
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details == details
    metrics = httpx.get(f"{spec_served.url}/metrics", timeout=10).text
    drafted = counter(metrics, "ctxfuse_spec_decode_draft_tokens")
    accepted = counter(metrics, "ctxfuse_spec_decode_accepted_tokens")
    assert accepted == 2 * details.accepted_prediction_tokens
    assert drafted == accepted + 2 * (details.rejected_prediction_tokens or 0)


def test_without_drafts_the_details_are_zero(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert r.usage.completion_tokens_details.rejected_prediction_tokens == 0


def test_a_predicted_output_speeds_an_edit_without_changing_it(client: openai.OpenAI) -> None:
    """The default engine drafts nothing by itself: a prediction (the text being edited) is drafted
    from, and the answer is the one the same request gets without it."""
    edit = [{"role": "user", "content": f"{DOC}\n\nRepeat lines 1 to 3, with 'geese' changed to 'ducks'."}]
    plain = client.chat.completions.create(model=MODEL, messages=edit, max_tokens=48, temperature=0)  # type: ignore[arg-type]
    text = plain.choices[0].message.content or ""
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    guess = "\n".join(DOC.splitlines()[1:4]).replace("geese", "ducks")
    for prediction in (
        {"type": "content", "content": guess},
        {"type": "content", "content": [{"type": "text", "text": guess}]},
    ):
        r = client.chat.completions.create(
            model=MODEL,
            messages=edit,  # type: ignore[arg-type]
            max_tokens=48,
            temperature=0,
            prediction=prediction,  # type: ignore[arg-type]
        )
        assert r.choices[0].message.content == text
        assert r.usage is not None and r.usage.completion_tokens_details is not None
        assert (r.usage.completion_tokens_details.accepted_prediction_tokens or 0) > 0


def test_a_malformed_prediction_is_refused_naming_its_field(served: Served) -> None:
    for prediction, param in (
        ({"type": "file", "content": "x"}, "prediction.type"),
        ({"type": "content"}, "prediction.content"),
    ):
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "prediction": prediction}
        r = httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
