"""Helpers of the Batch API tests: request lines, uploads, and waiting on a batch through the official
client."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
from openai.types import Batch

from .conftest import MODEL, Running

DONE = {"completed", "failed", "cancelled", "expired"}


def client_of(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_line(custom_id: str, text: str = "Say hi.", max_tokens: int = 3, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **body},
    }


def tag_of(body: bytes) -> str:
    """The text a chat_line's body asks about (its tag)."""
    return str(json.loads(body)["messages"][0]["content"])


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def upload(client: openai.OpenAI, lines: list[dict[str, Any]] | bytes, **kw: Any) -> str:
    content = lines if isinstance(lines, bytes) else jsonl(lines)
    return client.files.create(file=("input.jsonl", content), purpose="batch", **kw).id


def start(
    client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions"
) -> Batch:
    file_id = upload(client, lines)
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def wait(client: openai.OpenAI, batch_id: str, until: set[str] = DONE, timeout: float = 30) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch still {batch.status} after {timeout}s: {batch}")
        time.sleep(0.05)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines()]


# upload form fields OpenAI's expiry rules refuse, and the field each 400 names (the gateway's port and
# the edge agent's answer them alike)
BAD_EXPIRES_AFTER: list[tuple[dict[str, str], str]] = [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after[seconds]"),
    (
        {"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
        "expires_after[seconds]",
    ),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "-5"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1e4"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
    (
        {"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
        "expires_after[anchor]",
    ),
    ({"expires_after[seconds]": "3600"}, "expires_after[anchor]"),
]
