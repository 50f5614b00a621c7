"""The gateway's side of an engine core in its own process (cloud/engine/serving/engine_process.py): the
default of `ctxfuse serve`. The gateway keeps the tokenizer and chat template (the engine's, sent
with its greeting, so the model file is read once) and refuses a bad request itself (the engine's
Admission); the engine process holds the weights and the KV cache and steps. Its prefix cache's
changes come with its batches, into a mirror a worker's internal routes answer from.

A reader thread takes the engine's batches off the pipe and hands each event loop its share in one
call per batch. A stream closed before the engine took its request aborts it once taken. If the
engine process dies, every open request fails with EngineDeadError and `is_alive` turns false (the
health checks answer 503, later submissions are refused with the same error): nothing hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
from typing import Any

import msgspec
import numpy as np
import structlog

from cloud.engine.config import EngineConfig
from cloud.engine.kv.block_events import BlockEventLog
from cloud.engine.serving.engine_process import (
    AbortMsg,
    AddMsg,
    Batch,
    Command,
    EmbedMsg,
    Hello,
    Refusal,
    ShutdownMsg,
    StartupFailed,
    engine_main,
)
from cloud.engine.serving.output_stream import OutputStream
from cloud.text.prompt import render_chat_prompt
from shared.engine_types import ChatPrompt, EngineStats, ImageSpan, Pooling, RequestOutput, SamplingParams
from shared.errors import CtxfuseError, EngineDeadError, InvalidRequestError, ModelLoadError

log = structlog.get_logger("ctxfuse.engine")


class _Stream(OutputStream):
    """One request's outputs in the caller's event loop (the Generation the routes iterate)."""

    def __init__(self, backend: ProcessBackend, request_id: str, n: int) -> None:
        super().__init__(n)
        self.request_id = request_id
        self._backend = backend
        self.accepted: asyncio.Future[Refusal | None] = self.loop.create_future()
        self.unfinished = set(range(n))  # choices not yet finished, as the reader thread has seen them
        self.closed = False

    # -- event loop side ----------------------------------------------------------------------

    def close(self) -> None:
        """Abort the request if any choice is unfinished; safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        if self._remaining and self.accepted.done() and self.accepted.result() is None:
            self._backend.abort(self.request_id)
        # not taken yet: on_accepted aborts it once the engine has it

    def on_accepted(self, refusal: Refusal | None) -> None:
        if not self.accepted.done():
            self.accepted.set_result(refusal)
        if refusal is None and self.closed and self._remaining:
            self._backend.abort(self.request_id)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._queue.put_nowait(out)


