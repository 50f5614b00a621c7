"""OpenAI wire types as msgspec Structs: what the edge, the gateway and the workers decode and encode.

Requests are decoded strictly (a string where an int belongs is a 400 naming the field, never a silent
coercion) and an unknown field is a 400 naming it, as OpenAI answers: a field we ignored silently could
be a constraint or an option the client relies on (fail closed). The OpenAI fields we accept without
acting on them are hints that cannot change the output; each says so where it is declared. Response
fields that OpenAI omits rather than sends as null default to `UNSET`, which msgspec leaves out of the
JSON.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from .image_features import ImageFeatures, ImageUrl

Role = Literal["system", "developer", "user", "assistant", "tool"]

# -- requests ---------------------------------------------------------------------------------


class InputAudio(Struct, kw_only=True):
    """OpenAI's audio part, declared only so that its refusal names the part type (chat.py)."""

    data: str | None = None
    format: str | None = None


class FileRef(Struct, kw_only=True):
    """OpenAI's file part, declared only so that its refusal names the part type (chat.py)."""

    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None


class ContentPart(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    type: str  # "text", "image_url" or our "image_features"; anything else is a 400 naming the part
    text: str | None = None
    image_url: ImageUrl | None = None
    image_features: ImageFeatures | None = None
    # OpenAI's other part types (typed, not free JSON: a chat's messages then need no walk for their
    # depth after decoding, gateway/openai/decode.py)
    input_audio: InputAudio | None = None
    file: FileRef | None = None


class ChatMessage(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    # an assistant's earlier refusal, as OpenAI's SDK sends a replayed message back; the turn's text
    # when it has no content (gateway/openai/chat.py)
    refusal: str | None = None


class StreamOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    # accepted and ignored: we add no `obfuscation` padding to chunks, so there is none to turn off
    include_obfuscation: bool | None = None


class JsonSchemaSpec(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # we enforce every schema we accept, strict or not
    description: str | None = None


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema", "regex"] = "text"
    json_schema: JsonSchemaSpec | None = None
    regex: str | None = None  # type "regex" (an extension some clients send): the output matches it


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one of these (gateway/openai/constraint_fields.py)."""

    json: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF


class FunctionDef(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # None: no arguments (an empty object)
    strict: bool | None = None


class Tool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CtxfuseOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    """Our extensions, under the request's `ctxfuse` key."""

    field_confidence: bool = False  # structured output: a confidence per leaf field of the JSON
    # chat only: a conversation too long for the context drops whole old turns (true) or none (false:
    # the engine's token policy applies, error refuses it); None: as the server's --context-overflow
    drop_old_turns: bool | None = None


class SamplingFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """The sampling fields chat and completions share (OpenAI's, then the common extensions)."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    ctxfuse: CtxfuseOptions | None = None
    # Accepted and ignored: OpenAI's hints about storage, billing, caching and abuse tracking. None
    # changes what the model writes, and a client never reads them back from the response.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Constraint extensions, at most one per request with response_format json_*/regex
    # (gateway/openai/constraint_fields.py). vLLM's:
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and ignored: vLLM's choice of constraint engine; ours (xgrammar) enforces the same
    # constraint, so the output a client relies on is unchanged
    guided_decoding_backend: str | None = None
    # llama.cpp's: a GBNF grammar, or a JSON schema for the output
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None


class PredictionText(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class Prediction(Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's predicted output: text the answer will mostly repeat (a file being edited). It only
    speeds the answer up (its tokens are drafts for speculative decoding); the answer is unchanged."""

    type: Literal["content"]
    content: str | list[PredictionText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    prediction: Prediction | None = None
    modalities: list[Literal["text"]] | None = None  # text is all we write; "audio" is a 400
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: more variables for the chat template (e.g. {"enable_thinking": false}); the names the
    # template is always given (messages, tools, the special tokens) are refused
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # a string, a list of strings, a list of token ids or a list of token-id lists
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


# -- responses --------------------------------------------------------------------------------


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0
    # ctxfuse: dropped from the prompt to fit the context (truncate_middle: its middle; drop_old_turns:
    # the old turns' tokens), and the chat messages drop_old_turns dropped
    truncated_tokens: int = 0
    truncated_messages: int = 0


class CompletionTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0
    # OpenAI's names for a prediction's tokens that the output did and did not use; here the drafts of
    # speculative decoding (--speculative ngram) the model accepted and rejected
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = msgspec.field(
        default_factory=CompletionTokensDetails
    )


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct, kw_only=True):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class StructuredResult(Struct, kw_only=True, omit_defaults=True):
    """ctxfuse's report on a structured choice (response_format json_* or tools), under `ctxfuse`."""

    # the output is complete and satisfies its schema (for tools: every call's arguments do)
    valid: bool
    error: str | None = None  # why it is not valid
    # what stopped the choice short, when it ended in error (finish_reason "error"): grammar_dead_end
    code: str | None = None
    # JSON Pointer of each leaf field -> probability of the tokens that wrote its value (when asked)
    field_confidence: dict[str, float] | None = None


class AssistantMessage(Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    ctxfuse: StructuredResult | UnsetType = UNSET


class ChatCompletion(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class FunctionCallDelta(Struct, kw_only=True):
    name: str | UnsetType = UNSET
    arguments: str = ""


class ToolCallDelta(Struct, kw_only=True):
    index: int
    function: FunctionCallDelta
    id: str | UnsetType = UNSET  # the first delta of a call carries its id, type and name
    type: Literal["function"] | UnsetType = UNSET


class ChunkDelta(Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    ctxfuse: StructuredResult | UnsetType = UNSET  # on the choice's last chunk


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    # present (null until the last chunk) only when stream_options.include_usage is set
    usage: Usage | UnsetType | None = UNSET


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    ctxfuse: StructuredResult | UnsetType = UNSET


class Completion(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None
    usage: Usage | UnsetType | None = UNSET
