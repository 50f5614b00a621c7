"""The body a router sends on for a stream it counts in tokens: the client's bytes with the usage
chunk asked for, re-encoded only when the body already names stream_options."""

from __future__ import annotations

import json

import msgspec

from gateway.backends.fleet.usage import with_usage
from shared.protocol import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": 'a "quoted" {brace} and \\ backslash'}]


def _sent(body: dict[str, object], spacing: str = "") -> tuple[bytes, dict[str, object]]:
    raw = (spacing + json.dumps(body)).encode()
    out = with_usage(msgspec.json.decode(raw, type=ChatCompletionRequest), raw)
    return raw, json.loads(out)


def test_a_stream_without_options_keeps_its_bytes_and_gains_the_usage_ask() -> None:
    body = {"model": "m", "messages": MESSAGES, "stream": True, "temperature": 0.5}
    raw, sent = _sent(body, spacing=" \n")
    assert sent == {**body, "stream_options": {"include_usage": True}}
    out = with_usage(msgspec.json.decode(raw, type=ChatCompletionRequest), raw)
    assert raw.strip()[1:] in out  # the client's own bytes follow the inserted field unchanged


def test_options_the_client_set_are_kept_beside_the_usage_ask() -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_obfuscation": False},
    }
    _, sent = _sent(body)
    assert sent["stream_options"] == {"include_obfuscation": False, "include_usage": True}
    body["stream_options"] = {"include_usage": False}
    assert _sent(body)[1]["stream_options"] == {"include_usage": True}


def test_a_whole_answer_or_a_stream_that_asked_already_is_sent_as_is() -> None:
    for body in (
        {"model": "m", "messages": MESSAGES},
        {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}},
    ):
        raw = json.dumps(body).encode()
        assert with_usage(msgspec.json.decode(raw, type=ChatCompletionRequest), raw) is raw
