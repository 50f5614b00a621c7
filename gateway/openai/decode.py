"""Strict decoding of request bodies into wire Structs, with the client's mistake named as OpenAI does.

Litestar's own body decoding coerces ("5" becomes 5) and answers in its own error shape; decoding here
keeps one rule for every route: a wrong type is a 400 whose `param` is the field's path.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from shared.errors import InvalidRequestError

T = TypeVar("T")

_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def _param(message: str) -> tuple[str, str | None]:
    """Split msgspec's message into (reason, field path), e.g. ("Expected `int`...", "max_tokens")."""
    path: str | None = None
    at = _AT.search(message)
    if at:
        message = message[: at.start()]
        path = at.group("path").replace("[...]", "") or None
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing.group('field')}" if path else missing.group("field")
    return message, path


def decode_body(body: bytes, type_: type[T]) -> T:
    if not body.strip():
        raise InvalidRequestError("the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_, strict=True)
    except msgspec.ValidationError as exc:
        reason, param = _param(str(exc))
        where = f" (at `{param}`)" if param else ""
        raise InvalidRequestError(f"invalid request: {reason}{where}", param=param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(
            f"the request body is not valid JSON ({exc}); send a JSON object with Content-Type: "
            "application/json"
        ) from None
