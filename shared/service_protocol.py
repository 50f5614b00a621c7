"""The wire types of the server's own routes beside OpenAI's inference API: the model list, vLLM's
`/tokenize` and `/detokenize` (an extension its clients use), the error body and `/health`. OpenAI's
request and response types for chat and completions are shared/protocol.py's."""

from __future__ import annotations

from typing import Literal

from msgspec import UNSET, Struct, UnsetType

from .protocol import ChatMessage


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for `prompt`: BOS when the model asks for one
    # `messages` are rendered with the chat template, generation prompt included, exactly as chat does


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class Model(Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "ctxfuse"
    object: Literal["model"] = "model"
    max_model_len: int | UnsetType = UNSET  # an extension vLLM clients read


class ModelList(Struct, kw_only=True):
    data: list[Model]
    object: Literal["list"] = "list"


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class ErrorBody(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorBody


class Health(Struct, kw_only=True):
    status: str
