"""Tool calls through the official `openai` client against the real gateway and model: tool_choice
required, a named function, auto and none; parallel_tool_calls; arguments that satisfy each
function's schema; streamed call deltas; and a conversation that carries calls and results back."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from .conftest import MODEL

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[typeddict-item]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]


def call(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL, tools=TOOLS, temperature=0, **kw)


def check_calls(calls: list[Any]) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        args = json.loads(c.function.arguments)
        assert jsonschema_rs.validator_for(SCHEMAS[c.function.name]).is_valid(args), c.function.arguments


def test_required_makes_valid_tool_calls(client: openai.OpenAI) -> None:
    r = call(client, tool_choice="required")
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)
    assert choice.model_extra["ctxfuse"] == {"valid": True}


def test_a_named_function_is_the_one_called_once(client: openai.OpenAI) -> None:
    r = call(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (only,) = choice.message.tool_calls
    assert only.function.name == "get_time"
    check_calls([only])


def test_parallel_tool_calls_false_allows_exactly_one_call(client: openai.OpenAI) -> None:
    ask: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Weather in Paris, London and Tokyo, and the time in Europe/Paris?"}
    ]
    r = call(client, messages=ask, tool_choice="required", parallel_tool_calls=False)
    (choice,) = r.choices
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_auto_gives_text_or_valid_calls(client: openai.OpenAI) -> None:
    r = call(client, tool_choice="auto")
    (choice,) = r.choices
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"


def test_none_never_calls(client: openai.OpenAI) -> None:
    r = call(client, tool_choice="none", max_tokens=30)
    (choice,) = r.choices
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


def test_streamed_call_deltas_rebuild_the_same_calls(client: openai.OpenAI) -> None:
    whole = call(client, tool_choice="required")
    chunks = list(call(client, tool_choice="required", stream=True))
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": ""})
                if d.id:
                    assert not entry["id"], "a call's id comes once, with its first delta"
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_cut_off_call_is_not_presented_as_a_call(client: openai.OpenAI) -> None:
    r = call(client, tool_choice="required", max_tokens=6)
    (choice,) = r.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.model_extra["ctxfuse"]["valid"] is False


def test_a_conversation_with_calls_and_results_continues(client: openai.OpenAI) -> None:
    first = call(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tool_call = first.choices[0].message.tool_calls[0]
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": tool_call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    r = call(client, messages=messages, tool_choice="none", max_tokens=40)
    assert r.choices[0].message.content


def test_bad_tool_definitions_are_400s(client: openai.OpenAI) -> None:
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
        },
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[bad], tool_choice="required")  # type: ignore[list-item]
    assert err.value.body["param"] == "tools[0].function.parameters"  # type: ignore[index]
    assert "uniqueItems" in err.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        call(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, WEATHER])
    assert err.value.body["param"] == "tools[1].function.name"  # type: ignore[index]


def test_json_response_format_with_optional_tools_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call(client, response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"  # type: ignore[index]
