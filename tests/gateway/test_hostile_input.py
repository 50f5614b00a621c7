"""Hostile and careless input meets a clear 400 at the front, in OpenAI's shape and with a code a
client can branch on: a body nested past the decoder's depth, a temperature OpenAI would refuse, an
unknown field, a grammar that cannot compile (refused before any token is decoded), and token ids
as embeddings input on a server that refuses them. Never a 500."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import httpx
import pytest

from cloud.serving.in_process import InProcessBackend
from gateway.openai.decode import MAX_NESTING, decode_body, nesting_depth
from gateway.openai.results import check_finish
from shared.engine_types import RequestOutput
from shared.errors import EngineError, InvalidRequestError
from shared.protocol import ChatCompletionRequest

from .conftest import GATEWAY, MODEL, Served, run_in_thread

USER = [{"role": "user", "content": "Say hi."}]


def post(url: str, path: str, body: bytes | dict[str, object]) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(f"{url}{path}", json=body, timeout=60)
    return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)


def error_of(resp: httpx.Response, status: int = 400) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert error["code"], f"a 400 without a code: {error}"
    return error


@pytest.mark.parametrize("depth", [200, 5_000, 30_000])
def test_a_schema_nested_thousands_deep_is_a_400_naming_the_limit(served: Served, depth: int) -> None:
    schema = b'{"type":"array","items":' * depth + b'{"type":"string"}' + b"}" * depth
    body = (
        b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"hi"}],'
        b'"response_format":{"type":"json_schema","json_schema":{"name":"deep","schema":' + schema + b"}}}"
    )
    error = error_of(post(served.url, "/v1/chat/completions", body))
    assert error["code"] == "nesting_too_deep" and "at most 128" in str(error["message"])


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def test_the_depth_scan_skips_brackets_and_escaped_quotes_inside_strings() -> None:
    """The scan that refuses deep bodies before decoding counts the nesting a decoder sees: brackets
    and quotes inside strings (escaped backslashes before a quote included) are text."""
    rng = random.Random(0)
    chars = 'ab"\\[]{}\né'

    def text() -> str:
        return "".join(rng.choice(chars) for _ in range(rng.randint(0, 8)))

    def value(level: int) -> object:
        k = rng.random()
        if level > 6 or k < 0.3:
            return text()
        if k < 0.6:
            return [value(level + 1) for _ in range(rng.randint(0, 3))]
        return {text(): value(level + 1) for _ in range(rng.randint(0, 3))}

    for _ in range(3000):
        v = value(0)
        for ascii_only in (True, False):
            body = json.dumps(v, ensure_ascii=ascii_only).encode()
            assert nesting_depth(body) == _depth(v), body


def test_decoding_refuses_exactly_the_bodies_nested_past_the_limit() -> None:
    """After decoding, only the values a wire type leaves free are walked for their depth: the answer
    is still the whole body's depth, wherever the free value sits, however it mixes objects and arrays,
    and when it is too large to walk (the scan of the text takes over)."""
    rng = random.Random(1)

    def nested(levels: int) -> object:
        value: object = "x"
        for _ in range(levels):
            value = [value, 1] if rng.random() < 0.5 else {"k": value, "n": [2]}
        return value

    places = [
        lambda v: {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": v}}},
        lambda v: {"tools": [{"type": "function", "function": {"name": "f", "parameters": v}}]},
        lambda v: {"chat_template_kwargs": v},
        lambda v: {"guided_json": v},
        lambda v: {"structured_outputs": {"json": v}},
    ]
    wide = {f"p{i}": {"type": "string"} for i in range(5000)}  # past the walk's bound
    for place in places:
        for levels in (0, 1, 60, 120, 123, 124, 125, 126, 127, 128, 140, 300):
            for extra in ({}, {"wide": wide}):
                free = {"a": nested(levels), **extra}
                fields = place(free)
                body = {"model": MODEL, "messages": [{"role": "user", "content": "[[{{"}], **fields}
                depth = _depth(body)
                try:
                    decode_body(json.dumps(body).encode(), ChatCompletionRequest)
                except InvalidRequestError as exc:
                    assert exc.code == "nesting_too_deep" and depth > MAX_NESTING, (levels, exc)
                    assert f"nests {depth} levels" in str(exc)
                else:
                    assert depth <= MAX_NESTING, (levels, depth)


def test_a_deep_but_reasonable_body_still_decodes(served: Served) -> None:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(20):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}},
    }
    assert post(served.url, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize("temperature", [2.01, 3, 100])
def test_a_temperature_above_2_is_refused_as_openai_refuses_it(served: Served, temperature: float) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": temperature}
    error = error_of(post(served.url, "/v1/chat/completions", body))
    assert (error["param"], error["code"]) == ("temperature", "decimal_above_max_value")
    assert "Expected a value <= 2" in str(error["message"])
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": temperature}
    assert error_of(post(served.url, "/v1/completions", completion))["code"] == "decimal_above_max_value"


def test_temperature_2_itself_is_taken(served: Served) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 2}
    assert post(served.url, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": MODEL, "messages": USER, "bogus": 1}, "unknown_parameter", "bogus"),
        ({"model": MODEL, "messages": USER, "audio": {}}, "unsupported_parameter", "audio"),
        ({"model": MODEL, "messages": USER, "max_tokens": "5"}, "invalid_type", "max_tokens"),
        ({"messages": USER}, "missing_required_parameter", "model"),
        ({"model": MODEL, "messages": USER, "top_p": 7}, "invalid_value", "top_p"),
        (b"{not json", "invalid_json", None),
        (b"", "invalid_json", None),
    ],
)
def test_every_400_carries_a_code(
    served: Served, body: bytes | dict[str, object], code: str, param: str
) -> None:
    error = error_of(post(served.url, "/v1/chat/completions", body))
    assert (error["code"], error["param"]) == (code, param)


@pytest.mark.parametrize(
    ("field", "source", "code"),
    [
        ("guided_regex", "(ab", "invalid_regex"),
        ("guided_grammar", "root ::= undefined_rule", "invalid_grammar"),
        ("guided_grammar", 'start ::= "a"', "invalid_grammar"),
        ("guided_grammar", 'root ::= "a" root', "invalid_grammar"),  # no finite string: never finishes
    ],
)
def test_a_grammar_that_cannot_compile_is_a_400_before_decoding(
    served: Served, field: str, source: str, code: str
) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, field: source}
    error = error_of(post(served.url, "/v1/chat/completions", body))
    assert (error["code"], error["param"]) == (code, field)
    streamed = post(served.url, "/v1/chat/completions", {**body, "stream": True})  # refused, not streamed
    assert error_of(streamed)["code"] == code


def test_token_ids_as_embeddings_input_are_taken_by_default_and_refusable(
    served: Served, backend: InProcessBackend
) -> None:
    ids = {"model": MODEL, "input": [[1, 2, 3], [4, 5]]}
    assert post(served.url, "/v1/embeddings", ids).status_code == 200
    strict = run_in_thread(backend, replace(GATEWAY, embedding_token_ids=False))
    try:
        for given in ([[1, 2, 3]], [1, 2, 3]):
            error = error_of(post(strict.url, "/v1/embeddings", {"model": MODEL, "input": given}))
            assert (error["code"], error["param"]) == ("token_ids_not_accepted", "input")
        text = post(strict.url, "/v1/embeddings", {"model": MODEL, "input": ["a sentence"]})
        assert text.status_code == 200 and len(text.json()["data"]) == 1
    finally:
        strict.stop()


PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
    },
}


@pytest.fixture
def second_choice_dead_ends(backend: InProcessBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The matcher of every request's second choice refuses what it is given: a dead end (injected: a
    real vocabulary spells every byte, so a real grammar never reaches one)."""
    masks = backend.engine.core.runner.sampler.grammars
    accept = masks.accept
    monkeypatch.setattr(
        masks, "accept", lambda row, token: False if row.request_id.endswith("#1") else accept(row, token)
    )


