"""The serving loop: the engine core steps in its own thread (or, in an engine process, on the main
thread: engine_process.py); callers submit and iterate outputs from asyncio. A slow consumer never
stalls the batch (outputs queue up per request), and a consumer that stops iterating (a client that
went away) aborts its request, which frees its blocks at once.

Commands (add, abort, embed) reach the loop through a thread-safe queue and are applied between steps,
so the core itself stays single-threaded. Embedding jobs (embedding.py) run beside the steps, one
chunk per pass, so neither starves the other.

A failure the loop cannot contain (one that escapes its own guard around a step) kills the engine, as
vLLM's EngineDeadError does: every open stream and every queued submission fails with EngineDeadError,
later submissions are refused at once, and `is_running` turns false, so nothing waits forever on a
loop that will never step again.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.embedding import Embedder, EmbedJob, awaited_job
from cloud.engine.kv.memory import release_free_heap
from cloud.engine.serving.output_stream import RequestStream
from cloud.grammar.compiled import CompiledGrammar
from shared.engine_types import EngineStats, ImageSpan, Pooling, RequestOutput, SamplingParams
from shared.errors import EngineDeadError

log = structlog.get_logger("ctxfuse.engine")

Sink = Callable[[RequestOutput], None]


Accepted = Callable[[Exception | None], None]  # called on the engine thread: None, or the refusal


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    sink: Sink
    accepted: Accepted
    grammar: CompiledGrammar | None = None
    image_spans: tuple[ImageSpan, ...] = ()


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Embed:
    job: EmbedJob


class AsyncEngine:
    """`thread`: step on a thread of its own (else the owner calls `run`). `after_iteration`: called on
    the engine thread after each pass of the loop (commands applied, a step delivered), where an
    engine process sends what the pass produced."""

    def __init__(
        self,
        core: EngineCore,
        *,
        thread: bool = True,
        after_iteration: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Add | _Abort | _Embed | None] = queue.SimpleQueue()
        cfg = core.config
        self.embedder = Embedder(core.model, cfg.max_num_batched_tokens, cfg.max_waiting)
        self._sinks: dict[str, Sink] = {}
        self._grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ctxfuse-grammar")
        self._after_iteration = after_iteration
        self._thread = threading.Thread(target=self._run_on_thread, name="ctxfuse-engine", daemon=True)
        self._stopped = False
        # why the loop died, once it has; with the open streams, guarded by the lock so that a stream
        # or a submission arriving as the loop dies is either failed by _die or refused by its caller
        self._dead: str | None = None
        self._streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self._lock = threading.Lock()
        # commands taken off the queue and not yet applied: refused by _die if the loop dies first
        self._taken: deque[_Add | _Abort | _Embed | None] = deque()
        if thread:
            self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(EngineCore(config))

    # -- caller side (any thread) -------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        request_id: str | None = None,
        priority: int = 0,
        grammar: CompiledGrammar | None = None,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> str:
        """Queue a request; `sink` receives its outputs on the engine thread. Raises the client's
        mistake (or QueueFullError, or EngineDeadError) here, before any work: the core's admission
        (the one check behind the gateway's) refuses it on the engine thread. `grammar`:
        params.grammar compiled; compiled here, on the caller's thread, when not given (never on the
        engine thread)."""
        rid = request_id or self.core.next_request_id()
        if grammar is None:
            grammar = self.core.compile_grammar(params)
        done = threading.Event()
        refusal: list[Exception | None] = [None]

        def accepted(error: Exception | None) -> None:
            refusal[0] = error
            done.set()

        self.enqueue(rid, prompt_token_ids, params, sink, accepted, priority, grammar, image_spans)
        done.wait()
        if refusal[0] is not None:
            raise refusal[0]
        return rid

    def enqueue(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        accepted: Accepted,
        priority: int = 0,
        grammar: CompiledGrammar | None = None,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> None:
        """Queue a request without waiting: `accepted` hears, on the engine thread, whether the core
        took it (None) or refused it (the error); on this thread at once when the engine is dead.
        `grammar` must already be compiled when asked for."""
        with self._lock:
            dead = self._dead
            if dead is None:
                self._commands.put(
                    _Add(request_id, prompt_token_ids, params, priority, sink, accepted, grammar, image_spans)
                )
        if dead is not None:
            accepted(EngineDeadError(dead))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def enqueue_embed(self, job: EmbedJob) -> None:
        """Queue an embedding job; its `done` hears the vectors or the failure on the engine thread
        (on this thread at once when the engine is dead). Its inputs must already be checked."""
        with self._lock:
            dead = self._dead
            if dead is None:
                self._commands.put(_Embed(job))
        if dead is not None:
            job.done(EngineDeadError(dead))

    async def embed(self, inputs: list[list[int]], pooling: Pooling, request_id: str) -> torch.Tensor:
        """The inputs' L2-normalized embeddings [inputs, hidden] (fp32, on the CPU); leaving early
        (cancellation) drops the job."""
        job, result = awaited_job(request_id, inputs, pooling)
        self.enqueue_embed(job)
        try:
            return await result
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    async def open(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> RequestStream:
        """Submit a request and return its output stream once the engine has accepted it. Refusals
        (the client's mistake, QueueFullError) raise here, before any output exists."""
        grammar = await self.compile_grammar(params)
        stream = RequestStream(self, params.n)
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._streams.add(stream)  # failed by _die should the loop die while it is open
        # submit waits for the engine thread to take the command (at most one step): run it off the loop
        accepted = asyncio.ensure_future(
            asyncio.to_thread(
                self.submit,
                prompt_token_ids,
                params,
                stream.sink,
                request_id=request_id,
                priority=priority,
                grammar=grammar,
                image_spans=image_spans,
            )
        )
        try:
            stream.request_id = await asyncio.shield(accepted)
        except asyncio.CancelledError:
            # the caller left while the thread was still submitting: abort once the engine has it
            accepted.add_done_callback(self._abort_accepted)
            raise
        return stream

    async def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """params.grammar compiled: from the cache at once, else on the grammar threads, so a schema
        that is slow to compile holds up neither the event loop, the engine, nor other submissions."""
        spec = params.grammar
        if spec is None:
            return None
        cached = self.core.grammars.cached(spec)
        if cached is not None:
            return cached
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._grammar_pool, self.core.grammars.compile, spec)

    def off_loop(self, fn: Callable[..., object], *args: object) -> None:
        """Run fn(*args) on the grammar threads (work such as a compile that must hold up neither
        the engine loop nor the thread that hands it commands)."""
        self._grammar_pool.submit(fn, *args)

    def _abort_accepted(self, accepted: asyncio.Future[str]) -> None:
        if not accepted.cancelled() and accepted.exception() is None:
            self.abort(accepted.result())

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; leaving the loop early aborts the request."""
        stream = await self.open(prompt_token_ids, params, request_id=request_id, priority=priority)
        try:
            async for o in stream:
                yield o
        finally:
            stream.close()

    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        if not self._stopped:
            self._stopped = True
            self._commands.put(None)
            if self._thread.is_alive():
                self._thread.join(timeout)
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            if not self._thread.is_alive():  # (a step still running owns the core)
                self.core.close()

    # -- engine thread ------------------------------------------------------------------------

    def _apply(self, cmd: _Add | _Abort | _Embed) -> None:
        if isinstance(cmd, _Embed):
            try:
                self.embedder.add(cmd.job)
            except Exception as exc:  # refused (a full queue): its caller hears why
                cmd.job.done(exc)
        elif isinstance(cmd, _Add):
            try:
                self.core.add_request(
                    cmd.request_id,
                    cmd.prompt_token_ids,
                    cmd.params,
                    cmd.priority,
                    cmd.grammar,
                    cmd.image_spans,
                )
            except Exception as exc:  # refused: the submitter re-raises it
                cmd.accepted(exc)
                return
            self._sinks[cmd.request_id] = cmd.sink
            cmd.accepted(None)
        elif not self.embedder.abort(cmd.request_id):
            self._deliver(self.core.abort(cmd.request_id))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            sink = self._sinks.get(o.request_id)
            if sink is None:
                continue
            try:
                sink(o)
            except Exception:  # a broken consumer (closed event loop) must not stop the engine
                log.warning("output_sink_failed", request_id=o.request_id)
                self._commands.put(_Abort(o.request_id))
        # only after every output of the step is out: several choices of one request may finish together
        for rid in {o.request_id for o in outputs if o.finished}:
            if not self.core.is_live(rid):
                self._sinks.pop(rid, None)

    def _drain(self, block: bool) -> list[_Add | _Abort | _Embed | None]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _run_on_thread(self) -> None:
        # _die has logged the failure and failed every request: the thread just ends
        with contextlib.suppress(BaseException):
            self.run()

    def run(self) -> None:
        """The loop until shutdown; a failure that escapes it kills the engine (see _die) and is
        raised again, so an engine process ends with it and its gateway sees the process exit."""
        try:
            self._loop()
        except BaseException as exc:
            self._die(exc)
            raise

    def _die(self, exc: BaseException) -> None:
        reason = f"the engine has stopped: {type(exc).__name__}: {exc}"
        log.error("engine_loop_died", reason=reason, exc_info=exc)
        with self._lock:
            self._dead = reason
            streams = list(self._streams)
            pending = [*self._taken, *self._drain(block=False)]
        for cmd in pending:  # queued submissions: their submitters wait for this answer
            if isinstance(cmd, _Add):
                cmd.accepted(EngineDeadError(reason))
            elif isinstance(cmd, _Embed):
                cmd.job.done(EngineDeadError(reason))
        self.embedder.fail_all(EngineDeadError(reason))
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # that event loop has closed: nobody waits there
                stream.loop.call_soon_threadsafe(stream.fail, reason)
        self._sinks.clear()

    def _loop(self) -> None:
        """Apply commands, step while there is work, sleep when idle; until shutdown."""
        worked = False
        while True:
            idle = not self.core.has_work() and not self.embedder.has_work()
            if idle and worked:  # give back what the steps' activations left on the heap
                release_free_heap()
            worked = not idle
            self._taken.extend(self._drain(block=idle))  # sleep only when idle
            while self._taken:
                cmd = self._taken.popleft()
                if cmd is None:
                    return
                self._apply(cmd)
            if self.core.has_work():
                try:
                    outputs = self.core.step()
                except Exception as exc:  # the core fails a bad step's requests itself; a last guard
                    log.exception("engine_step_failed")
                    outputs = self.core.fail_all(exc)
                self._deliver(outputs)
            if self.embedder.has_work():
                self.embedder.run_chunk()  # fails only its own jobs when it fails
            if self._after_iteration is not None:
                self._after_iteration()
