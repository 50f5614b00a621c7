"""OpenAI's file expiry rules, one home for both Files and Batch APIs that take them: the gateway's
(gateway/batch/routes.py) and the agent's local one (edge/batch_routes.py), so an app meets the same
bounds and the same 400s at either port.

An upload may carry `expires_after[anchor]=created_at` and `expires_after[seconds]=N` (multipart
fields, as openai-python sends them); a batch may carry `output_expires_after` for its output and
error files. N is a whole number of seconds from EXPIRES_MIN_S (an hour) to EXPIRES_MAX_S (30 days).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from shared.batch_protocol import EXPIRES_MAX_S, EXPIRES_MIN_S, BatchCreateRequest, ExpiresAfter
from shared.errors import InvalidRequestError

__all__ = ["EXPIRES_MAX_S", "EXPIRES_MIN_S", "check_output_expiry", "check_seconds", "upload_expiry"]

_INTEGER = re.compile(r"-?[0-9]{1,12}")
CODE = "invalid_expires_after"


def check_seconds(seconds: int, param: str) -> int:
    """`seconds` if it is within OpenAI's bounds; else a 400 naming `param`."""
    if not EXPIRES_MIN_S <= seconds <= EXPIRES_MAX_S:
        raise InvalidRequestError(
            f"{param} must be between {EXPIRES_MIN_S} (1 hour) and {EXPIRES_MAX_S} (30 days), got {seconds}",
            param=param,
            code=CODE,
        )
    return seconds


def upload_expiry(form: Mapping[str, object]) -> int | None:
    """An upload's lifetime in seconds from the `expires_after[anchor]` and `expires_after[seconds]`
    fields of its multipart form, or None when neither is given."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequestError(
            "expires_after[anchor] must be 'created_at'", param="expires_after[anchor]", code=CODE
        )
    if not isinstance(seconds, str) or _INTEGER.fullmatch(seconds) is None:
        raise InvalidRequestError(
            "expires_after[seconds] must be a whole number of seconds",
            param="expires_after[seconds]",
            code=CODE,
        )
    return check_seconds(int(seconds), "expires_after[seconds]")


def check_output_expiry(req: BatchCreateRequest) -> None:
    """A 400 when the batch's `output_expires_after` is out of bounds (its anchor the decoder checked)."""
    if isinstance(req.output_expires_after, ExpiresAfter):
        check_seconds(req.output_expires_after.seconds, "output_expires_after.seconds")
