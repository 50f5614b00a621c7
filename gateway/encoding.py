"""One msgspec encoder for every response body and stream event (reused: encoders keep a buffer)."""

from __future__ import annotations

import msgspec

_encoder = msgspec.json.Encoder()


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def sse_event(obj: object) -> bytes:
    """One server-sent event carrying `obj` as JSON, as OpenAI frames its stream."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
