"""A chat completion stream (typed chunks, from any upstream) re-told as Responses stream events.

Order, as OpenAI sends it: response.created, response.in_progress; per output item
output_item.added, then for a message content_part.added, output_text.delta (one per chat delta),
output_text.done, content_part.done, or for a function call function_call_arguments.delta ...
.done; output_item.done; then response.completed (response.incomplete when max_output_tokens cut
it short) with usage. Every event carries `sequence_number`, counting from 0.

A chat stream that fails (it raises; a relayed one: its `{"error": ...}` event, or an end without
[DONE]) becomes an `error` event and response.failed: a truncated answer is never reported complete.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import structlog
from litestar.response import Stream

from gateway.encoding import encode
from gateway.openai.responses_convert import Draft, failed_by_request, new_id, status_of, usage_of
from gateway.upstream import Answered, ChatAnswer
from shared.errors import CtxfuseError
from shared.protocol import ChatCompletion, ChatCompletionChunk, ChunkDelta, TokenLogprob, Usage
from shared.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    Item,
    LifecycleEvent,
    Message,
    OutputItemEvent,
    OutputText,
    Response,
    ResponseError,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from shared.storage_faults import StorageFault

Finish = Callable[[Response], Awaitable[None]]
_RESPONSE_ERROR_CODES = frozenset({"server_error", "rate_limit_exceeded", "invalid_prompt"})


log = structlog.get_logger("ctxfuse.gateway")


async def chat_events(source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE byte stream, however its pieces split the events."""
    buffer = b""
    async for piece in source:
        buffer += piece
        *events, buffer = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            data = b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if data:
                yield data


def sse(event: StreamEvent) -> bytes:
    return b"event: " + event.type.encode() + b"\ndata: " + encode(event) + b"\n\n"


@dataclass(slots=True)
class _Open:
    """The output item being written: a message's text, or a function call's arguments."""

    item: Message | FunctionCallItem
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the text's, when they were asked for


