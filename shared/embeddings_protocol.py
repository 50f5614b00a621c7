"""The wire types of `POST /v1/embeddings` (OpenAI's shape), decoded strictly like every request."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

EMBEDDINGS_PATH = "/v1/embeddings"


class EmbeddingOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    """Our extensions, under the request's `ctxfuse` key."""

    # how the hidden states become one vector: the mean over positions (default) or the last one
    pooling: Literal["mean", "last"] = "mean"


class EmbeddingRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    # a string, a list of strings, a list of token ids or a list of token-id lists (OpenAI's four)
    input: str | list[str | int | list[int]]  # mixed lists are refused by the plan
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored: OpenAI's abuse-tracking hint
    ctxfuse: EmbeddingOptions | None = None


class Embedding(Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"
