"""Request fields through the official `openai` client against the real gateway and model: an unknown
field is a 400 naming it (never an unconstrained 200), OpenAI fields we cannot honour are refused
with the reason, the hints we ignore are accepted, and vLLM's and llama.cpp's constraint fields
constrain real generation (choice, regex, GBNF grammar, JSON schema)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest

from .conftest import MODEL, Served

HI = [{"role": "user", "content": "Answer now."}]
COUNT = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["count"],
}


def chat(client: openai.OpenAI, max_tokens: int = 8, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=max_tokens, temperature=0, **kw
    )  # type: ignore[arg-type]


def refused(call: Any) -> dict[str, Any]:
    """The OpenAI error body of a call that must be a 400."""
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400
    body: dict[str, Any] = err.value.response.json()["error"]
    assert body["type"] == "invalid_request_error"
    return body


# -- unknown and unsupported fields -------------------------------------------------------------


@pytest.mark.parametrize("field", ["foo", "guided_decoding", "min_tokens"])
def test_an_unknown_chat_field_is_a_400_naming_it(client: openai.OpenAI, field: str) -> None:
    body = refused(lambda: chat(client, extra_body={field: 1}))
    assert body["param"] == field
    assert body["message"] == f"Unrecognized request argument supplied: {field}"


def test_an_unknown_completions_field_is_a_400_naming_it(client: openai.OpenAI) -> None:
    body = refused(lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"foo": 1}))
    assert body["param"] == "foo" and "Unrecognized request argument supplied: foo" in body["message"]


def test_an_unknown_nested_field_is_named_by_its_path(served: Served) -> None:
    bad = {"role": "user", "content": "x", "colour": "red"}
    r = httpx.post(
        f"{served.base_url}/chat/completions", json={"model": MODEL, "messages": [bad]}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].colour"
    rf = {"type": "json_object", "shema": {}}
    r = httpx.post(
        f"{served.base_url}/completions", json={"model": MODEL, "prompt": "x", "response_format": rf}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.shema"
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "detial": "low"}}
    r = httpx.post(
        f"{served.base_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": [part]}]},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url.detial"


def test_tokenize_and_detokenize_refuse_unknown_fields(served: Served) -> None:
    r = httpx.post(f"{served.url}/tokenize", json={"prompt": "x", "add_bos": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_bos"
    r = httpx.post(f"{served.url}/detokenize", json={"tokens": [1], "skip_special": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special"


def test_batch_create_refuses_an_unknown_field(client: openai.OpenAI) -> None:
    body = refused(
        lambda: client.batches.create(
            input_file_id="file-x",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"priority": "high"},
        )
    )
    assert body["param"] == "priority"


@pytest.mark.parametrize(
    ("kw", "param", "reason"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
        ({"modalities": ["text", "audio"]}, "modalities[1]", "audio"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "reason"),
        ({"web_search_options": {}}, "web_search_options", "web search"),
        ({"verbosity": "low"}, "verbosity", "not supported"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "tools"),
        ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern", "whitespace"),
    ],
)
def test_sdk_fields_we_cannot_honour_are_refused_with_the_reason(
    client: openai.OpenAI, kw: dict[str, Any], param: str, reason: str
) -> None:
    body = refused(lambda: chat(client, **kw))
    assert body["param"] == param and reason in body["message"]


def test_sdk_hints_that_cannot_change_the_output_are_accepted(client: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "Do something bad."},
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},  # as the SDK replays it
        {"role": "user", "content": "Say hi."},
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=1,
        temperature=0,
        store=False,
        metadata={"team": "a"},
        service_tier="auto",
        safety_identifier="user-1",
        prompt_cache_key="k",
        modalities=["text"],
        user="u",
        extra_body={"guided_decoding_backend": "xgrammar"},
    )
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 1


# -- constraint fields ----------------------------------------------------------------------------


def test_guided_choice_gives_exactly_one_of_the_choices(client: openai.OpenAI) -> None:
    r = chat(client, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("ctxfuse") is None  # plain text: no JSON check


def test_guided_regex_on_completions_matches(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text


def test_a_llama_cpp_grammar_gives_one_of_its_sentences(client: openai.OpenAI) -> None:
    r = chat(client, extra_body={"grammar": 'root ::= "A" | "B"'})
    assert r.choices[0].message.content in ("A", "B")


def test_structured_outputs_regex_streams_a_match(client: openai.OpenAI) -> None:
    stream = chat(client, stream=True, extra_body={"structured_outputs": {"regex": "(red|green|blue)!"}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("red!", "green!", "blue!")


def test_response_format_regex_matches(client: openai.OpenAI) -> None:
    r = chat(client, extra_body={"response_format": {"type": "regex", "regex": "[a-z]{2,4}"}})
    assert re.fullmatch("[a-z]{2,4}", r.choices[0].message.content or "")


@pytest.mark.parametrize(
    "extra",
    [{"json_schema": COUNT}, {"guided_json": COUNT}, {"structured_outputs": {"json": COUNT}}],
    ids=["llama.cpp json_schema", "guided_json", "structured_outputs.json"],
)
def test_json_schema_fields_give_json_valid_against_the_schema(
    client: openai.OpenAI, extra: dict[str, Any]
) -> None:
    r = chat(client, max_tokens=20, extra_body=extra)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema_rs.validate(COUNT, json.loads(choice.message.content or ""))
    assert choice.model_extra["ctxfuse"]["valid"] is True


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
        ({"json_schema": COUNT, "structured_outputs": {"choice": ["a"]}}, "json_schema"),
    ],
)
def test_two_constraints_at_once_are_a_400(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    body = refused(lambda: chat(client, extra_body=extra))
    assert body["param"] == param and body["code"] == "conflicting_constraints"
    assert all(field in body["message"] for field in extra)  # both are named


def test_structured_outputs_must_hold_exactly_one_constraint(client: openai.OpenAI) -> None:
    body = refused(lambda: chat(client, extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}))
    assert body["param"] == "structured_outputs"


@pytest.mark.parametrize(
    ("extra", "param", "reason"),
    [
        ({"guided_regex": "(ab"}, "guided_regex", "parenthesis is not closed"),
        ({"structured_outputs": {"regex": "(?=x)y"}}, "structured_outputs.regex", "Lookahead"),
        ({"response_format": {"type": "regex", "regex": "[z-a]"}}, "response_format.regex", "bound"),
        ({"grammar": "root ::= foo"}, "grammar", 'Rule "foo" is not defined'),
        ({"guided_grammar": 'start ::= "a"'}, "guided_grammar", "root"),
        ({"guided_choice": []}, "guided_choice", "empty"),
        ({"response_format": {"type": "json_object", "regex": "a"}}, "response_format.regex", "type regex"),
        ({"response_format": {"type": "regex"}}, "response_format.regex", "needs a regex"),
        ({"guided_json": {"type": "object", "$ref": "#/nope"}}, "guided_json", ""),
    ],
)
def test_a_malformed_constraint_is_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str, reason: str
) -> None:
    body = refused(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra))
    assert body["param"] == param and reason in body["message"]


def test_field_confidence_needs_json_not_plain_text(client: openai.OpenAI) -> None:
    extra = {"guided_choice": ["a", "b"], "ctxfuse": {"field_confidence": True}}
    assert refused(lambda: chat(client, extra_body=extra))["param"] == "ctxfuse.field_confidence"