@dataclass(slots=True)
class Retell:
    """The conversion's state: the output so far, the item open now, the next sequence number."""

    draft: Draft
    output: list[Item] = field(default_factory=list)
    open: _Open | None = None
    seq: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    def lifecycle(self, kind: str, response: Response) -> bytes:
        return sse(LifecycleEvent(type=f"response.{kind}", sequence_number=self._next(), response=response))

    def _open(self, item: Message | FunctionCallItem) -> tuple[_Open, list[bytes]]:
        o = self.open = _Open(item, len(self.output))
        added = OutputItemEvent(
            type="response.output_item.added", sequence_number=self._next(), output_index=o.index, item=item
        )
        out = [sse(added)]
        if isinstance(item, Message):
            out.append(self._part("added", o, ""))
        return o, out

    def _part(self, kind: str, o: _Open, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        return sse(
            ContentPartEvent(
                type=f"response.content_part.{kind}",
                sequence_number=self._next(),
                item_id=o.item.id,
                output_index=o.index,
                content_index=0,
                part=OutputText(text=text, logprobs=list(logprobs or [])),
            )
        )

    def close(self) -> list[bytes]:
        """Finish the open item: its done events, and the item joins the output."""
        o, self.open = self.open, None
        if o is None:
            return []
        out: list[bytes] = []
        if isinstance(o.item, Message):
            status = status_of(self.finish_reason)
            part = OutputText(text=o.text, logprobs=list(o.logprobs))
            done: Item = Message(id=o.item.id, role="assistant", content=[part], status=status)
            out.append(
                sse(
                    TextDoneEvent(
                        sequence_number=self._next(),
                        item_id=o.item.id,
                        output_index=o.index,
                        content_index=0,
                        text=o.text,
                        logprobs=list(o.logprobs),
                    )
                )
            )
            out.append(self._part("done", o, o.text, o.logprobs))
        else:
            call = o.item
            done = FunctionCallItem(id=call.id, call_id=call.call_id, name=call.name, arguments=o.text)
            out.append(
                sse(
                    ArgumentsDoneEvent(
                        sequence_number=self._next(),
                        item_id=call.id,
                        output_index=o.index,
                        arguments=o.text,
                        name=call.name,
                    )
                )
            )
        out.append(
            sse(
                OutputItemEvent(
                    type="response.output_item.done",
                    sequence_number=self._next(),
                    output_index=o.index,
                    item=done,
                )
            )
        )
        self.output.append(done)
        return out

    def delta(self, d: ChunkDelta, logprobs: list[TokenLogprob] | None = None) -> list[bytes]:
        """Events for one chat delta; `logprobs`: its content tokens' (when they were asked for)."""
        out: list[bytes] = []
        if isinstance(d.content, str) and d.content:
            o = self.open
            if o is None or not isinstance(o.item, Message):
                out += self.close()
                o, added = self._open(
                    Message(id=new_id("msg"), role="assistant", content=[], status="in_progress")
                )
                out += added
            o.text += d.content
            o.logprobs += logprobs or []
            out.append(
                sse(
                    TextDeltaEvent(
                        sequence_number=self._next(),
                        item_id=o.item.id,
                        output_index=o.index,
                        content_index=0,
                        delta=d.content,
                        logprobs=list(logprobs or []),
                    )
                )
            )
        for call in d.tool_calls if isinstance(d.tool_calls, list) else []:
            if isinstance(call.id, str):  # a call's first delta names it
                out += self.close()
                name = call.function.name if isinstance(call.function.name, str) else ""
                _, added = self._open(
                    FunctionCallItem(
                        id=new_id("fc"), call_id=call.id, name=name, arguments="", status="in_progress"
                    )
                )
                out += added
            o = self.open
            if call.function.arguments and o is not None and isinstance(o.item, FunctionCallItem):
                o.text += call.function.arguments
                out.append(
                    sse(
                        ArgumentsDeltaEvent(
                            sequence_number=self._next(),
                            item_id=o.item.id,
                            output_index=o.index,
                            delta=call.function.arguments,
                        )
                    )
                )
        return out

    def end(self) -> tuple[list[bytes], Response]:
        """The last events of a whole answer, and its response object."""
        out: list[bytes] = []
        if self.open is None and not self.output:  # an empty answer is still one (empty) message
            out += self._open(Message(id=new_id("msg"), role="assistant", content=[], status="in_progress"))[
                1
            ]
        out += self.close()
        usage = usage_of(self.usage) if self.usage is not None else None
        return out, self.draft.response(status_of(self.finish_reason), list(self.output), usage)

    def failed(self, message: str, code: str | None, param: str | None) -> tuple[bytes, Response]:
        event = sse(ErrorEvent(sequence_number=self._next(), message=message, code=code, param=param))
        response = self.draft.response("failed", list(self.output))
        # a response's error code is one of OpenAI's few (the SDK checks); the error event keeps ours
        kept = code if code in _RESPONSE_ERROR_CODES else "server_error"
        response.error = ResponseError(code=kept, message=message)
        return event, response


def _chat_error(obj: dict[str, Any]) -> CtxfuseError:
    err = obj.get("error")
    err = err if isinstance(err, dict) else {}
    code, param = err.get("code"), err.get("param")
    return CtxfuseError(
        str(err.get("message") or "the stream failed"),
        code=code if isinstance(code, str) else None,
        param=param if isinstance(param, str) else None,
    )


async def relayed_chunks(source: AsyncIterator[bytes]) -> AsyncIterator[ChatCompletionChunk]:
    try:
        async for data in chat_events(source):
            if data == b"[DONE]":
                return
            obj = msgspec.json.decode(data)
            if isinstance(obj, dict) and "error" in obj:  # the chat stream failed after its first byte
                raise _chat_error(obj)
            yield msgspec.convert(obj, ChatCompletionChunk)
        raise CtxfuseError("the answer's stream ended before it was whole", code="server_error")
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


def typed(relayed: Answered) -> ChatAnswer:
    """A chat answer relayed from a server that is not ours, read back from its bytes."""
    headers = {k: v for k, v in relayed.headers.items() if isinstance(v, str)}
    if isinstance(relayed, Stream):
        return ChatAnswer(
            chunks=relayed_chunks(cast(AsyncIterator[bytes], relayed.iterator)), headers=headers
        )
    content = relayed.content if isinstance(relayed.content, bytes) else encode(relayed.content)
    return ChatAnswer(whole=msgspec.json.decode(content, type=ChatCompletion), headers=headers)


async def _events(
    state: Retell, source: AsyncIterator[ChatCompletionChunk], finish: Finish
) -> AsyncGenerator[bytes, None]:
    try:
        async for chunk in source:
            if isinstance(chunk.usage, Usage):
                state.usage = chunk.usage
            for choice in chunk.choices:
                failed_by_request(choice.finish_reason, choice.ctxfuse)
                state.finish_reason = choice.finish_reason or state.finish_reason
                logprobs = choice.logprobs.content if choice.logprobs is not None else None
                for event in state.delta(choice.delta, logprobs):
                    yield event
    except CtxfuseError as exc:
        raise _Failed(exc.message, exc.code or "server_error", exc.param) from exc
    events, response = state.end()
    for event in events:
        yield event
    try:
        await finish(response)
    except StorageFault as fault:  # not kept (a full disk): the client is told, never a cut stream
        raise _Failed(fault.message, fault.code, None) from fault
    yield state.lifecycle(response.status, response)


class _Failed(Exception):
    def __init__(self, message: str, code: str | None, param: str | None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


async def retell(
    source: AsyncIterator[ChatCompletionChunk], draft: Draft, finish: Finish
) -> AsyncIterator[bytes]:
    """Responses events for the chat stream `source`; `finish` keeps the final response (stored
    before the last event goes out, so a client that saw it can retrieve it)."""
    state = Retell(draft)
    yield state.lifecycle("created", draft.response("in_progress", []))
    yield state.lifecycle("in_progress", draft.response("in_progress", []))
    events = _events(state, source, finish)
    try:
        async for event in events:
            yield event
        return
    except _Failed as exc:
        failure = exc
    except Exception as exc:  # a chunk we could not read: the answer is not whole
        log.exception("responses_stream_failed")
        failure = _Failed(f"the stream failed: {type(exc).__name__}", "server_error", None)
    finally:  # a client gone mid-stream closes this generator: close what it reads from now
        await events.aclose()
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
    event, response = state.failed(failure.message, failure.code, failure.param)
    yield event
    with contextlib.suppress(StorageFault):  # (counted and logged where it was raised)
        await finish(response)
    yield state.lifecycle("failed", response)
