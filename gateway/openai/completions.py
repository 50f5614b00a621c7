"""POST /v1/completions: one or more prompts (text or token ids) -> engine -> a whole response or SSE.

Choice `p * n + i` is choice i of prompt p, as OpenAI numbers them. The engine computes no logprobs
for prompt tokens, so `echo` with `logprobs` is refused rather than answered with made-up numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cloud.model.tokenizer import Tokenizer
from gateway.encoding import SSE_DONE, sse_event
from gateway.openai import structured_result
from gateway.openai.constraint_fields import output_constraint
from gateway.openai.logprobs import append_completion_logprobs
from gateway.openai.merge import merge
from gateway.openai.results import (
    ChoiceResult,
    Reply,
    UsageTally,
    annotate_usage,
    choice_failure,
    collect,
    metered,
    visible_samples,
)
from gateway.openai.sampling import sampling_params
from gateway.openai.structured import Structure
from gateway.ops.metrics import RequestMeter
from gateway.ops.observe import annotate
from gateway.seam import Backend, Generation
from shared.engine_types import RequestOutput, SampleResult, SamplingParams
from shared.errors import InvalidRequestError
from shared.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    StructuredResult,
)


def _prompt_ids(req: CompletionRequest, backend: Backend) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [backend.tokenizer.encode(p, add_special=True)]
    if not p:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    texts = [x for x in p if isinstance(x, str)]
    ids = [x for x in p if isinstance(x, int)]
    lists = [x for x in p if isinstance(x, list)]
    if len(texts) == len(p):
        return [backend.tokenizer.encode(x, add_special=True) for x in texts]
    if len(ids) == len(p):
        return [ids]
    if len(lists) == len(p):
        return lists
    raise InvalidRequestError(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        param="prompt",
    )


@dataclass(slots=True)
class CompletionPlan:
    prompts: list[list[int]]
    params: SamplingParams
    echo: bool
    logprobs: bool
    echo_texts: list[str] = field(default_factory=list)
    structure: Structure | None = None  # a JSON constraint: the text must be that JSON


async def prepare(req: CompletionRequest, backend: Backend) -> CompletionPlan:
    """plan_completion on a worker thread (tokenizing and schema compilation never hold up the event
    loop), after refusing by its size a prompt text too long for the context."""
    texts = [req.prompt] if isinstance(req.prompt, str) else [x for x in req.prompt if isinstance(x, str)]
    for text in texts:
        backend.check_text_size(len(text))
    return await asyncio.to_thread(plan_completion, req, backend)


def plan_completion(req: CompletionRequest, backend: Backend) -> CompletionPlan:
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    if req.ctxfuse is not None and req.ctxfuse.drop_old_turns:
        raise InvalidRequestError(
            "ctxfuse.drop_old_turns drops turns of a chat; a completion's prompt has none",
            param="ctxfuse.drop_old_turns",
        )
    prompts = _prompt_ids(req, backend)
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = backend.default_max_tokens(max(len(p) for p in prompts))
    params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
    confidence = req.ctxfuse is not None and req.ctxfuse.field_confidence
    asked = output_constraint(req, confidence)
    # JSON is checked once finished (structure); a regex, choice or grammar output is plain text
    structure = asked if isinstance(asked, Structure) else None
    if asked is not None:
        params.grammar = asked.spec if isinstance(asked, Structure) else asked
        params.constrained_logprobs = confidence
    elif confidence:
        raise InvalidRequestError(
            "ctxfuse.field_confidence needs response_format json_object or json_schema",
            param="ctxfuse.field_confidence",
        )
    if req.echo and req.logprobs is not None:
        params.prompt_logprobs = req.logprobs  # the echoed prompt carries its own logprobs
    for ids in prompts:  # every prompt is checked before any is queued
        backend.check(ids, params)
    echo_texts = [backend.tokenizer.decode(ids) for ids in prompts] if req.echo else []
    return CompletionPlan(prompts, params, req.echo, req.logprobs is not None, echo_texts, structure)


async def submit_all(
    backend: Backend, plan: CompletionPlan, request_id: str, priority: int = 0
) -> list[Generation]:
    gens: list[Generation] = []
    try:
        for p, ids in enumerate(plan.prompts):
            rid = f"{request_id}-{p}" if p else request_id
            gens.append(await backend.submit(ids, plan.params, rid, priority=priority))
    except BaseException:
        for g in gens:
            g.close()
        raise
    return gens


def _choice(
    plan: CompletionPlan, reply: Reply, p: int, c: ChoiceResult, tokenizer: Tokenizer
) -> CompletionChoice:
    prefix = plan.echo_texts[p] if plan.echo else ""
    lp = None
    if plan.logprobs:
        lp = CompletionLogprobs()
        offset = append_completion_logprobs(reply.texts, c.prompt_samples, lp, 0) if plan.echo else 0
        append_completion_logprobs(reply.texts, c.samples, lp, offset)
    choice = CompletionChoice(
        index=p * plan.params.n + c.index, text=prefix + c.text, logprobs=lp, finish_reason=c.finish_reason
    )
    if c.failure is not None:
        choice.ctxfuse = c.failure
    elif plan.structure is not None:
        trace = structured_result.ChoiceTrace(plan.structure, tokenizer)
        trace.add(c.text, c.samples)
        choice.ctxfuse = trace.finish(c.finish_reason).result
    return choice


async def whole_response(
    gens: list[Generation], plan: CompletionPlan, reply: Reply, meter: RequestMeter, tokenizer: Tokenizer
) -> Completion:
    tally = UsageTally()
    tasks = [asyncio.ensure_future(collect(g, meter, tally, reply.eos_ids, p)) for p, g in enumerate(gens)]
    try:
        results = await asyncio.gather(*tasks)  # the first failure is raised as itself
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.close()
        annotate_usage(tally)
    choices = [_choice(plan, reply, p, c, tokenizer) for p, r in enumerate(results) for c in r.values()]
    choices.sort(key=lambda c: c.index)
    if reply.log_content:
        annotate(completion=[c.text for c in choices])
    return Completion(
        id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=tally.usage()
    )


def _streamed_result(
    structure: Structure | None,
    traces: dict[int, structured_result.ChoiceTrace],
    index: int,
    out: RequestOutput,
    samples: list[SampleResult],
    tokenizer: Tokenizer,
) -> StructuredResult | None:
    """A streamed choice's `ctxfuse` report, on its last chunk: why it failed, or its structure's check."""
    failure = choice_failure(out)
    if failure is not None or structure is None:
        return failure
    trace = traces.setdefault(index, structured_result.ChoiceTrace(structure, tokenizer))
    trace.add(out.text, samples)
    return trace.finish(out.finish_reason).result if out.finished else None


async def stream_response(
    gens: list[Generation],
    plan: CompletionPlan,
    reply: Reply,
    meter: RequestMeter,
    include_usage: bool,
    tokenizer: Tokenizer,
) -> AsyncIterator[bytes]:
    """Completion chunks, then the usage chunk when asked, then [DONE]; an error event on failure.
    A structured choice's check (`ctxfuse`) comes with its last chunk."""
    tally = UsageTally()
    n = plan.params.n
    traces: dict[int, structured_result.ChoiceTrace] = {}
    offsets: dict[int, int] = {}  # per choice: text offset for logprobs
    echoed: set[int] = set()

    def chunk(choices: list[CompletionChoice]) -> Completion:
        c = Completion(id=reply.id, created=reply.created, model=reply.model, choices=choices)
        if include_usage:
            c.usage = None
        return c

    try:
        streams = [metered(g, meter, tally, p) for p, g in enumerate(gens)]
        async for p, out in merge(streams):
            index = p * n + out.index
            text = out.text
            if plan.echo and index not in echoed:
                echoed.add(index)
                text = plan.echo_texts[p] + text
            samples = visible_samples(out, reply.eos_ids)
            if not text and not samples and not out.finished:
                continue
            lp = None
            if plan.logprobs:
                lp = CompletionLogprobs()
                if out.prompt_logprobs is not None and plan.echo:
                    offsets[index] = append_completion_logprobs(reply.texts, out.prompt_logprobs, lp, 0)
                offsets[index] = append_completion_logprobs(reply.texts, samples, lp, offsets.get(index, 0))
            choice = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=out.finish_reason)
            result = _streamed_result(plan.structure, traces, index, out, samples, tokenizer)
            if result is not None:
                choice.ctxfuse = result
            yield sse_event(chunk([choice]))
        if include_usage:
            final = Completion(
                id=reply.id, created=reply.created, model=reply.model, choices=[], usage=tally.usage()
            )
            yield sse_event(final)
        yield SSE_DONE
    finally:
        for g in gens:
            g.close()
        annotate_usage(tally)
