"""The fleet's ctxfuse workers behind the engine seam (gateway/seam.py): the router plans each request
itself (template and tokenize with the text side a worker sent, openai/planner.py) and submits token
ids and sampling parameters to the worker that holds the prompt's prefix (`POST /internal/v1/generate`,
shared/fleet_protocol.py), whose `RequestOutput`s come back as frames. So the router answers chat,
completions, embeddings, batches and the Responses API with the same code as a gateway over its own
engine, and a worker's engine checks what arrives as it checks anything submitted.

- Routing: the prompt's block hashes (in the tenant's partition) name the worker (policy.py), with
  the same failover as a relayed request (proxy.py `route`): a worker that cannot be reached, answers
  5xx or 429, or breaks before its first token costs a retry on another one; its refusal (4xx) is the
  client's answer.
- Closing a generation closes its connection, which aborts the request on the worker.
- A break after the first token ends the request's open choices in an error the client reads (a
  stream's last event), never a clean end.

Backends that are not ctxfuse workers (any OpenAI-compatible server) get the request's body as the
client sent it (upstream.py, proxy.py).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import structlog

from cloud.model.chat_template import ChatTemplate
from cloud.model.tokenizer import Tokenizer
from cloud.text.prompt import render_chat_prompt
from gateway.backends.fleet.backend import FleetBackend
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.key_memo import Tokens
from gateway.backends.fleet.keys import RequestKeys
from gateway.backends.fleet.proxy import begin, done, failed, post, route
from gateway.backends.fleet.wire import WireError, WireResponse
from shared.block_hash import salt_key
from shared.engine_types import (
    ChatPrompt,
    EngineStats,
    ImageSpan,
    Pooling,
    RequestOutput,
    SamplingParams,
    check_text_size,
    default_max_tokens,
)
from shared.errors import CtxfuseError
from shared.fleet_protocol import EmbedRequest, Frames, GenerateRequest, TextSide

log = structlog.get_logger("ctxfuse.fleet")

GENERATE_PATH = "/internal/v1/generate"
EMBED_PATH = "/internal/v1/embed"
MSGPACK = "application/msgpack"


class WorkerRefusal(CtxfuseError):
    """A worker's 4xx, passed on as it said it (status, type, code, param)."""

    def __init__(self, status: int, body: bytes) -> None:
        err: dict[str, Any] = {}
        try:
            decoded = msgspec.json.decode(body)
            if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):
                err = decoded["error"]
        except msgspec.DecodeError:
            pass
        message = err.get("message")
        super().__init__(
            message if isinstance(message, str) else f"the worker refused the request ({status})",
            param=err.get("param") if isinstance(err.get("param"), str) else None,
            code=err.get("code") if isinstance(err.get("code"), str) else None,
        )
        self.status = status
        kind = err.get("type")
        self.type = kind if isinstance(kind, str) else "invalid_request_error"


