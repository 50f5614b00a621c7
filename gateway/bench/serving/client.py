"""The HTTP side of the bench: one kept-alive httpx client, the server's model, one streamed request.

HTTP/1.1 with keep-alive and as many connections as requests in flight, so a connection is never
waited for; proxies from the environment are ignored (a proxy in the path would be measured too).
A request the server drops unanswered on a kept-alive connection it had closed is sent once more on
a fresh one (as urllib3 and browsers do), so a server's keep-alive policy does not count as failures.
The client's cost per chunk is a line split and one msgspec decode: far below a token's time.
"""

from __future__ import annotations

import time

import httpx
import msgspec

from gateway.bench.serving.chunks import error_message
from gateway.bench.serving.dataset import Prompt
from gateway.bench.serving.options import Endpoint
from gateway.bench.serving.stream import RequestRecord, StreamReader
from shared.errors import CtxfuseError

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
TIMEOUT = httpx.Timeout(connect=30.0, read=600.0, write=60.0, pool=600.0)  # a long prefill is no error


class Target(msgspec.Struct, frozen=True):
    base_url: str  # without a trailing /v1
    model: str
    endpoint: Endpoint


class _Message(msgspec.Struct):
    role: str
    content: str


class _StreamOptions(msgspec.Struct):
    include_usage: bool


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    max_tokens: int
    temperature: float
    stream: bool
    stream_options: _StreamOptions
    messages: list[_Message] | None = None  # chat
    prompt: str | None = None  # completions
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: sent only when asked for


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


def make_client(connections: int, api_key: str | None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        timeout=TIMEOUT,
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        trust_env=False,
    )


async def resolve_model(client: httpx.AsyncClient, base_url: str, model: str | None) -> str:
    """`model`, or the server's first from GET /v1/models; a CtxfuseError when no server answers,
    it refuses the API key, or it lists no model and none was named."""
    try:
        resp = await client.get(f"{base_url}/v1/models", timeout=30.0)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise CtxfuseError(f"no server answers at {base_url} ({type(exc).__name__}: {exc})") from exc
    if resp.status_code in (401, 403):
        message = error_message(resp.content)
        raise CtxfuseError(f"{base_url} refused the API key (HTTP {resp.status_code}): {message}")
    if model is not None:
        return model
    if resp.status_code >= 400:
        raise CtxfuseError(
            f"{base_url}/v1/models answered HTTP {resp.status_code} ({error_message(resp.content)}): "
            "name the model with --model"
        )
    try:
        return msgspec.json.decode(resp.content, type=_Models).data[0].id
    except (msgspec.MsgspecError, IndexError) as exc:
        raise CtxfuseError(f"{base_url}/v1/models lists no model: name one with --model") from exc


def request_body(target: Target, prompt: Prompt, temperature: float, ignore_eos: bool) -> bytes:
    chat = target.endpoint == "chat"
    return msgspec.json.encode(
        _Body(
            model=target.model,
            max_tokens=prompt.output_len,
            temperature=temperature,
            stream=True,
            stream_options=_StreamOptions(include_usage=True),
            messages=[_Message("user", prompt.text)] if chat else None,
            prompt=None if chat else prompt.text,
            ignore_eos=ignore_eos,
        )
    )


async def send(client: httpx.AsyncClient, target: Target, body: bytes, prompt_words: int) -> RequestRecord:
    """One streamed request, timed from here; every failure is a failed record, never an exception."""
    url = target.base_url + PATHS[target.endpoint]
    reader = StreamReader(time.perf_counter())
    for attempt in range(2):
        answered = False
        try:
            async with client.stream(
                "POST", url, content=body, headers={"Content-Type": "application/json"}
            ) as resp:
                answered = True
                if resp.status_code >= 400:
                    message = error_message(await resp.aread())
                    reader.fail(f"HTTP {resp.status_code}: {message}", time.perf_counter())
                else:
                    async for line in resp.aiter_lines():  # read to the end: the connection is reused
                        reader.feed(line, time.perf_counter())
        except httpx.RemoteProtocolError as exc:
            if attempt == 0 and not answered:
                # The server closed the kept-alive connection as the request went out (llama-server
                # does, now and then, after a streamed answer): no answer of the server's. Once
                # more on a fresh connection, timed from the first try.
                continue
            reader.fail(f"{type(exc).__name__}: {exc}".rstrip(": "), time.perf_counter())
        except httpx.HTTPError as exc:
            reader.fail(f"{type(exc).__name__}: {exc}".rstrip(": "), time.perf_counter())
        break
    return reader.record(time.perf_counter(), prompt_words)
