"""The one check of a path that a proxy tier forwards (the fleet router to a worker, the edge agent
to the gateway's edge listener), used by both.

A path taken from a client and pasted into a backend URL is a path traversal waiting to happen: the
server decodes `..%2F..%2Finternal%2Fv1%2Fblocks` into `../../internal/v1/blocks`, and the HTTP
client then removes the dot segments, so `/v1/models/{id}` becomes `/internal/v1/blocks` on the
backend, asked with the proxy's own credentials. Normalizing is not enough on its own (what a
backend, or a proxy in between, decodes and merges differs), so anything that could change which
route a path names is refused, whichever layer of percent-encoding it hides in:

- an encoded separator (`%2F`, `%5C`) or a backslash, which some servers take for a slash;
- a dot segment (`.` or `..`, raw or encoded);
- a NUL or any other control character;
- a leading `//` (a URL reference that names another host);
- a malformed escape, text that is not UTF-8, or more layers of encoding than `_MAX_LAYERS`.

What passes is forwarded as the client sent it (still encoded), so the backend decodes exactly once
what this tier checked.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from .errors import InvalidRequestError

_MAX_LAYERS = 3  # `%2525...` beyond this is not a model id, it is an attack on a decoder
_ENCODED_SEPARATOR = re.compile(r"%(2f|5c)", re.IGNORECASE)
_BAD_ESCAPE = re.compile(r"%(?![0-9a-fA-F]{2})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DOT_SEGMENTS = frozenset({".", ".."})


class UnsafePathError(InvalidRequestError):
    """A forwarded path that could name another route than the one it was matched to (400)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the request path {why}; it is refused before it is forwarded", code="invalid_path")


def forwarded_path(raw_path: bytes | str) -> str:
    """`raw_path` (the request target's path as received, before any percent-decoding: ASGI's
    `scope["raw_path"]`) checked: returned as it came, or UnsafePathError."""
    try:
        path = raw_path.decode("ascii") if isinstance(raw_path, bytes) else raw_path
    except UnicodeDecodeError:
        raise UnsafePathError("has bytes that are not ASCII") from None
    if not path.startswith("/"):
        raise UnsafePathError("does not start with /")
    if path.startswith("//"):
        raise UnsafePathError("starts with //")
    layer = path
    for _ in range(_MAX_LAYERS + 1):
        _check_layer(layer)
        try:
            decoded = unquote(layer, errors="strict")
        except UnicodeDecodeError:
            raise UnsafePathError("decodes to text that is not UTF-8") from None
        if decoded == layer:
            return path
        layer = decoded
    raise UnsafePathError(f"is percent-encoded more than {_MAX_LAYERS} times over")


def _check_layer(layer: str) -> None:
    """One decoding layer of the path: what any decoder after us would see."""
    if _CONTROL.search(layer):
        raise UnsafePathError("has a control character")
    if "\\" in layer:
        raise UnsafePathError("has a backslash")
    if _ENCODED_SEPARATOR.search(layer):
        raise UnsafePathError("has an encoded separator (%2F or %5C); send `/` as it is")
    if _BAD_ESCAPE.search(layer):
        raise UnsafePathError("has a `%` that starts no escape")
    if any(segment in _DOT_SEGMENTS for segment in layer.split("/")):
        raise UnsafePathError("has a `.` or `..` segment")
