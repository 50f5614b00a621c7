"""The Responses API (issue 18) on the real gateway (the default model, an in-process engine, loopback)
with the official `openai` client: create, stream and parse, function calls, stored responses per
tenant, and what it refuses. Generations are short and greedy: the answers are compared with the
chat completion the same conversation gets, which is what the Responses API is built on."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseItemList
from pydantic import BaseModel

from gateway.access.keys import KeyStore

from .conftest import MODEL, Running, Served

GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0}


def _chat(
    client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int
) -> tuple[str, int]:
    """(text, prompt tokens) of the chat completion for `messages`, greedy."""
    r = client.chat.completions.create(messages=messages, max_completion_tokens=max_tokens, **GREEDY)
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens


def test_a_string_input_with_instructions_is_answered_as_the_same_chat(client: openai.OpenAI) -> None:
    r = client.responses.create(
        input="Name a fruit.", instructions="Answer in one word.", max_output_tokens=6, **GREEDY
    )
    text, prompt = _chat(
        client,
        [
            {"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": "Name a fruit."},
        ],
        6,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.instructions == "Answer in one word."
    assert r.output_text == text and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage is not None and r.usage.input_tokens == prompt
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # a cut-short answer says so, as OpenAI's does
    cut = r.usage.output_tokens == 6
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens") == cut
    # without instructions, no system message is added (the template's own default applies)
    without = client.responses.create(input="Name a fruit.", max_output_tokens=1, **GREEDY)
    _, bare = _chat(client, [{"role": "user", "content": "Name a fruit."}], 1)
    assert without.usage is not None and without.usage.input_tokens == bare != prompt


def test_a_repeated_long_input_reports_cached_tokens(client: openai.OpenAI) -> None:
    long = " ".join(f"Fact {i}: the number {i} plus one is {i + 1}." for i in range(40))
    first = client.responses.create(input=long, max_output_tokens=1, store=False, **GREEDY)
    again = client.responses.create(input=long, max_output_tokens=1, store=False, **GREEDY)
    assert first.usage is not None and again.usage is not None and again.usage.input_tokens > 300
    assert again.usage.input_tokens_details.cached_tokens >= again.usage.input_tokens - 32


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(input="Remember the word apple.", max_output_tokens=4, **GREEDY)
    second = client.responses.create(
        input="Which word?", previous_response_id=first.id, max_output_tokens=4, **GREEDY
    )
    assert second.previous_response_id == first.id
    # what was sent: the first turn, its answer, the new turn (the same prompt as that chat)
    _, prompt = _chat(
        client,
        [
            {"role": "user", "content": "Remember the word apple."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Which word?"},
        ],
        1,
    )
    assert second.usage is not None and second.usage.input_tokens == prompt
    items = client.responses.input_items.list(second.id, order="asc")
    listed = [(i.type, getattr(i, "role", None), i.content[0].text) for i in items.data]  # type: ignore[union-attr]
    assert listed == [
        ("message", "user", "Remember the word apple."),
        ("message", "assistant", first.output_text),
        ("message", "user", "Which word?"),
    ]
    assert items.data[1].id == first.output[0].id  # the first answer's own item
    newest = client.responses.input_items.list(second.id, limit=2)  # newest first, as OpenAI's
    assert [i.id for i in newest.data] == [items.data[2].id, items.data[1].id] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=2, after=newest.data[-1].id)
    assert [i.id for i in rest.data] == [items.data[0].id] and not rest.has_more


def test_a_stored_response_is_retrieved_listed_and_deleted(served: Served, client: openai.OpenAI) -> None:
    r = client.responses.create(input="Say hi.", max_output_tokens=3, **GREEDY)
    got = client.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.usage) == (r.id, r.output_text, r.usage)
    # the bodies are what the SDK's own types describe, validated (its client only constructs them)
    SdkResponse.model_validate_json(httpx.get(f"{served.base_url}/responses/{r.id}").content)
    ResponseItemList.model_validate_json(httpx.get(f"{served.base_url}/responses/{r.id}/input_items").content)
    assert client.responses.delete(r.id) is None  # the SDK returns nothing for a 200
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r.id)


def test_store_false_is_not_kept_and_cannot_be_continued(client: openai.OpenAI) -> None:
    r = client.responses.create(input="Say hi.", max_output_tokens=2, store=False, **GREEDY)
    assert r.store is False and r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="store=false") as err:
        client.responses.create(input="And?", previous_response_id=r.id, max_output_tokens=2, **GREEDY)
    assert err.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="And?", previous_response_id="resp_nope", max_output_tokens=2, **GREEDY)


def test_a_stream_sends_the_response_events_in_order(client: openai.OpenAI) -> None:
    whole = client.responses.create(input="Count: one, two,", max_output_tokens=6, store=False, **GREEDY)
    with client.responses.stream(input="Count: one, two,", max_output_tokens=6, **GREEDY) as stream:
        events = list(stream)
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert deltas and "".join(deltas) == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    assert (
        client.responses.retrieve(final.id).output_text == whole.output_text
    )  # stored before the last event


def test_included_logprobs_are_the_chat_completions_in_whole_and_streamed_answers(
    client: openai.OpenAI,
) -> None:
    asked: dict[str, Any] = {"include": ["message.output_text.logprobs"], "top_logprobs": 2, **GREEDY}
    r = client.responses.create(
        input="Say hello.", max_output_tokens=4, store=False, prompt_cache_key="greeting", **asked
    )
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    expected = [
        (t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in chat.choices[0].logprobs.content
    ]
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    # the same tokens and alternatives; logprobs to float noise (a prefix-cache hit sums in another order)
    got = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in part.logprobs]
    assert [(t, alts) for t, _, alts in got] == [(t, alts) for t, _, alts in expected]
    assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in expected], abs=1e-3)
    assert r.top_logprobs == 2 and r.prompt_cache_key == "greeting"
    with client.responses.stream(input="Say hello.", max_output_tokens=4, store=False, **asked) as stream:
        events = list(stream)
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs or []]
    assert [t.token for t in streamed] == [t for t, _, _ in expected]
    assert [t.logprob for t in streamed] == pytest.approx([lp for _, lp, _ in expected], abs=1e-3)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs or []) == len(expected)  # type: ignore[union-attr]
    # without asking, an answer carries none
    plain = client.responses.create(input="Say hello.", max_output_tokens=2, store=False, **GREEDY)
    assert not plain.output[0].content[0].logprobs  # type: ignore[union-attr]


class Color(BaseModel):
    color: Literal["red", "green", "blue"]


def test_parse_returns_the_pydantic_object_its_schema_enforced(client: openai.OpenAI) -> None:
    r = client.responses.parse(input="Pick a color.", text_format=Color, max_output_tokens=20, **GREEDY)
    assert isinstance(r.output_parsed, Color)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_a_required_function_tool_gives_a_function_call_and_takes_its_output(client: openai.OpenAI) -> None:
    r = client.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        **GREEDY,  # type: ignore[list-item]
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    assert calls[0].call_id
    follow = client.responses.create(
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21C"}],
        previous_response_id=r.id,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=4,
        **GREEDY,
    )
    assert follow.output[0].type == "message"
    kinds = [i.type for i in client.responses.input_items.list(follow.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]
    with client.responses.stream(
        input="What is the weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        **GREEDY,  # type: ignore[list-item]
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and "response.function_call_arguments.delta" in types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and json.loads(args)["city"] in ("Paris", "Rome")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include[1]"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(
    served: Served, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "hi", **extra}
    r = httpx.post(f"{served.base_url}/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_an_unknown_field_is_a_400_and_chat_errors_pass_through(served: Served) -> None:
    r = httpx.post(
        f"{served.base_url}/responses", json={"model": MODEL, "input": "hi", "frobnicate": 1}, timeout=30
    )
    assert r.status_code == 400 and "frobnicate" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(
        f"{served.base_url}/responses", json={"model": "no-such-model", "input": "hi"}, timeout=30
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_stored_response_cannot_be_replayed_as_a_stream(client: openai.OpenAI, served: Served) -> None:
    # OpenAI streams a retrieval only for a background response, which is refused here: say so
    # rather than answer the JSON body to a client waiting for events
    r = client.responses.create(input="Hi.", max_output_tokens=1, **GREEDY)
    got = httpx.get(f"{served.base_url}/responses/{r.id}", params={"stream": "true"}, timeout=30)
    assert got.status_code == 400 and got.json()["error"]["param"] == "stream"
    assert httpx.get(f"{served.base_url}/responses/{r.id}", timeout=30).json()["id"] == r.id


def test_the_openapi_document_describes_the_responses_routes(served: Served) -> None:
    paths = httpx.get(f"{served.url}/schema/openapi.json", timeout=30).json()["paths"]
    body = paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/ResponsesRequest"
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert "get" in paths["/v1/responses/{response_id}/input_items"]


def test_another_tenants_key_never_sees_a_stored_response(keyed: tuple[Running, KeyStore]) -> None:
    running, keys = keyed
    _, acme_key = keys.create("acme")
    _, globex_key = keys.create("globex")
    acme = openai.OpenAI(base_url=f"{running.url}/v1", api_key=acme_key, max_retries=0, timeout=60)
    globex = openai.OpenAI(base_url=f"{running.url}/v1", api_key=globex_key, max_retries=0, timeout=60)
    r = acme.responses.create(input="Say hi.", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.create(input="And?", previous_response_id=r.id, max_output_tokens=1, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(r.id)
    assert acme.responses.retrieve(r.id).output_text == r.output_text  # still there for its owner
