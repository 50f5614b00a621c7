"""The Responses API's wire types (OpenAI's `/v1/responses`) as msgspec Structs.

Requests refuse unknown fields (`forbid_unknown_fields`): an argument we do not know is a 400 naming
it, never silently dropped. Conversation items are tagged by `type`, so the items we store decode
back into the same Structs; a message item may come without `type` (the SDK's short form
`{"role": "user", "content": "..."}`), so request input items are one loose Struct that
gateway/openai/responses_convert.py checks and normalizes into the tagged ones.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["completed", "failed", "in_progress", "incomplete"]
MessageRole = Literal["user", "system", "developer", "assistant"]

# -- requests ---------------------------------------------------------------------------------


class InputContent(Struct, kw_only=True, forbid_unknown_fields=True):
    """A content part of an input message: `input_text`, or an earlier answer's `output_text` or
    `refusal` sent back; other types are refused by name in the converter."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # an output_text sent back: ignored
    logprobs: list[Any] | None = None
    # the fields of input_image and input_file parts, known so that the part is refused by its type
    image_url: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    file_data: str | None = None
    filename: str | None = None
    detail: str | None = None


class InputItem(Struct, kw_only=True, forbid_unknown_fields=True):
    """One item of `input`: a message (with or without `type`), a function call the model made, or
    its output."""

    type: str | None = None
    id: str | None = None
    status: str | None = None
    role: str | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class TextFormat(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None


class FunctionTool(Struct, kw_only=True, forbid_unknown_fields=True):
    """Responses' flat function tool; any other `type` (web_search, file_search, ...) is refused."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class Reasoning(Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None  # only "none": the served models do not reason
    summary: str | None = None


class ResponsesStreamOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    # accepted and ignored: no `obfuscation` padding is added to events, so there is none to turn off
    include_obfuscation: bool | None = None


class ResponsesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: Reasoning | None = None
    background: bool | None = None  # only false: a response is answered while the request waits
    # auto: a conversation too long for the context drops its oldest turns (cloud/text/history.py);
    # disabled (OpenAI's default): none, so it is refused with context_length_exceeded (unless the
    # engine truncates tokens itself: truncate_middle, sliding_window); None: --context-overflow decides
    truncation: Literal["auto", "disabled"] | None = None
    # "message.output_text.logprobs" asks for each output token's logprob (with `top_logprobs`
    # alternatives); others are refused by name (responses_convert.py)
    include: list[str] | None = None
    top_logprobs: int | None = None
    stream_options: ResponsesStreamOptions | None = None
    # accepted and echoed: prefix caching needs no key here (every request's prompt is looked up),
    # and the identifier is the caller's own record, like `user`
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None  # one tier here: "flex"/"priority" refused


# -- conversation items (input and output, stored) ----------------------------------------------


class InputText(Struct, kw_only=True, tag_field="type", tag="input_text"):
    text: str


class OutputText(Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class Message(Struct, kw_only=True, tag_field="type", tag="message"):
    """A message item: the caller's (`input_text`) or the model's (`output_text`)."""

    id: str
    role: MessageRole
    content: list[InputText | OutputText]
    status: ItemStatus = "completed"


class FunctionCallItem(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    status: ItemStatus = "completed"


class FunctionCallOutput(Struct, kw_only=True, tag_field="type", tag="function_call_output"):
    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


Item = Message | FunctionCallItem | FunctionCallOutput


# -- the response object ------------------------------------------------------------------------


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    # ctxfuse: what truncation dropped to fit the context, as chat's usage.prompt_tokens_details
    truncated_tokens: int = 0
    truncated_messages: int = 0


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(Struct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(Struct, kw_only=True):
    reason: Literal["max_output_tokens", "content_filter"]


class ReasoningOut(Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class Response(Struct, kw_only=True):
    id: str
    created_at: int
    status: ResponseStatus
    model: str
    output: list[Item]
    object: Literal["response"] = "response"
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOut = msgspec.field(default_factory=ReasoningOut)
    store: bool = True
    temperature: float | None = None
    text: TextConfig = msgspec.field(default_factory=lambda: TextConfig(format=TextFormat(type="text")))
    tool_choice: ToolChoice = "auto"
    tools: list[FunctionTool] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    background: bool = False
    top_logprobs: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str = "default"


class ResponseDeleted(Struct, kw_only=True):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(Struct, kw_only=True):
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


# -- stream events ------------------------------------------------------------------------------
# Each event is sent as `event: <type>` + `data: <json>`, numbered by `sequence_number` from 0.


class LifecycleEvent(Struct, kw_only=True):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    sequence_number: int
    response: Response


class OutputItemEvent(Struct, kw_only=True):
    """response.output_item.added / done."""

    type: str
    sequence_number: int
    output_index: int
    item: Item


class ContentPartEvent(Struct, kw_only=True):
    """response.content_part.added / done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(Struct, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: Literal["response.output_text.delta"] = "response.output_text.delta"


class TextDoneEvent(Struct, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: Literal["response.output_text.done"] = "response.output_text.done"


class ArgumentsDeltaEvent(Struct, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"


class ArgumentsDoneEvent(Struct, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str
    name: str | UnsetType = UNSET
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"


class ErrorEvent(Struct, kw_only=True):
    sequence_number: int
    message: str
    code: str | None = None
    param: str | None = None
    type: Literal["error"] = "error"


StreamEvent = (
    LifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)
