"""POST /v1/chat/completions: messages -> prompt ids -> engine -> a whole response or an SSE stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cloud.engine.request import SamplingParams
from shared.errors import InvalidRequestError
from shared.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
)

from .backend import Backend, Generation
from .encoding import SSE_DONE, sse_event
from .logprobs import chat_logprobs
from .metrics import RequestMeter
from .observe import annotate
from .results import Reply, UsageTally, annotate_usage, collect, metered, visible_samples
from .sampling import sampling_params


def _content_text(i: int, m: ChatMessage) -> str | None:
    if not isinstance(m.content, list):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(
                f"content part type {part.type!r} is not supported here; send text parts",
                param=f"messages[{i}].content[{j}]",
            )
        texts.append(part.text)
    return "\n".join(texts)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them. `developer` is OpenAI's new name for `system`, which
    is the role templates know."""
    if not messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        d["content"] = _content_text(i, m)
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls is not None:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


@dataclass(slots=True)
class ChatPlan:
    """What a chat request asks of the engine, decided before anything is queued."""

    prompt_ids: list[int]
    params: SamplingParams
    logprobs: bool


def plan_chat(req: ChatCompletionRequest, backend: Backend) -> ChatPlan:
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequestError(
            f"response_format {req.response_format.type!r} is not supported yet", param="response_format"
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    prompt_ids = backend.encode_chat(message_dicts(req.messages))
    field, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        field, max_tokens = "max_tokens", req.max_tokens
    if max_tokens is None:  # as OpenAI: up to the context the prompt leaves
        max_tokens = backend.default_max_tokens(len(prompt_ids))
    elif max_tokens < 1:
        raise InvalidRequestError(f"{field} must be at least 1", param=field)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    backend.check(prompt_ids, params)
    return ChatPlan(prompt_ids, params, req.logprobs)


async def whole_response(
    gen: Generation, plan: ChatPlan, reply: Reply, meter: RequestMeter
) -> ChatCompletion:
    tally = UsageTally()
    try:
        choices = await collect(gen, meter, tally, reply.eos_ids)
    finally:
        gen.close()
        annotate_usage(tally)
    if reply.log_content:
        annotate(completion=[choices[i].text for i in sorted(choices)])
    out = []
    for i in sorted(choices):
        c = choices[i]
        lp = ChoiceLogprobs(content=chat_logprobs(reply.texts, c.samples)) if plan.logprobs else None
        out.append(
            ChatChoice(
                index=i,
                message=AssistantMessage(content=c.text),
                logprobs=lp,
                finish_reason=c.finish_reason,
            )
        )
    return ChatCompletion(
        id=reply.id, created=reply.created, model=reply.model, choices=out, usage=tally.usage()
    )


def _chunk(reply: Reply, choices: list[ChunkChoice], include_usage: bool) -> ChatCompletionChunk:
    chunk = ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=choices)
    if include_usage:
        chunk.usage = None
    return chunk


async def stream_response(
    gen: Generation, plan: ChatPlan, reply: Reply, meter: RequestMeter, include_usage: bool
) -> AsyncIterator[bytes]:
    """OpenAI's chunk stream: a role chunk per choice, content deltas, finish reasons, the usage chunk
    when asked, then [DONE]. A failure after the first byte ends the stream with an error event and no
    [DONE], so a client cannot take a truncated answer for a whole one."""
    tally = UsageTally()
    texts: dict[int, str] = {}
    try:
        for i in range(plan.params.n):
            role = ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=""))
            yield sse_event(_chunk(reply, [role], include_usage))
        async for out in metered(gen, meter, tally):
            samples = visible_samples(out, reply.eos_ids)
            if reply.log_content:
                texts[out.index] = texts.get(out.index, "") + out.text
            if not out.text and not samples and not out.finished:
                continue  # text held back (a stop string may be forming): nothing to send yet
            lp = ChoiceLogprobs(content=chat_logprobs(reply.texts, samples)) if plan.logprobs else None
            delta = ChunkDelta(content=out.text) if out.text or lp else ChunkDelta()
            choice = ChunkChoice(index=out.index, delta=delta, logprobs=lp, finish_reason=out.finish_reason)
            yield sse_event(_chunk(reply, [choice], include_usage))
        if include_usage:
            final = ChatCompletionChunk(
                id=reply.id, created=reply.created, model=reply.model, choices=[], usage=tally.usage()
            )
            yield sse_event(final)
        yield SSE_DONE
    finally:
        gen.close()
        annotate_usage(tally)
        if reply.log_content:
            annotate(completion=[texts[i] for i in sorted(texts)])
