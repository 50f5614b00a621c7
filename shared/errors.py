"""One error hierarchy for every tier; each error knows its HTTP status and OpenAI error body.

The gateway turns any `CtxfuseError` into `{"error": {"message", "type", "param", "code"}}`;
the engine raises the same classes so a client mistake is named before any work is scheduled.
"""

from __future__ import annotations

from typing import Any


class CtxfuseError(Exception):
    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(CtxfuseError):
    """The client sent something the engine cannot serve (400). Every one carries a code a client can
    branch on: `invalid_value` unless a more precise one is given."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param, code=code or "invalid_value")


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus max_tokens does not fit the model's context (400, code context_length_exceeded)."""

    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class NotFoundError(CtxfuseError):
    status = 404
    type = "invalid_request_error"


class QueueFullError(CtxfuseError):
    """The engine's waiting queue is at its bound; the client should retry later (429)."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after_s = retry_after_s


class ModelLoadError(CtxfuseError):
    """A model file is missing, unsupported or corrupt."""

    status = 500
    type = "server_error"


class EngineError(CtxfuseError):
    """The engine failed while running a request (not the client's fault)."""

    status = 500
    type = "server_error"


class EngineDeadError(EngineError):
    """The engine has stopped (its process died, or its loop failed): every open request and every
    later one fail with this until a supervisor restarts the server (vLLM's EngineDeadError). 503, not
    500: the server is unavailable rather than wrong about this request, so load balancers and the
    fleet router send the retry elsewhere; OpenAI's clients retry both alike."""

    status = 503

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_dead")
