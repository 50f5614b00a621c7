"""The agent's error answers, in OpenAI's error shape (what the official client parses)."""

from __future__ import annotations

import msgspec
from litestar import Response

JSON = "application/json"


def error_response(
    status: int,
    message: str,
    code: str,
    headers: dict[str, str] | None = None,
    *,
    param: str | None = None,
) -> Response[bytes]:
    body = {
        "error": {
            "message": message,
            "type": "server_error" if status >= 500 else "invalid_request_error",
            "param": param,
            "code": code,
        }
    }
    return Response(msgspec.json.encode(body), status_code=status, media_type=JSON, headers=headers or {})
