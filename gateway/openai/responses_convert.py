"""The Responses API in terms of chat completions: a Responses request becomes a chat completion
body (the gateway's own /v1/chat/completions path answers it, over any upstream), and the chat
completion it gets back becomes a response object.

Only fields the chat request knows are sent (it refuses unknown ones); what the Responses request
asks that chat cannot honour is refused here, naming the field, before any work is queued.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

import msgspec

from shared.errors import InvalidRequestError
from shared.protocol import ChatCompletion, StructuredResult, Usage
from shared.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutput,
    FunctionTool,
    IncompleteDetails,
    InputItem,
    InputText,
    InputTokensDetails,
    Item,
    Message,
    MessageRole,
    OutputText,
    OutputTokensDetails,
    Response,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    TextConfig,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- request: input items -----------------------------------------------------------------------


def _text_parts(item: InputItem, where: str) -> list[InputText | OutputText]:
    assistant = item.role == "assistant"
    if isinstance(item.content, str):
        return [OutputText(text=item.content) if assistant else InputText(text=item.content)]
    if item.content is None:
        raise InvalidRequestError("a message item needs `content`", param=f"{where}.content")
    parts: list[InputText | OutputText] = []
    for j, part in enumerate(item.content):
        text = part.refusal if part.type == "refusal" else part.text
        if part.type not in ("input_text", "output_text", "refusal") or text is None:
            raise InvalidRequestError(
                f"content type {part.type!r} is not supported here; send input_text (with `text`)",
                param=f"{where}.content[{j}]",
            )
        parts.append(OutputText(text=text) if assistant else InputText(text=text))
    return parts


def _item(item: InputItem, where: str) -> Item:
    kind = item.type or "message"
    if kind == "message":
        if item.role not in ("user", "system", "developer", "assistant"):
            raise InvalidRequestError(
                "a message's role must be user, system, developer or assistant", param=f"{where}.role"
            )
        role = cast(MessageRole, item.role)
        return Message(id=item.id or new_id("msg"), role=role, content=_text_parts(item, where))
    if kind == "function_call":
        if item.call_id is None or item.name is None or item.arguments is None:
            raise InvalidRequestError("a function_call item needs call_id, name and arguments", param=where)
        return FunctionCallItem(
            id=item.id or new_id("fc"), call_id=item.call_id, name=item.name, arguments=item.arguments
        )
    if kind == "function_call_output":
        if item.call_id is None or item.output is None:
            raise InvalidRequestError("a function_call_output item needs call_id and output", param=where)
        return FunctionCallOutput(id=item.id or new_id("fco"), call_id=item.call_id, output=item.output)
    raise InvalidRequestError(
        f"input item type {kind!r} is not supported here; send message, function_call or "
        "function_call_output items",
        param=f"{where}.type",
    )


def input_items(req: ResponsesRequest) -> list[Item]:
    """The request's `input` as typed items, each with an id (input_items lists them)."""
    if isinstance(req.input, str):
        return [Message(id=new_id("msg"), role="user", content=[InputText(text=req.input)])]
    if not req.input:
        raise InvalidRequestError("input must hold at least one item", param="input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(req.input)]


# -- request: the chat body ---------------------------------------------------------------------


LOGPROBS_INCLUDE = "message.output_text.logprobs"
# reasoning.encrypted_content is accepted and adds nothing: the served models make no reasoning items
_INCLUDABLE = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Output tokens' logprobs are asked for by `include`, or by asking for their alternatives."""
    return LOGPROBS_INCLUDE in (req.include or []) or bool(req.top_logprobs)


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 for what the request asks that we cannot honour (fail closed, naming the field)."""
    if req.background:
        raise InvalidRequestError("background responses are not supported here", param="background")
    if req.reasoning is not None and req.reasoning.effort not in (None, "none"):
        raise InvalidRequestError(
            "the served models do not reason; leave out reasoning or set its effort to 'none'",
            param="reasoning.effort",
        )
    if req.reasoning is not None and req.reasoning.summary is not None:
        raise InvalidRequestError("reasoning summaries are not supported here", param="reasoning.summary")
    for i, name in enumerate(req.include or []):
        if name not in _INCLUDABLE:
            raise InvalidRequestError(
                f"include {name!r} is not supported here; the one output that can be included is "
                f"{LOGPROBS_INCLUDE!r}",
                param=f"include[{i}]",
            )
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise InvalidRequestError(
                f"tool type {tool.type!r} is not supported here (no built-in tools); send function tools",
                param=f"tools[{i}].type",
            )
        if not tool.name:
            raise InvalidRequestError("a function tool needs a name", param=f"tools[{i}].name")


def _chat_message(item: Item) -> dict[str, Any]:
    if isinstance(item, Message):
        return {"role": item.role, "content": "".join(part.text for part in item.content)}
    if isinstance(item, FunctionCallItem):
        fn = {"name": item.name, "arguments": item.arguments}
        call = {"id": item.call_id, "type": "function", "function": fn}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "tool", "tool_call_id": item.call_id, "content": item.output}


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """Chat messages for the conversation: instructions first, then the items in order; the function
    calls of one model turn are one assistant message, as chat templates expect."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        out.append({"role": "developer", "content": instructions})
    for item in items:
        message = _chat_message(item)
        last = out[-1] if out else None
        if "tool_calls" in message and last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).extend(message["tool_calls"])
            continue
        out.append(message)
    return out


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema, "strict": fmt.strict}
    if fmt.description is not None:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}


