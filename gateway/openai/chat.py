"""POST /v1/chat/completions: messages -> prompt ids -> engine -> a whole response (the stream is in
openai/chat_stream.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.openai import history, structured, structured_result
from gateway.openai.constraint_fields import output_constraint
from gateway.openai.images import Images
from gateway.openai.logprobs import chat_logprobs
from gateway.openai.results import ChoiceResult, Reply, UsageTally, annotate_usage, collect
from gateway.openai.sampling import sampling_params
from gateway.openai.structured import Structure
from gateway.ops.metrics import RequestMeter
from gateway.ops.observe import annotate
from gateway.seam import Backend, Generation
from shared.engine_types import ImageSpan, SamplingParams
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec
from shared.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
)


def _content(i: int, m: ChatMessage) -> str | list[dict[str, Any]] | None:
    """A message's content as the engine takes it: a string, or text and image_features parts (image_url
    parts were made into features before this: gateway/openai/images.py)."""
    if not isinstance(m.content, list):
        return m.content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(m.content):
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_features" and part.image_features is not None:
            parts.append({"type": "image_features", "image_features": part.image_features})
        else:
            raise InvalidRequestError(
                f"content part type {part.type!r} is not supported here; send text, image_url or "
                "image_features parts",
                param=f"messages[{i}].content[{j}]",
            )
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them. `developer` is OpenAI's new name for `system`, which
    is the role templates know."""
    if not messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        # a replayed refusal is what the assistant said in that turn
        d["content"] = m.refusal if m.content is None and m.refusal is not None else _content(i, m)
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls is not None:
            d["tool_calls"] = msgspec.to_builtins(m.tool_calls)
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
    structure: Structure | None = None
    image_spans: tuple[ImageSpan, ...] = ()
    dropped_messages: int = 0  # old turns dropped to fit the context (openai/history.py)
    dropped_tokens: int = 0

    def usage_tally(self) -> UsageTally:
        """A tally that starts from what was dropped before the engine saw the prompt."""
        return UsageTally(truncated_tokens=self.dropped_tokens, truncated_messages=self.dropped_messages)


def _structure(
    req: ChatCompletionRequest,
) -> tuple[Structure | None, GrammarSpec | None, structured.ToolsPrompt]:
    """(JSON or tool calls to check once finished, the grammar the output follows, the tools prompt).
    A regex, choice or grammar constraint is a grammar with no Structure: the output is plain text."""
    confidence = req.ctxfuse is not None and req.ctxfuse.field_confidence
    asked = output_constraint(req, confidence)
    tools_out, prompt = structured.tools_structure(req, confidence)
    if asked is not None and tools_out is not None:
        if req.tool_choice in (None, "auto"):
            field = asked.origin if isinstance(asked, GrammarSpec) else asked.spec.origin
            raise InvalidRequestError(
                "an output constraint cannot be combined with tools the model may or may not call; set "
                'tool_choice to "none", "required" or a function',
                param=field.split(".")[0],
            )
        asked = None  # the output is tool calls only
    if isinstance(asked, GrammarSpec):
        return None, asked, prompt
    if confidence and asked is None and tools_out is None:
        raise InvalidRequestError(
            "ctxfuse.field_confidence needs structured output (response_format json_* or tools)",
            param="ctxfuse.field_confidence",
        )
    out = asked or tools_out
    return out, out.spec if out is not None else None, prompt


def plan_chat(req: ChatCompletionRequest, backend: Backend) -> ChatPlan:
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    structure, grammar, tools = _structure(req)
    messages = message_dicts(req.messages)
    field, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        field, max_tokens = "max_tokens", req.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"{field} must be at least 1", param=field)
    fitted = history.chat_prompt(req, backend, messages, tools, max_tokens)
    prompt = fitted.prompt
    prompt_ids = prompt.token_ids
    if max_tokens is None:  # as OpenAI: up to the context the prompt leaves
        max_tokens = backend.default_max_tokens(len(prompt_ids))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    params.grammar = grammar
    params.constrained_logprobs = structure is not None and structure.confidence
    if req.prediction is not None:
        params.prediction = tuple(backend.tokenizer.encode(req.prediction.text, add_special=False))
    backend.check(prompt_ids, params)
    return ChatPlan(
        prompt_ids,
        params,
        req.logprobs,
        structure,
        prompt.image_spans,
        dropped_messages=fitted.dropped_messages,
        dropped_tokens=fitted.dropped_tokens,
    )


def text_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' text: the prompt holds at least these."""
    n = 0
    for m in messages:
        if isinstance(m.content, str):
            n += len(m.content)
        elif isinstance(m.content, list):
            n += sum(len(part.text) for part in m.content if part.text is not None)
    return n


async def prepare(req: ChatCompletionRequest, backend: Backend, images: Images) -> ChatPlan:
    """plan_chat after the request's image_url parts have become features. A text too long for the
    context is refused by its size first (of what cannot be dropped, when old turns may be); the
    template, tokenizing and schema compilation run on a worker thread, so a big prompt never holds
    up the event loop."""
    may_drop = history.drops_old_turns(req, backend)
    backend.check_text_size(text_chars(history.kept_messages(req.messages) if may_drop else req.messages))
    if count := await images.resolve(req.messages):
        annotate(images=count)
    return await asyncio.to_thread(plan_chat, req, backend)


async def submit(backend: Backend, plan: ChatPlan, request_id: str, priority: int = 0) -> Generation:
    return await backend.submit(
        plan.prompt_ids, plan.params, request_id, priority=priority, image_spans=plan.image_spans
    )


def _message(plan: ChatPlan, c: ChoiceResult, reply: Reply, backend: Backend) -> ChatChoice:
    lp = ChoiceLogprobs(content=chat_logprobs(reply.texts, c.samples)) if plan.logprobs else None
    if c.failure is not None:  # stopped short: what it wrote, and why
        message = AssistantMessage(content=c.text)
        return ChatChoice(
            index=c.index, message=message, logprobs=lp, finish_reason="error", ctxfuse=c.failure
        )
    if plan.structure is None:
        message = AssistantMessage(content=c.text)
        return ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=c.finish_reason)
    evidence = None
    if plan.structure.confidence:
        evidence = structured_result.TokenEvidence(backend.tokenizer)
        evidence.add(c.samples)
    out = structured_result.finish(plan.structure, c.text, c.finish_reason, evidence)
    message = AssistantMessage(content=out.content)
    if out.tool_calls:
        message.tool_calls = out.tool_calls
    return ChatChoice(
        index=c.index, message=message, logprobs=lp, finish_reason=out.finish_reason, ctxfuse=out.result
    )


async def whole_response(
    gen: Generation, plan: ChatPlan, reply: Reply, meter: RequestMeter, backend: Backend
) -> ChatCompletion:
    tally = plan.usage_tally()
    try:
        choices = await collect(gen, meter, tally, reply.eos_ids)
    finally:
        gen.close()
        annotate_usage(tally)
    if reply.log_content:
        annotate(completion=[choices[i].text for i in sorted(choices)])
    out = [_message(plan, choices[i], reply, backend) for i in sorted(choices)]
    return ChatCompletion(
        id=reply.id, created=reply.created, model=reply.model, choices=out, usage=tally.usage()
    )
