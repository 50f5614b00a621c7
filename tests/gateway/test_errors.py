"""Bad requests get the right status and an OpenAI error body naming the problem; the server keeps
serving after each one (a client mistake is never a 500)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import openai
import pytest

from .conftest import MODEL, Served

HI = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Bad:
    name: str
    body: object  # a JSON value, or bytes sent as they are
    status: int = 400
    param: str | None = None
    code: str | None = None
    path: str = "/v1/chat/completions"
    contains: str = ""  # a word the message must hold


def chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": HI, **fields}


CASES = [
    Bad("max_tokens as a string", chat(max_tokens="5"), param="max_tokens"),
    Bad("messages as a string", chat(messages="hi"), param="messages"),
    Bad("temperature as a string", chat(temperature="hot"), param="temperature"),
    Bad("stream as a number", chat(stream=3), param="stream"),
    Bad("missing messages", {"model": MODEL}, param="messages", contains="messages"),
    Bad("missing model", {"messages": HI}, param="model"),
    Bad("empty messages", chat(messages=[]), param="messages"),
    Bad("unknown role", chat(messages=[{"role": "wizard", "content": "hi"}]), param="messages[0].role"),
    Bad("message without role", chat(messages=[{"content": "hi"}]), param="messages[0].role"),
    Bad(
        "image part that is no URL",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        param="messages[0].content[0].image_url.url",
        code="invalid_image_url",
    ),
    Bad(
        "audio part",
        chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]),
        param="messages[0].content[0]",
    ),
    Bad("negative max_tokens", chat(max_tokens=-1), param="max_tokens"),
    Bad("zero max_completion_tokens", chat(max_completion_tokens=0), param="max_completion_tokens"),
    Bad("huge max_tokens", chat(max_tokens=10**9), param="max_tokens", code="context_length_exceeded"),
    Bad(
        "prompt over the context",
        chat(messages=[{"role": "user", "content": "hello " * 2100}]),
        code="context_length_exceeded",
        contains="context length",
    ),
    Bad("n of zero", chat(n=0), param="n"),
    Bad("top_p of zero", chat(top_p=0), param="top_p"),
    Bad("negative temperature", chat(temperature=-1), param="temperature"),
    Bad("presence_penalty too big", chat(presence_penalty=3), param="presence_penalty"),
    Bad("logit_bias key not an id", chat(logit_bias={"abc": 1}), param="logit_bias"),
    Bad("logit_bias id outside vocab", chat(logit_bias={"999999": 1}), param="logit_bias"),
    Bad("top_logprobs without logprobs", chat(top_logprobs=2), param="top_logprobs"),
    Bad("top_logprobs too many", chat(logprobs=True, top_logprobs=50), param="top_logprobs"),
    Bad("too many stops", chat(stop=[str(i) for i in range(20)]), param="stop"),
    Bad("seed too big", chat(seed=2**70), param="seed"),
    Bad("json_schema not yet", chat(response_format={"type": "json_schema"}), param="response_format"),
    Bad("unknown model", chat(model="gpt-9"), status=404, param="model", code="model_not_found"),
    Bad("invalid JSON", b'{"model": "x", "messages": [', contains="JSON"),
    Bad("empty body", b"", contains="empty"),
    Bad("array body", [1, 2], contains="object"),
    Bad("body over the limit", chat(padding="x" * (2**20 + 10)), status=413),
    Bad("empty prompt list", {"model": MODEL, "prompt": []}, param="prompt", path="/v1/completions"),
    Bad("mixed prompt list", {"model": MODEL, "prompt": [1, "a"]}, param="prompt", path="/v1/completions"),
    Bad("empty prompt", {"model": MODEL, "prompt": ""}, param="prompt", path="/v1/completions"),
    Bad(
        "token id outside vocab", {"model": MODEL, "prompt": [10**6]}, param="prompt", path="/v1/completions"
    ),
    Bad("suffix", {"model": MODEL, "prompt": "a", "suffix": "b"}, param="suffix", path="/v1/completions"),
    Bad("detokenize bad id", {"tokens": [-1]}, param="tokens", path="/detokenize"),
    Bad("tokenize nothing", {}, param="prompt", path="/tokenize"),
    Bad("unknown route", chat(), status=404, path="/v1/nothing"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_gets_an_openai_error(served: Served, case: Bad) -> None:
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    r = httpx.post(
        f"{served.url}{case.path}", content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == case.status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error
    assert case.contains.lower() in error["message"].lower()
    # still serving
    assert httpx.get(f"{served.url}/v1/models").status_code == 200


def test_wrong_method_is_405_in_openai_shape(served: Served) -> None:
    r = httpx.get(f"{served.url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_server_answers_after_all_bad_requests(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason in ("stop", "length")


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HI)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10**9)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded"
