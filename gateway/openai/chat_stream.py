"""The chat completion stream: OpenAI's chunk format, with tool calls streamed as `delta.tool_calls`
and a structured choice's check (`ctxfuse`) on its last chunk.

A role chunk per choice, content deltas, finish reasons, the usage chunk when asked, then [DONE]. A
failure after the first byte ends the stream with an error event and no [DONE], so a client cannot
take a truncated answer for a whole one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from cloud.grammar.tool_calls import ArgumentsDelta, CallStarted, ContentDelta, StreamEvent, ToolCallStream
from gateway.encoding import SSE_DONE, sse_event
from gateway.openai import structured_result
from gateway.openai.chat import ChatPlan
from gateway.openai.logprobs import chat_logprobs
from gateway.openai.results import (
    Reply,
    annotate_usage,
    choice_failure,
    metered,
    visible_samples,
)
from gateway.openai.structured import Structure
from gateway.ops.metrics import RequestMeter
from gateway.ops.observe import annotate
from gateway.seam import Backend, Generation
from shared.engine_types import RequestOutput
from shared.protocol import (
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    FunctionCallDelta,
    StructuredResult,
    ToolCallDelta,
)


class _StructuredChoice:
    """One structured choice while it streams: its whole text (checked at the end), the evidence for
    field confidence, and for tools the incremental call parser."""

    def __init__(self, structure: Structure, backend: Backend) -> None:
        self.trace = structured_result.ChoiceTrace(structure, backend.tokenizer)
        self.calls = ToolCallStream() if structure.functions is not None else None
        self.call_ids: dict[int, str] = {}

    def deltas(self, out: RequestOutput, eos_ids: frozenset[int]) -> list[ChunkDelta]:
        self.trace.add(out.text, visible_samples(out, eos_ids))
        if self.calls is None:
            return [ChunkDelta(content=out.text)] if out.text else []
        events = self.calls.feed(out.text) if out.text else []
        if out.finished:
            events += self.calls.finish()
        return [d for e in events if (d := self._delta(e)) is not None]

    def _delta(self, e: StreamEvent) -> ChunkDelta | None:
        if isinstance(e, ContentDelta):
            return ChunkDelta(content=e.text) if e.text else None
        if isinstance(e, CallStarted):
            call_id = self.call_ids[e.index] = structured_result.new_call_id()
            fn = FunctionCallDelta(name=e.name, arguments="")
            return ChunkDelta(
                tool_calls=[ToolCallDelta(index=e.index, id=call_id, type="function", function=fn)]
            )
        if isinstance(e, ArgumentsDelta) and e.text:
            fn = FunctionCallDelta(arguments=e.text)
            return ChunkDelta(tool_calls=[ToolCallDelta(index=e.index, function=fn)])
        return None

    def final(self, finish_reason: str | None) -> tuple[str | None, StructuredResult]:
        out = self.trace.finish(finish_reason)
        return out.finish_reason, out.result


def _chunk(reply: Reply, choices: list[ChunkChoice], include_usage: bool) -> ChatCompletionChunk:
    chunk = ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=choices)
    if include_usage:
        chunk.usage = None
    return chunk


def _plain_choice(out: RequestOutput, lp: ChoiceLogprobs | None) -> list[ChunkChoice]:
    delta = ChunkDelta(content=out.text) if out.text or lp else ChunkDelta()
    return [ChunkChoice(index=out.index, delta=delta, logprobs=lp, finish_reason=out.finish_reason)]


def _structured_choices(
    state: _StructuredChoice, out: RequestOutput, lp: ChoiceLogprobs | None, eos_ids: frozenset[int]
) -> list[ChunkChoice]:
    choices = [ChunkChoice(index=out.index, delta=d) for d in state.deltas(out, eos_ids)]
    if lp is not None:
        if not choices:
            choices.append(ChunkChoice(index=out.index, delta=ChunkDelta()))
        choices[0].logprobs = lp
    if out.finished:
        reason, result = state.final(out.finish_reason)
        choices.append(ChunkChoice(index=out.index, delta=ChunkDelta(), finish_reason=reason, ctxfuse=result))
    return choices


async def chunks(
    gen: Generation,
    plan: ChatPlan,
    reply: Reply,
    meter: RequestMeter,
    include_usage: bool,
    backend: Backend,
) -> AsyncIterator[ChatCompletionChunk]:
    """The stream's chunks up to its end ([DONE] is the encoder's: sse_chunks); a failure raises."""
    tally = plan.usage_tally()
    texts: dict[int, str] = {}
    states = {i: _StructuredChoice(plan.structure, backend) for i in range(plan.params.n) if plan.structure}
    try:
        for i in range(plan.params.n):
            role = ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=""))
            yield _chunk(reply, [role], include_usage)
        async for out in metered(gen, meter, tally):
            samples = visible_samples(out, reply.eos_ids)
            if reply.log_content:
                texts[out.index] = texts.get(out.index, "") + out.text
            if not out.text and not samples and not out.finished:
                continue  # text held back (a stop string may be forming): nothing to send yet
            lp = ChoiceLogprobs(content=chat_logprobs(reply.texts, samples)) if plan.logprobs else None
            state = states.get(out.index)
            failure = choice_failure(out)
            if failure is not None:  # stopped short: its last text, and why (the others go on)
                delta = ChunkDelta(content=out.text) if out.text else ChunkDelta()
                choices = [
                    ChunkChoice(
                        index=out.index, delta=delta, logprobs=lp, finish_reason="error", ctxfuse=failure
                    )
                ]
            elif state is None:
                choices = _plain_choice(out, lp)
            else:
                choices = _structured_choices(state, out, lp, reply.eos_ids)
            for choice in choices:
                yield _chunk(reply, [choice], include_usage)
        if include_usage:
            final = ChatCompletionChunk(
                id=reply.id, created=reply.created, model=reply.model, choices=[], usage=tally.usage()
            )
            yield final
    finally:
        gen.close()
        annotate_usage(tally)
        if reply.log_content:
            annotate(completion=[texts[i] for i in sorted(texts)])


async def sse_chunks(source: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[bytes]:
    """A chunk stream as server-sent events, ended by [DONE] only when it ended whole."""
    try:
        async for chunk in source:
            yield sse_event(chunk)
        yield SSE_DONE
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