class ProcessBackend:
    """An engine core in a child process; see the module's docstring."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads
        self._conn, theirs = ctx.Pipe()
        self._process = ctx.Process(
            target=engine_main, args=(config, theirs), name="ctxfuse-engine-core", daemon=True
        )
        self._process.start()
        theirs.close()
        hello = self._greeting()
        self.model_name = hello.model_name
        self._admission = hello.admission
        self.max_model_len = hello.admission.max_model_len
        self.hidden_size = hello.hidden_size
        self.context_overflow: str = hello.admission.overflow.policy
        self.describe = hello.describe
        self._stats = hello.stats
        self.tokenizer, self.chat_template = hello.tokenizer, hello.chat_template
        self.block_size, self.max_num_seqs = hello.block_size, hello.max_num_seqs
        # the engine's prefix cache as its batches report it: what a worker's router reads
        self.block_events = BlockEventLog()
        self._streams: dict[str, _Stream] = {}
        # embedding jobs sent and not yet answered: where their caller waits
        self._embeds: dict[str, asyncio.Future[np.ndarray | CtxfuseError]] = {}
        self._lock = threading.Lock()  # the stream table and the pipe's sending end
        self._encode = msgspec.msgpack.Encoder().encode
        self._error: str | None = None  # why the engine process is gone, once it is
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="ctxfuse-engine-outputs", daemon=True)
        self._reader.start()

    def _greeting(self) -> Hello:
        try:
            hello = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(10)
            raise ModelLoadError(
                f"the engine process exited while loading the model (exit code {self._process.exitcode})"
            ) from None
        if isinstance(hello, StartupFailed):
            self._process.join(10)
            raise hello.refusal.error()
        return hello

    # -- the Backend interface ----------------------------------------------------------------

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        return render_chat_prompt(
            self.chat_template, self.tokenizer, messages, tools, tool_choice, template_kwargs
        )

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self._admission.default_max_tokens(num_prompt_tokens)

    def check_text_size(self, num_chars: int) -> None:
        self._admission.check_text_size(num_chars, self.tokenizer.max_token_bytes)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._admission.check(prompt_token_ids, params)

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> _Stream:
        # checked by the gateway (check); the engine process's core refuses what slips past it
        stream = _Stream(self, request_id, params.n)
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(self._error)
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id} is already in use")
            self._streams[request_id] = stream
            self._send_locked(AddMsg(request_id, prompt_token_ids, params, priority, image_spans))
        try:
            refusal = await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            stream.close()  # the caller left: the request is aborted once the engine has it
            raise
        if refusal is not None:  # the reader has dropped the stream
            raise refusal.error()
        return stream

    async def embed(self, inputs: list[list[int]], pooling: Pooling, request_id: str) -> np.ndarray:
        answer: asyncio.Future[np.ndarray | CtxfuseError] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(self._error)
            if request_id in self._embeds or request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id} is already in use")
            self._embeds[request_id] = answer
            self._send_locked(EmbedMsg(request_id, inputs, pooling))
        try:
            out = await answer
        except asyncio.CancelledError:
            with self._lock:
                if self._embeds.pop(request_id, None) is not None:
                    self._send_locked(AbortMsg(request_id))
            raise
        if isinstance(out, CtxfuseError):
            raise out
        return out

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._send_locked(AbortMsg(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def engine_pid(self) -> int | None:
        return self._process.pid

    def is_alive(self) -> bool:
        return self._error is None and self._process.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        with self._lock:
            self._send_locked(ShutdownMsg())
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._reader.join(5)

    # -- the pipe -----------------------------------------------------------------------------

    def _send_locked(self, msg: Command) -> None:
        if self._error is not None:
            return
        with contextlib.suppress(OSError):  # the engine process is gone; the reader ends its requests
            self._conn.send_bytes(self._encode(msg))

    def _read(self) -> None:
        decode = msgspec.msgpack.Decoder(Batch).decode
        while True:
            try:
                batch = decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            self._stats = batch.stats
            self._dispatch(batch)
        self._process.join(5)
        code = self._process.exitcode
        self._fail_all(f"the engine has stopped: the engine process exited (exit code {code})")

    def _dispatch(self, batch: Batch) -> None:
        if batch.blocks is not None:
            self.block_events.apply(batch.blocks)
        calls: dict[asyncio.AbstractEventLoop, list[tuple[Any, ...]]] = {}
        with self._lock:
            for rid, refusal in batch.accepted:
                stream = self._streams.get(rid)
                if stream is not None:
                    calls.setdefault(stream.loop, []).append((stream.on_accepted, refusal))
                    if refusal is not None:
                        del self._streams[rid]
            self._embedded(batch, calls)
            outs: dict[str, list[RequestOutput]] = {}
            for out in batch.outputs:
                outs.setdefault(out.request_id, []).append(out)
            for rid, group in outs.items():
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                calls.setdefault(stream.loop, []).append((stream.deliver, group))
                for out in group:
                    if out.finished:
                        stream.unfinished.discard(out.index)
                if not stream.unfinished:
                    del self._streams[rid]
        for loop, items in calls.items():
            _call_soon(loop, _run_all, items)

    def _embedded(self, batch: Batch, calls: dict[asyncio.AbstractEventLoop, list[tuple[Any, ...]]]) -> None:
        """The batch's finished embeddings, each for the loop its caller waits in (lock held)."""
        for e in batch.embedded:
            waiting = self._embeds.pop(e.request_id, None)
            if waiting is not None:
                calls.setdefault(waiting.get_loop(), []).append((_answer, waiting, e.result()))

    def _fail_all(self, reason: str) -> None:
        if self._error is None and not self._stopping:
            log.error("engine_process_exited", reason=reason)
        with self._lock:
            self._error = reason
            streams, self._streams = list(self._streams.values()), {}
            embeds, self._embeds = list(self._embeds.values()), {}
        for waiting in embeds:
            _call_soon(waiting.get_loop(), _answer, waiting, EngineDeadError(reason))
        for stream in streams:
            refusal = Refusal.of(EngineDeadError(reason))
            _call_soon(stream.loop, _run_all, [(stream.on_accepted, refusal), (stream.fail, reason)])


def _answer(waiting: asyncio.Future[np.ndarray | CtxfuseError], out: np.ndarray | CtxfuseError) -> None:
    if not waiting.done():
        waiting.set_result(out)


def _run_all(items: list[tuple[Any, ...]]) -> None:
    for fn, *args in items:
        fn(*args)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # that event loop has closed: nobody is waiting there
        loop.call_soon_threadsafe(fn, *args)