def _tools(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.parameters, "strict": t.strict}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def chat_body(req: ResponsesRequest, items: list[Item]) -> bytes:
    """The chat completion request for `req` over the whole conversation `items`."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.instructions, items)}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for field in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if (value := getattr(req, field)) is not None:
            body[field] = value
    if wants_logprobs(req):  # the chat path checks top_logprobs' range, naming the same field
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if (fmt := _response_format(req.text)) is not None:
        body["response_format"] = fmt
    if req.tools:
        body["tools"] = _tools(req.tools)
    if isinstance(req.tool_choice, str):
        body["tool_choice"] = req.tool_choice
    elif req.tool_choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    if req.truncation is not None:  # auto: drop the oldest turns to fit; disabled: refuse instead
        body["ctxfuse"] = {"drop_old_turns": req.truncation == "auto"}
    if req.stream:  # usage arrives on the last chunk, for response.completed
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return msgspec.json.encode(body)


# -- response -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Draft:
    """A response before its output: what the request set, echoed on the response object."""

    req: ResponsesRequest
    id: str
    created_at: int

    @classmethod
    def of(cls, req: ResponsesRequest) -> Draft:
        return cls(req, new_id("resp"), int(time.time()))

    def response(
        self, status: ResponseStatus, output: list[Item], usage: ResponseUsage | None = None
    ) -> Response:
        req = self.req
        out = Response(
            id=self.id,
            created_at=self.created_at,
            status=status,
            model=req.model,
            output=output,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            store=req.store,
            temperature=req.temperature,
            tool_choice=req.tool_choice or "auto",
            tools=req.tools or [],
            top_p=req.top_p,
            truncation=req.truncation or "disabled",
            usage=usage,
            user=req.user,
            top_logprobs=req.top_logprobs,
            prompt_cache_key=req.prompt_cache_key,
            safety_identifier=req.safety_identifier,
        )
        if req.text is not None and req.text.format is not None:
            out.text = req.text
        if status == "completed":
            out.completed_at = int(time.time())
        elif status == "incomplete":
            out.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return out


def usage_of(usage: Usage) -> ResponseUsage:
    details = usage.prompt_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=details.cached_tokens,
            truncated_tokens=details.truncated_tokens,
            truncated_messages=details.truncated_messages,
        ),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.total_tokens,
    )


def status_of(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"


def failed_by_request(finish_reason: str | None, result: StructuredResult | msgspec.UnsetType | None) -> None:
    """Raise the request's own error for an answer it stopped short (its grammar's dead end): a
    response has one output, so it fails whole."""
    if finish_reason == "error":
        failure = result if isinstance(result, StructuredResult) else None
        message = failure.error if failure is not None and failure.error else "the answer ended in error"
        raise InvalidRequestError(message, code=failure.code if failure is not None else None)


def whole_response(draft: Draft, chat: ChatCompletion) -> Response:
    """The response object for a whole chat completion (its one choice)."""
    if not chat.choices:
        return draft.response("completed", [], usage_of(chat.usage))
    choice = chat.choices[0]
    failed_by_request(choice.finish_reason, choice.ctxfuse)
    message = choice.message
    status = status_of(choice.finish_reason)
    output: list[Item] = []
    if message.content or not message.tool_calls:
        logprobs = choice.logprobs.content if choice.logprobs is not None else None
        text = OutputText(text=message.content or "", logprobs=list(logprobs or []))
        output.append(Message(id=new_id("msg"), role="assistant", content=[text], status=status))
    for call in message.tool_calls or []:
        fn = call.function
        output.append(
            FunctionCallItem(id=new_id("fc"), call_id=call.id, name=fn.name, arguments=fn.arguments)
        )
    return draft.response(status, output, usage_of(chat.usage))
