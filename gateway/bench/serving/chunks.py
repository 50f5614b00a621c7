"""The parts of a streamed chunk a bench reads, from any OpenAI-compatible server.

Chat chunks carry text in `choices[0].delta.content` (or `delta.reasoning_content`, where llama.cpp
and vLLM put a reasoning model's thinking); completion chunks in `choices[0].text`. The usage chunk
(asked for with `stream_options.include_usage`) carries the true token counts. Errors come as
`{"error": {"message": ...}}` (OpenAI, ctxfuse, llama.cpp, recent vLLM), `{"error": "..."}`, or
`{"object": "error", "message": ...}` (older vLLM). Every other field is ignored.
"""

from __future__ import annotations

import msgspec


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None  # /v1/completions
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _ErrorBody(msgspec.Struct):
    message: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: _ErrorBody | str | None = None
    object: str | None = None
    message: str | None = None


class Chunk(msgspec.Struct, frozen=True):
    text: str  # the content this chunk adds ("" for role, finish and usage chunks)
    finished: bool  # a choice's finish_reason is set
    prompt_tokens: int | None = None  # from a usage chunk
    completion_tokens: int | None = None
    error: str | None = None  # the chunk is an error event


_decoder = msgspec.json.Decoder(_Chunk)


def _error_message(c: _Chunk) -> str | None:
    if isinstance(c.error, str):
        return c.error
    if c.error is not None:
        return c.error.message or "an error event without a message"
    if c.object == "error":
        return c.message or "an error event without a message"
    return None


def read_chunk(payload: str | bytes) -> Chunk:
    """One `data:` payload; an undecodable one reads as an error."""
    try:
        c = _decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        return Chunk("", False, error=f"an undecodable chunk ({exc}): {payload[:120]!r}")
    error = _error_message(c)
    if error is not None:
        return Chunk("", False, error=error)
    text, finished = [], False
    for choice in c.choices or ():
        if choice.delta is not None:
            text.append((choice.delta.content or "") + (choice.delta.reasoning_content or ""))
        text.append(choice.text or "")
        finished = finished or choice.finish_reason is not None
    usage = c.usage or _Usage()
    return Chunk("".join(text), finished, usage.prompt_tokens, usage.completion_tokens)


def error_message(body: str | bytes) -> str:
    """The message of an HTTP error response's body or an `event: error` payload: its error's
    message, or a top-level `message`, or else the body's start."""
    try:
        c = _decoder.decode(body)
        message = _error_message(c) or c.message
    except msgspec.MsgspecError:
        message = None
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    return message or text.strip()[:200] or "(empty body)"
