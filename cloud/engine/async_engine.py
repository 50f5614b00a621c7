"""The serving loop: the engine core steps in its own thread; callers submit and iterate outputs
from asyncio. A slow consumer never stalls the batch (outputs queue up per request), and a consumer
that stops iterating (a client that went away) aborts its request, which frees its blocks at once.

Commands (add, abort) reach the loop through a thread-safe queue and are applied between steps,
so the core itself stays single-threaded.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from .config import EngineConfig
from .core import EngineCore, EngineStats
from .output import RequestOutput
from .request import SamplingParams

log = structlog.get_logger("ctxfuse.engine")

Sink = Callable[[RequestOutput], None]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    sink: Sink
    accepted: threading.Event
    error: Exception | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._thread = threading.Thread(target=self._loop, name="ctxfuse-engine", daemon=True)
        self._stopped = False
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
    ) -> str:
        """Queue a request; `sink` receives its outputs on the engine thread. Raises the client's
        mistake (or QueueFullError) here, before any work."""
        rid = request_id or self.core.next_request_id()
        self.core.check(prompt_token_ids, params)
        cmd = _Add(rid, prompt_token_ids, params, priority, sink, threading.Event())
        self._commands.put(cmd)
        cmd.accepted.wait()
        if cmd.error is not None:
            raise cmd.error
        return rid

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; leaving the loop early aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(o: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, o)

        rid = await asyncio.to_thread(
            self.submit, prompt_token_ids, params, sink, request_id=request_id, priority=priority
        )
        remaining = params.n
        try:
            while remaining:
                o = await outputs.get()
                if o.finished:
                    remaining -= 1
                yield o
        finally:
            if remaining:
                self.abort(rid)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        if not self._stopped:
            self._stopped = True
            self._commands.put(None)
            self._thread.join(timeout)

    # -- engine thread ------------------------------------------------------------------------

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            try:
                self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority)
                self._sinks[cmd.request_id] = cmd.sink
            except Exception as exc:  # refused: the submitter re-raises it
                cmd.error = exc
            cmd.accepted.set()
        else:
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
            if o.finished and not self.core.is_live(o.request_id):
                self._sinks.pop(o.request_id, None)

    def _drain(self, block: bool) -> list[_Add | _Abort | None]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _loop(self) -> None:
        while True:
            for cmd in self._drain(block=not self.core.has_work()):  # sleep only when idle
                if cmd is None:
                    return
                self._apply(cmd)
            if not self.core.has_work():
                continue
            try:
                outputs = self.core.step()
            except Exception as exc:  # the core fails a bad step's requests itself; this is a last guard
                log.exception("engine_step_failed")
                outputs = self.core.fail_all(exc)
            self._deliver(outputs)