class FleetEngine:
    """One request's view of the fleet's workers as a `Backend` (`for_request` makes it): the canary
    version it is pinned to, and the workers that took its generations (for the response header)."""

    def __init__(self, fleet: Fleet, side: TextSide, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.fleet = fleet
        self.side = side
        self.model_name = side.model
        self.max_model_len = side.max_model_len or fleet.max_model_len() or 0
        self.hidden_size = side.hidden_size
        self.context_overflow = side.context_overflow
        self.tokenizer = tokenizer
        self.template = template
        self.pinned: str | None = None
        self.answered_by: list[str] = []
        # a chat's prompt through the key memo (keys.py), when the fleet's keys use this text side:
        # a conversation's next turn tokenizes only its new tail
        self.keys = fleet.keys if fleet.keys is not None and fleet.keys.tokenizer is tokenizer else None
        self.extra_key = b""  # the request's partition of the memo (its tenant's salt key)
        self._prompt: Tokens | None = None  # the last prompt encode_chat made, for submit's keys

    def for_request(self, pinned: str | None, extra_key: bytes = b"") -> FleetEngine:
        """A view for one request, pinned to a canary version or not; `extra_key`: the salt key of
        its tenant's prefix-cache partition (the one its sampling parameters will name)."""
        view = copy.copy(self)
        view.pinned, view.answered_by, view.extra_key, view._prompt = pinned, [], extra_key, None
        return view

    # -- planning (no worker asked) ----------------------------------------------------------------

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return default_max_tokens(self.context_overflow, self.max_model_len, num_prompt_tokens)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        if self.keys is None:
            return render_chat_prompt(
                self.template, self.tokenizer, messages, tools, tool_choice, template_kwargs
            )
        self._prompt = self.keys.prompt(messages, tools, tool_choice, template_kwargs, self.extra_key)
        return ChatPrompt(self._prompt.token_ids)

    def check_text_size(self, num_chars: int) -> None:
        check_text_size(self.context_overflow, self.max_model_len, num_chars, self.tokenizer.max_token_bytes)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """What needs no engine; the worker checks the context and compiles the grammar (its refusal
        is raised by `submit`, before anything streams)."""
        params.validate(self.tokenizer.vocab_size)

    # -- work on a worker ----------------------------------------------------------------------------

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> RemoteGeneration:
        body = msgspec.msgpack.encode(
            GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                params=params,
                priority=priority,
                image_spans=list(image_spans),
            )
        )
        salt = b"" if params.cache_salt is None else salt_key(params.cache_salt)
        made = self._prompt
        if made is not None and salt == self.extra_key and made.token_ids is prompt_token_ids:
            # the memo's prompt: its leading block hashes come from the earlier turn's chains
            keys = RequestKeys(prompt_token_ids, "", salt, made.earlier, made.chains)
        else:
            keys = RequestKeys(prompt_token_ids, "", salt)
        gen = RemoteGeneration(self, request_id, params.n, body, keys)
        await gen.open()
        return gen

    async def embed(self, inputs: list[list[int]], pooling: Pooling, request_id: str) -> np.ndarray:
        body = msgspec.msgpack.encode(EmbedRequest(request_id=request_id, inputs=inputs, pooling=pooling))

        async def send(b: FleetBackend) -> bytes | str:
            resp = await self.send(b, EMBED_PATH, body, stream=False)
            if isinstance(resp, str):
                return resp
            self.answered_by.append(b.name)
            return resp.content

        content = await route(
            self.fleet, RequestKeys([], ""), self.model_name, self.pinned, send, self.foreign()
        )
        rows = np.frombuffer(content, dtype="<f4")
        return rows.reshape(len(inputs), -1).astype(np.float32, copy=False)

    def foreign(self) -> set[str]:
        """Backends that are not ctxfuse workers: never sent a planned request."""
        return {b.name for b in self.fleet.backends if b.kind != "ctxfuse"}

    async def send(self, b: FleetBackend, path: str, body: bytes, *, stream: bool) -> WireResponse | str:
        """The worker's 200 (streaming: still open, counted in flight until `done`), or why it failed
        (a str: try another); its refusal (4xx) raised."""
        fleet = self.fleet
        start = begin(fleet, b)
        kept = False
        try:
            resp = await post(fleet, b, path, body, {"content-type": MSGPACK}, start)
            if isinstance(resp, str):
                return resp
            if resp.status_code != 200 or not stream:
                try:
                    content = await resp.aread()
                except WireError as exc:
                    return failed(fleet, b, "transport", exc, start)
                finally:
                    await resp.aclose()
                fleet.metrics.latency.labels(backend=b.name).observe(time.monotonic() - start)
                fleet.record_outcome(b, True, time.monotonic() - start)  # a refusal is the request's doing
                if resp.status_code != 200:
                    raise WorkerRefusal(resp.status_code, content)
                return resp
            kept = True
            return resp
        finally:
            if not kept:
                done(fleet, b)

    # -- the fleet as one engine -----------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The workers' own figures as their last state polls reported them (no KV blocks here)."""
        loads = [b.reported for b in self.fleet.backends if b.reported is not None]
        return EngineStats(
            num_running=sum(r.running for r in loads),
            num_waiting=sum(r.waiting for r in loads),
            num_free_blocks=0,
            num_blocks=0,
            kv_usage=sum(r.kv_usage for r in loads) / len(loads) if loads else 0.0,
            kv_bytes_per_token=0.0,
            prefix_queried_tokens=0,
            prefix_hit_tokens=0,
        )

    def is_alive(self) -> bool:
        return any(b.may_take_work() for b in self.fleet.backends)

    def shutdown(self) -> None:
        pass


