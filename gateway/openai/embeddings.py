"""POST /v1/embeddings: inputs (text or token ids) -> the engine's pooled, L2-normalized hidden states.

The vectors are the served chat model's own final-normed hidden states (cloud/engine/embedding.py),
mean-pooled unless the request asks `ctxfuse.pooling: "last"`. `dimensions` keeps the first that many
components and normalizes again; the model was not trained Matryoshka-style, so how much a shortened
vector keeps is unmeasured. Every input is checked here, before any work: the engine trusts them.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np

from gateway.seam import Backend
from shared.embeddings_protocol import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from shared.errors import ContextLengthExceededError, InvalidRequestError

MAX_INPUTS = 2048  # per request, as OpenAI

_SHAPES = "input must be a string, a list of strings, a list of token ids or a list of token-id lists"


TOKEN_IDS_REFUSED = (
    "this server takes text only as embeddings input, not token ids (started with "
    "--no-embedding-token-ids): ids from another model's vocabulary embed as nonsense. Send the text; "
    "with LangChain's OpenAIEmbeddings, set check_embedding_ctx_length=False"
)


def _token_lists(req: EmbeddingRequest, backend: Backend, token_ids: bool) -> list[list[int]]:
    given = req.input
    if isinstance(given, str):
        given = [given]
    if not given:
        raise InvalidRequestError("input must not be empty", param="input")
    if not token_ids and not all(isinstance(x, str) for x in given):
        raise InvalidRequestError(TOKEN_IDS_REFUSED, param="input", code="token_ids_not_accepted")
    if all(isinstance(x, int) for x in given):
        return [[x for x in given if isinstance(x, int)]]
    if all(isinstance(x, str) for x in given):
        if len(given) > MAX_INPUTS:
            raise InvalidRequestError(f"input holds {len(given)} items; at most {MAX_INPUTS}", param="input")
        if any(x == "" for x in given):
            raise InvalidRequestError("input must not hold an empty string", param="input")
        return [backend.tokenizer.encode(x, add_special=True) for x in given if isinstance(x, str)]
    if all(isinstance(x, list) for x in given):
        return [x for x in given if isinstance(x, list)]
    raise InvalidRequestError(_SHAPES, param="input")


def plan_inputs(req: EmbeddingRequest, backend: Backend, token_ids: bool = True) -> list[list[int]]:
    """The request's inputs as token-id lists, each checked; raises the client's mistake. Token ids
    are taken as input (as OpenAI takes them) unless `token_ids` is off (--no-embedding-token-ids)."""
    if req.dimensions is not None and not 1 <= req.dimensions <= backend.hidden_size:
        raise InvalidRequestError(
            f"dimensions must be between 1 and {backend.hidden_size} (this model's embedding size), "
            f"got {req.dimensions}",
            param="dimensions",
        )
    inputs = _token_lists(req, backend, token_ids)
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(f"input holds {len(inputs)} items; at most {MAX_INPUTS}", param="input")
    vocab, limit = backend.tokenizer.vocab_size, backend.max_model_len
    for ids in inputs:
        if not ids:
            raise InvalidRequestError("input must not hold an empty token list", param="input")
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(
                f"input holds a token id outside the vocabulary (0..{vocab - 1})", param="input"
            )
        if len(ids) > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens, however you requested "
                f"{len(ids)} tokens in an input. Please reduce the input's length.",
                param="input",
            )
    return inputs


async def prepare(req: EmbeddingRequest, backend: Backend, token_ids: bool = True) -> list[list[int]]:
    """plan_inputs on a worker thread: tokenizing never holds up the event loop."""
    return await asyncio.to_thread(plan_inputs, req, backend, token_ids)


def response(
    req: EmbeddingRequest, vectors: np.ndarray, inputs: list[list[int]], model: str
) -> EmbeddingList:
    """vectors: [inputs, hidden] float32, L2-normalized."""
    if req.dimensions is not None:  # the leading dimensions, normalized again (Matryoshka-style)
        cut = vectors[:, : req.dimensions]
        norms = np.linalg.norm(cut, axis=-1, keepdims=True)
        vectors = cut / np.maximum(norms, np.float32(1e-12))
    data = []
    for i, v in enumerate(vectors):
        e: list[float] | str
        if req.encoding_format == "base64":  # as OpenAI's SDK decodes it: little-endian float32
            e = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        else:
            e = v.tolist()
        data.append(Embedding(index=i, embedding=e))
    tokens = sum(len(ids) for ids in inputs)
    return EmbeddingList(
        data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )


async def embed(req: EmbeddingRequest, backend: Backend, inputs: list[list[int]], rid: str) -> EmbeddingList:
    pooling = req.ctxfuse.pooling if req.ctxfuse is not None else "mean"
    vectors = await backend.embed(inputs, pooling, rid)
    return await asyncio.to_thread(response, req, vectors, inputs, backend.model_name)
