"""The OpenAPI document's bodies, from the wire Structs themselves.

Routes decode their bodies strictly (openai/decode.py) rather than through Litestar, so Litestar cannot see
the request and response types; here their msgspec JSON schemas are put into the document Litestar
generated (built once, at app creation), so clients and fuzzers read the same types the server decodes.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
from litestar import Litestar
from litestar.openapi.spec import (
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Reference,
    RequestBody,
    Schema,
)

from shared.batch_protocol import Batch, BatchCreateRequest, BatchList, FileDeleted, FileList, FileObject
from shared.embeddings_protocol import EmbeddingList, EmbeddingRequest
from shared.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)
from shared.responses_protocol import InputItemList, LifecycleEvent, ResponseDeleted, ResponsesRequest
from shared.responses_protocol import Response as ResponseObject
from shared.service_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    Model,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

_REF = "#/components/schemas/{name}"
_JSON = "application/json"
_SSE = "text/event-stream"

# (path, method) -> (request type or None, 200 body type, streamed chunk type or None)
_ROUTES: dict[tuple[str, str], tuple[type | None, type, type | None]] = {
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    ("/v1/completions", "post"): (CompletionRequest, Completion, Completion),
    ("/v1/embeddings", "post"): (EmbeddingRequest, EmbeddingList, None),
    ("/v1/models", "get"): (None, ModelList, None),
    ("/v1/models/{model_id}", "get"): (None, Model, None),
    ("/tokenize", "post"): (TokenizeRequest, TokenizeResponse, None),
    ("/detokenize", "post"): (DetokenizeRequest, DetokenizeResponse, None),
    ("/v1/files", "post"): (None, FileObject, None),  # a multipart form: _MULTIPART
    ("/v1/files", "get"): (None, FileList, None),
    ("/v1/files/{file_id}", "get"): (None, FileObject, None),
    ("/v1/files/{file_id}", "delete"): (None, FileDeleted, None),
    ("/v1/files/{file_id}/content", "get"): (None, bytes, None),  # the file's bytes: _BINARY
    ("/v1/batches", "post"): (BatchCreateRequest, Batch, None),
    ("/v1/batches", "get"): (None, BatchList, None),
    ("/v1/batches/{batch_id}", "get"): (None, Batch, None),
    ("/v1/batches/{batch_id}/cancel", "post"): (None, Batch, None),
    # with "stream": true, Responses events (responses_stream.py); each names its `type`, the first
    # and last carry the response
    ("/v1/responses", "post"): (ResponsesRequest, ResponseObject, LifecycleEvent),
    ("/v1/responses/{response_id}", "get"): (None, ResponseObject, None),
    ("/v1/responses/{response_id}", "delete"): (None, ResponseDeleted, None),
    ("/v1/responses/{response_id}/input_items", "get"): (None, InputItemList, None),
}
_MULTIPART = {
    ("/v1/files", "post"): {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"enum": ["batch"]}},
    }
}
_BINARY = {
    "application/octet-stream": OpenAPIMediaType(
        schema=Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY)
    )
}

# the operational routes answer a Health body whatever the status: /ready's 503 says why, not an error
_OPS: dict[str, dict[str, type]] = {
    "/health": {"200": Health},
    "/ready": {"200": Health, "503": Health},
}


def _ref(t: type) -> Reference:
    return Reference(ref=_REF.format(name=t.__name__))


def _media(t: type) -> OpenAPIMediaType:
    return OpenAPIMediaType(schema=_ref(t))


def document_bodies(app: Litestar) -> None:
    types: set[type] = {ErrorResponse, Health}
    for req, resp, chunk in _ROUTES.values():
        types |= {t for t in (req, resp, chunk) if t is not None and t is not bytes}
    _, components = msgspec.json.schema_components(sorted(types, key=lambda t: t.__name__), ref_template=_REF)
    doc = app.openapi_schema
    if doc.components.schemas is None:
        doc.components.schemas = {}
    # plain JSON-schema dicts: Litestar serializes dict values as they are
    doc.components.schemas.update(cast(dict[str, Schema], components))
    error = OpenAPIResponse(description="an OpenAI error body", content={_JSON: _media(ErrorResponse)})
    for (path, method), (req, resp, chunk) in _ROUTES.items():
        item = (doc.paths or {}).get(path)
        op = getattr(item, method, None) if item is not None else None
        if op is None:
            continue
        if req is not None:
            op.request_body = RequestBody(content={_JSON: _media(req)}, required=True)
        form = _MULTIPART.get((path, method))
        if form is not None:
            multipart = OpenAPIMediaType(schema=cast(Schema, form))
            op.request_body = RequestBody(content={"multipart/form-data": multipart}, required=True)
        content: dict[str, Any] = _BINARY if resp is bytes else {_JSON: _media(resp)}
        if chunk is not None:
            # with "stream": true: `data: <chunk>` events, then [DONE]. Before OpenAPI 3.2 `schema`
            # describes one event (its `data` is text), not the chunk JSON inside it
            data = {"type": "string", "description": f"a {chunk.__name__} as JSON, or [DONE] last"}
            event = {"type": "object", "required": ["data"], "properties": {"data": data}}
            content[_SSE] = OpenAPIMediaType(schema=cast(Schema, event))
        op.responses = {
            "200": OpenAPIResponse(description="success", content=content),
            "4XX": error,
            "5XX": error,
        }
    for path, bodies in _OPS.items():
        item = (doc.paths or {}).get(path)
        if item is not None and item.get is not None:
            item.get.responses = {
                status: OpenAPIResponse(description="the status", content={_JSON: _media(t)})
                for status, t in bodies.items()
            }
