"""The Responses stream converter (gateway/openai/responses_stream.py) over chat completion streams
written by hand: the output items and usage of a whole stream, and a stream that fails midway or is
cut before [DONE] never reported complete."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.openai.responses_convert import Draft
from gateway.openai.responses_stream import relayed_chunks, retell
from shared.responses_protocol import Response, ResponsesRequest

from .conftest import MODEL


def _chunk(content: str, **delta: Any) -> bytes:
    delta = {"role": "assistant", "content": content, **delta} if content else delta
    chunk = {
        "id": "c",
        "created": 0,
        "model": MODEL,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _retold(pieces: list[bytes]) -> tuple[list[dict[str, Any]], list[Response]]:
    kept: list[Response] = []

    async def source() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    async def keep(response: Response) -> None:
        kept.append(response)

    async def run() -> list[bytes]:
        draft = Draft.of(ResponsesRequest(model=MODEL, input="hi"))
        # as a relayed stream is read (a typed one skips the bytes: test_responses_api.py)
        return [e async for e in retell(relayed_chunks(source()), draft, keep)]

    events = [e.split(b"\ndata: ", 1)[1] for e in anyio.run(run)]
    for data in events:  # each event is what the SDK's own types describe (required fields and all)
        SDK_EVENT.validate_json(data)
    return [json.loads(data) for data in events], kept


SDK_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


def test_text_then_a_function_call_are_two_output_items_with_usage_at_the_end() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    more = {"index": 0, "function": {"arguments": '{"a": 1}'}}
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    last = {"id": "c", "created": 0, "model": MODEL, "choices": [], "usage": usage}
    pieces = [_chunk("Hi"), _chunk("", tool_calls=[call]), _chunk("", tool_calls=[more])]
    events, kept = _retold([*pieces, b"data: " + json.dumps(last).encode() + b"\n\n", b"data: [DONE]\n\n"])
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == "call_1" and final["output"][1]["arguments"] == '{"a": 1}'
    assert (
        final["usage"]["input_tokens_details"]["cached_tokens"] == 8 and final["usage"]["total_tokens"] == 13
    )
    assert [k.status for k in kept] == ["completed"]


def test_a_chat_stream_that_fails_midway_ends_in_an_error_event_and_a_failed_response() -> None:
    error = {
        "error": {"message": "engine died", "type": "server_error", "param": None, "code": "engine_dead"}
    }
    events, kept = _retold([_chunk("Hel"), b"data: " + json.dumps(error).encode() + b"\n\n"])
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2]["message"] == "engine died" and events[-2]["code"] == "engine_dead"
    assert (
        events[-1]["response"]["status"] == "failed"
        and events[-1]["response"]["error"]["code"] == "server_error"
    )
    assert [k.status for k in kept] == ["failed"]


def test_a_chat_stream_cut_before_done_is_never_reported_complete() -> None:
    # one event split across pieces is read whole; the missing [DONE] is a failure
    piece = _chunk("Hello")
    events, kept = _retold([piece[:20], piece[20:]])
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    assert events[4]["delta"] == "Hello" and [k.status for k in kept] == ["failed"]