def _has_content(out: RequestOutput) -> bool:
    return bool(out.token_ids or out.text or out.finished)


class RemoteGeneration:
    """A request's outputs as a worker streams them. Until its first token reaches the caller, a
    worker that breaks is replaced by another (the request is sent again); after, the open choices
    end in error."""

    def __init__(self, engine: FleetEngine, request_id: str, n: int, body: bytes, keys: RequestKeys) -> None:
        self.request_id = request_id
        self._engine = engine
        self._body = body
        self._keys = keys
        self._unfinished = set(range(n))
        self._tried: set[str] = set()
        self._resp: WireResponse | None = None
        self._backend: FleetBackend | None = None
        self._start = 0.0
        self._closed = False
        self._delivered = False  # a token (or a finish) reached the caller: no retry from here
        self._loop = asyncio.get_running_loop()

    async def open(self) -> None:
        engine = self._engine

        async def send(b: FleetBackend) -> tuple[FleetBackend, WireResponse] | str:
            resp = await engine.send(b, GENERATE_PATH, self._body, stream=True)
            return resp if isinstance(resp, str) else (b, resp)

        self._tried |= engine.foreign()
        start = time.monotonic()
        b, resp = await route(engine.fleet, self._keys, engine.model_name, engine.pinned, send, self._tried)
        self._tried.add(b.name)
        self._backend, self._resp, self._start = b, resp, start
        engine.answered_by.append(b.name)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        decode = msgspec.msgpack.Decoder(RequestOutput).decode
        while True:
            b, resp = self._backend, self._resp
            assert b is not None and resp is not None
            frames, first, why = Frames(), True, None
            try:
                async for data in resp.aiter_raw():
                    if first:
                        self._engine.fleet.metrics.latency.labels(backend=b.name).observe(
                            time.monotonic() - self._start
                        )
                        first = False
                    for payload in frames.feed(data):
                        out = decode(payload)
                        if out.finished:
                            self._unfinished.discard(out.index)
                        self._delivered = self._delivered or _has_content(out)
                        yield out
                if self._unfinished:
                    why = "its stream ended before the request finished"
            except (WireError, msgspec.DecodeError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            finally:
                await self._release(ok=why is None)
            if why is None or self._closed:
                return
            log.warning("stream_broken", backend=b.name, reason=why)
            if self._delivered:
                break
            try:
                await self.open()  # nothing reached the caller yet: another worker starts it over
            except CtxfuseError as exc:
                why = exc.message
                break
        message = f"the backend {b.name} failed mid-request ({why}); retry the request"
        for index in sorted(self._unfinished):
            yield RequestOutput(
                self.request_id, index, "", [], finished=True, finish_reason="error", error=message
            )
        self._unfinished.clear()

    async def _release(self, ok: bool) -> None:
        resp, b = self._resp, self._backend
        if resp is None or b is None:
            return
        self._resp = None
        await resp.aclose()
        fleet = self._engine.fleet
        if not ok:
            fleet.metrics.errors.labels(backend=b.name, kind="stream").inc()
        done(fleet, b)
        fleet.record_outcome(b, ok, time.monotonic() - self._start)

    def close(self) -> None:
        """Abort what runs: closing the connection aborts the request on its worker. Safe from any
        thread (a response's background task may run on one)."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._release_soon)

    def _release_soon(self) -> None:
        if self._resp is not None:
            task = self._loop.create_task(self._release(ok=True))
            _closing.add(task)
            task.add_done_callback(_closing.discard)


_closing: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references
