"""Tokens per minute through the router: a key's request reserves its most tokens before it is sent
(the prompt, counted with the model's tokenizer, plus max_tokens for every choice) and the
reservation is settled to what the backend reports using.

- A whole answer carries `usage`: settled from it. A refusal (a 4xx) generated nothing: settled to 0.
- A stream carries usage only in a last chunk the client asks for (`stream_options.include_usage`);
  the router asks for it on the client's behalf and drops that chunk from what it relays when the
  client did not ask, so the client sees the stream it asked for.
- An answer that reports no usage (a stream cut off, a backend that counts nothing) keeps its
  reservation: what cannot be counted is charged at its most, never at nothing.
- A request with no max_tokens reserves up to the context the backends report (`max_model_len`),
  or, when none reports one, the key's whole minute.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import msgspec
from litestar.response import Stream

from gateway.access.limits import Limiter, Ticket
from gateway.upstream import Answered
from shared.protocol import ChatCompletionRequest, CompletionRequest

_USAGE_MARK = b'"usage":{'
# a name spelled with escapes is missed here; its value then follows ours and wins (the last of a
# repeated key does), and a stream without usage is charged its whole reservation (see above)
_OPTIONS_NAME = b'"stream_options"'
_ASK_USAGE = b'"stream_options":{"include_usage":true},'


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def used(self) -> int:
        return self.total_tokens or self.prompt_tokens + self.completion_tokens


class _Reported(msgspec.Struct):
    choices: list[Any] = msgspec.field(default_factory=list)
    usage: _Usage | None = None


def prompt_count(req: CompletionRequest) -> int:
    """How many prompts a completion request holds (each gets `n` choices)."""
    p = req.prompt
    if isinstance(p, str) or not p or all(isinstance(x, int) for x in p):
        return 1
    return len(p)


def most_tokens(
    req: ChatCompletionRequest | CompletionRequest, prompt_tokens: int, context: int | None, tpm: int
) -> int:
    if isinstance(req, ChatCompletionRequest):
        prompts, choices = 1, req.n or 1
        max_new = req.max_completion_tokens or req.max_tokens
    else:
        prompts, choices = prompt_count(req), max(req.n or 1, req.best_of or 1)
        max_new = req.max_tokens
    if max_new is None:
        max_new = max(context - prompt_tokens // prompts, 1) if context else tpm
    return prompt_tokens + prompts * choices * max_new


def with_usage(req: ChatCompletionRequest | CompletionRequest, raw: bytes) -> bytes:
    """The body to send: a stream asks for its usage chunk. The client's bytes stay as sent, the
    field put in front of them, unless the body names stream_options already (then re-encoded)."""
    if not req.stream or (req.stream_options is not None and req.stream_options.include_usage):
        return raw
    start = raw.find(b"{")  # the body decoded as an object: its first brace opens it
    if _OPTIONS_NAME not in raw:
        return raw[: start + 1] + _ASK_USAGE + raw[start + 1 :]
    body = msgspec.json.decode(raw)
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    body["stream_options"] = {**options, "include_usage": True}
    return msgspec.json.encode(body)


def _reported(data: bytes) -> _Reported | None:
    try:
        return msgspec.json.decode(data, type=_Reported)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class Settle:
    """One request's reservation, settled once from what its answer reports."""

    def __init__(self, limiter: Limiter, ticket: Ticket) -> None:
        self._limiter = limiter
        self._ticket = ticket

    def nothing_used(self) -> None:
        self._limiter.settle(self._ticket, 0)

    def on(self, answered: Answered, client_asked_usage: bool) -> Answered:
        if isinstance(answered, Stream):
            source = cast(AsyncIterator[bytes], answered.iterator)
            answered.iterator = self._relay(source, client_asked_usage)
            return answered
        if (answered.status_code or 200) >= 400:
            self.nothing_used()
            return answered
        reported = _reported(answered.content if isinstance(answered.content, bytes) else b"")
        if reported is not None and reported.usage is not None:
            self._limiter.settle(self._ticket, reported.usage.used())
        return answered

    async def _relay(self, source: AsyncIterator[bytes], keep_usage_chunk: bool) -> AsyncIterator[bytes]:
        used: int | None = None
        try:
            async for piece in source:
                if _USAGE_MARK not in piece:
                    yield piece
                    continue
                kept = []
                for event in piece.split(b"\n\n"):
                    if _USAGE_MARK in event and event.startswith(b"data: "):
                        reported = _reported(event[len(b"data: ") :])
                        if reported is not None and reported.usage is not None:
                            used = reported.usage.used()
                            if not keep_usage_chunk and not reported.choices:
                                continue  # the chunk the router asked for, not the client
                    kept.append(event)
                out = b"\n\n".join(kept)
                if out.strip():
                    yield out if out.endswith(b"\n\n") else out + b"\n\n"
        finally:
            if used is not None:
                self._limiter.settle(self._ticket, used)
