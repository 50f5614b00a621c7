"""Structured output through the official `openai` client against the real gateway and model:
json_schema and json_object, field confidence, cut-off output, refusals of schemas we cannot
enforce, streaming against non-streaming, the SDK's own `parse`, and legacy completions."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from tests.cloud.grammar.schema_suite import (
    LLGUIDANCE_ONLY,
    MALFORMED,
    REFUSED,
    SUITE,
    UNSUPPORTED,
    SuiteCase,
)

from .conftest import MODEL, Served

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
}


def schema_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(client: openai.OpenAI, prompt: str, schema: dict[str, Any], **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format=schema_format(schema),  # type: ignore[arg-type]
        **kw,
    )


def extension(choice: Any) -> dict[str, Any]:
    ext: dict[str, Any] = choice.model_extra["ctxfuse"]
    return ext


@pytest.fixture(scope="module")
def suite_replies(client: openai.OpenAI) -> dict[str, Any]:
    """Every suite schema asked at once: the engine batches requests with different schemas."""
    with ThreadPoolExecutor(8) as pool:
        futures = {c.name: pool.submit(ask, client, c.prompt, c.schema) for c in SUITE}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("case", SUITE, ids=[c.name for c in SUITE])
def test_every_finished_output_of_the_suite_parses_and_validates(
    case: SuiteCase, suite_replies: dict[str, Any]
) -> None:
    (choice,) = suite_replies[case.name].choices
    ext = extension(choice)
    if choice.finish_reason == "length":  # cut off: reported, never presented as valid
        assert ext["valid"] is False and "max_tokens" in ext["error"]
        return
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    errors = [
        e.message for e in jsonschema_rs.validator_for(case.schema, validate_formats=True).iter_errors(value)
    ]
    assert errors == [], choice.message.content
    assert ext == {"valid": True}


def test_the_suite_is_not_passed_by_cutting_everything_short(suite_replies: dict[str, Any]) -> None:
    finished = [r for r in suite_replies.values() if r.choices[0].finish_reason == "stop"]
    assert len(suite_replies) >= 30 and len(finished) >= 0.9 * len(suite_replies)


def test_json_object_mode_returns_a_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content or ""), dict)
    assert extension(choice)["valid"] is True


def test_max_tokens_cut_is_finish_length_and_never_valid(client: openai.OpenAI) -> None:
    r = ask(client, "Describe a person as JSON.", PERSON, max_tokens=5)
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    ext = extension(choice)
    assert ext["valid"] is False and "max_tokens" in ext["error"]
    with pytest.raises(ValueError):
        json.loads(choice.message.content or "")


def test_streaming_and_whole_give_the_same_json_under_greedy(client: openai.OpenAI) -> None:
    whole = ask(client, "Describe a person as JSON.", PERSON)
    chunks = list(ask(client, "Describe a person as JSON.", PERSON, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    last = chunks[-1].choices[0]
    assert last.finish_reason == whole.choices[0].finish_reason == "stop"
    assert last.model_extra["ctxfuse"] == extension(whole.choices[0]) == {"valid": True}


def _leaves(value: Any, path: str = "") -> set[str]:
    if isinstance(value, dict) and value:
        return set().union(
            *(_leaves(v, f"{path}/{k.replace('~', '~0').replace('/', '~1')}") for k, v in value.items())
        )
    if isinstance(value, list) and value:
        return set().union(*(_leaves(v, f"{path}/{i}") for i, v in enumerate(value)))
    return {path}


def test_field_confidence_scores_every_leaf_of_the_json(client: openai.OpenAI) -> None:
    r = ask(client, "Describe a person as JSON.", PERSON, extra_body={"ctxfuse": {"field_confidence": True}})
    (choice,) = r.choices
    value = json.loads(choice.message.content)
    conf = extension(choice)["field_confidence"]
    assert set(conf) == _leaves(value) == {"/name", "/age", "/city"}
    assert all(0.0 < p <= 1.0 for p in conf.values())
    # the streamed response reports the same confidences on its last chunk
    chunks = list(
        ask(
            client,
            "Describe a person as JSON.",
            PERSON,
            stream=True,
            extra_body={"ctxfuse": {"field_confidence": True}},
        )
    )
    assert chunks[-1].choices[0].model_extra["ctxfuse"]["field_confidence"] == conf


def test_field_confidence_without_structured_output_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"ctxfuse": {"field_confidence": True}},
        )
    assert err.value.body["param"] == "ctxfuse.field_confidence"  # type: ignore[index]


@pytest.mark.parametrize("name, schema, keyword, path", REFUSED, ids=[u[0] for u in REFUSED])
def test_a_schema_feature_we_cannot_enforce_is_a_400_naming_it(
    client: openai.OpenAI, name: str, schema: dict[str, Any], keyword: str, path: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "JSON please.", schema, max_tokens=8)
    body = err.value.body
    assert body["code"] == "unsupported_schema_feature"  # type: ignore[index]
    assert body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    assert keyword in body["message"] and path in body["message"]  # type: ignore[index]


def test_what_only_llguidance_enforces_is_served_and_its_output_validates(client: openai.OpenAI) -> None:
    cases = [u for u in UNSUPPORTED if u[0] in LLGUIDANCE_ONLY]
    assert len(cases) == len(LLGUIDANCE_ONLY)
    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(lambda c: ask(client, "JSON please.", c[1], max_tokens=40), cases))
    finished = 0
    for (name, schema, _, _), reply in zip(cases, replies, strict=True):
        choice = reply.choices[0]
        if choice.finish_reason == "stop":  # a cut-short answer is not whole JSON
            finished += 1
            assert jsonschema_rs.validator_for(schema).is_valid(json.loads(choice.message.content)), name
    assert finished >= 1


@pytest.mark.parametrize("name, schema", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_schema_is_a_400(served: Served, name: str, schema: object) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "JSON please."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    r = httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith("response_format")


def test_ignore_eos_with_a_schema_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "JSON please.", PERSON, extra_body={"ignore_eos": True})
    assert err.value.body["param"] == "ignore_eos"  # type: ignore[index]


class City(BaseModel):
    # bounded, as a client would bound what it lets a small model write
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: float = Field(ge=0, le=100)


def test_the_sdks_parse_helper_gets_a_validated_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def test_legacy_completions_follow_a_schema_too(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="A person described as JSON:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": schema_format(PERSON), "ctxfuse": {"field_confidence": True}},
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    value = json.loads(choice.text)
    assert jsonschema_rs.validator_for(PERSON).is_valid(value)
    ext = choice.model_extra["ctxfuse"]
    assert ext["valid"] is True and set(ext["field_confidence"]) == {"/name", "/age", "/city"}


def test_metrics_count_grammar_compilations_and_cache_hits(served: Served, client: openai.OpenAI) -> None:
    def counter(name: str) -> float:
        text = httpx.get(f"{served.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    schema = {
        "type": "object",
        "properties": {"metric_probe": {"type": "boolean"}},
        "required": ["metric_probe"],
    }
    compiled, hits = (
        counter("ctxfuse_grammar_compilations_total"),
        counter("ctxfuse_grammar_cache_hits_total"),
    )
    ask(client, "JSON please.", schema, max_tokens=20)
    ask(client, "JSON please.", schema, max_tokens=20)
    assert counter("ctxfuse_grammar_compilations_total") == compiled + 1
    assert counter("ctxfuse_grammar_cache_hits_total") == hits + 1


def test_a_schema_too_big_to_compile_quickly_is_a_400(client: openai.OpenAI) -> None:
    wide = {"type": "object", "properties": {f"field_{i:05d}": {"type": "integer"} for i in range(3000)}}
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "JSON please.", wide, max_tokens=8)
    assert err.value.body["code"] == "schema_too_large"  # type: ignore[index]


def test_streamed_legacy_completion_matches_the_whole_one(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "prompt": "A person described as JSON:",
        "max_tokens": 60,
        "temperature": 0,
        "extra_body": {"response_format": schema_format(PERSON)},
    }
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert chunks[-1].choices[0].model_extra["ctxfuse"] == whole.model_extra["ctxfuse"] == {"valid": True}


def test_each_of_n_sampled_choices_follows_the_schema(client: openai.OpenAI) -> None:
    r = ask(client, "Describe a person as JSON.", PERSON, n=3, seed=11, temperature=1.0)
    assert len(r.choices) == 3
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(choice.message.content))
            assert extension(choice) == {"valid": True}
        else:
            assert extension(choice)["valid"] is False