@pytest.mark.usefixtures("second_choice_dead_ends")
def test_a_grammar_dead_end_ends_its_choice_with_the_reason_and_the_others_go_on(served: Served) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 24,
        "temperature": 0,
        "n": 2,
        "response_format": PERSON_FORMAT,
    }
    whole = post(served.url, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    first, stuck = sorted(whole.json()["choices"], key=lambda c: c["index"])
    assert first["finish_reason"] in ("stop", "length") and first["message"]["content"]
    assert stuck["finish_reason"] == "error"
    assert stuck["ctxfuse"]["code"] == "grammar_dead_end" and not stuck["ctxfuse"]["valid"]
    assert "engine error" not in stuck["ctxfuse"]["error"]

    with httpx.stream(
        "POST", f"{served.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"  # the stream ends whole: one choice failed, not the request
    finishes = {
        c["index"]: c for line in lines[:-1] for c in json.loads(line)["choices"] if c.get("finish_reason")
    }
    assert finishes[1]["finish_reason"] == "error" and finishes[1]["ctxfuse"]["code"] == "grammar_dead_end"
    assert finishes[0]["finish_reason"] in ("stop", "length")


@pytest.mark.usefixtures("second_choice_dead_ends")
def test_a_legacy_completion_choice_that_dead_ends_says_why(served: Served) -> None:
    body = {"model": MODEL, "prompt": "A person as JSON:", "max_tokens": 16, "n": 2, "temperature": 0}
    reply = post(served.url, "/v1/completions", {**body, "response_format": PERSON_FORMAT})
    assert reply.status_code == 200, reply.text
    stuck = next(c for c in reply.json()["choices"] if c["index"] == 1)
    assert (stuck["finish_reason"], stuck["ctxfuse"]["code"]) == ("error", "grammar_dead_end")


def test_an_engine_failure_stays_the_servers_error_not_the_clients() -> None:
    with pytest.raises(EngineError):
        check_finish(RequestOutput("r", 0, "", [], finished=True, finish_reason="error", error="boom"))
    check_finish(  # the request's own dead end is its choice's, not a raised error
        RequestOutput(
            "r",
            0,
            "",
            [],
            finished=True,
            finish_reason="error",
            error="a dead end",
            error_code="grammar_dead_end",
        )
    )
