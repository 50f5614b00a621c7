"""The engine core in a process of its own, as vLLM v1 runs its EngineCore: the gateway's event loop
and the engine's step loop no longer share one GIL (on a small CPU, a streamed token's HTTP work held
the engine's Python for up to the interpreter's 5 ms switch interval at a time).

The two sides talk over one pipe. The gateway sends commands (add, abort, embed, shutdown); the
engine sends, after each pass of its loop, one `Batch`: which submissions it took or refused, the
outputs of the step, the embeddings finished, and its stats. Hot messages are msgpack (msgspec); the
start-up greeting, sent once, is pickled. In the engine process the core steps on the main thread; a
reader thread turns commands into AsyncEngine submissions (compiling a request's grammar first on a
small pool, so a slow schema holds up neither the steps nor other commands). When the gateway goes
away the pipe closes and the engine process ends; when the engine process dies the gateway fails
every open request with an error and its health check turns red (gateway/backends/process.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import torch

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.embedding import EmbedJob
from cloud.engine.scheduling.admission import Admission
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.grammar.compiled import CompiledGrammar
from cloud.model.chat_template import ChatTemplate
from cloud.model.tokenizer import Tokenizer
from shared.engine_types import EngineStats, ImageSpan, Pooling, RequestOutput, SamplingParams
from shared.errors import (
    ContextLengthExceededError,
    CtxfuseError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    NotFoundError,
    QueueFullError,
)
from shared.fleet_protocol import BlockEvents


class AddMsg(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    image_spans: tuple[ImageSpan, ...] = ()


class AbortMsg(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class EmbedMsg(msgspec.Struct, tag="embed", array_like=True):
    request_id: str
    inputs: list[list[int]]  # checked by the gateway
    pooling: Pooling


class ShutdownMsg(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = AddMsg | AbortMsg | EmbedMsg | ShutdownMsg

_ERRORS: dict[str, type[CtxfuseError]] = {
    c.__name__: c
    for c in (
        InvalidRequestError,
        ContextLengthExceededError,
        QueueFullError,
        NotFoundError,
        ModelLoadError,
        EngineError,
        EngineDeadError,
    )
}


class Refusal(msgspec.Struct, array_like=True):
    """An error carried across the pipe; `error()` rebuilds it with its class, status and fields."""

    kind: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def of(cls, exc: BaseException) -> Refusal:
        if isinstance(exc, CtxfuseError) and type(exc).__name__ in _ERRORS:
            return cls(
                type(exc).__name__, exc.message, exc.param, exc.code, getattr(exc, "retry_after_s", None)
            )
        return cls("EngineError", f"{type(exc).__name__}: {exc}")

    def error(self) -> CtxfuseError:
        kind = _ERRORS.get(self.kind, EngineError)
        err = kind.__new__(kind)
        CtxfuseError.__init__(err, self.message, param=self.param, code=self.code)
        if self.retry_after_s is not None:
            err.retry_after_s = self.retry_after_s  # type: ignore[attr-defined]
        return err


class Embedded(msgspec.Struct, array_like=True):
    """An embedding job's answer: its vectors ([rows, hidden] float32, native byte order; both ends
    run on one machine) or why it failed."""

    request_id: str
    vectors: bytes = b""
    rows: int = 0
    refusal: Refusal | None = None

    @classmethod
    def of(cls, request_id: str, out: torch.Tensor | BaseException) -> Embedded:
        if isinstance(out, BaseException):
            return cls(request_id, refusal=Refusal.of(out))
        return cls(request_id, out.float().contiguous().numpy().tobytes(), out.shape[0])

    def result(self) -> np.ndarray | CtxfuseError:
        if self.refusal is not None:
            return self.refusal.error()
        return np.frombuffer(self.vectors, dtype=np.float32).reshape(self.rows, -1)


class Batch(msgspec.Struct, array_like=True):
    """What one pass of the engine loop produced."""

    accepted: list[tuple[str, Refusal | None]]
    outputs: list[RequestOutput]
    stats: EngineStats
    embedded: list[Embedded] = msgspec.field(default_factory=list)
    # the prefix cache's changes since the previous batch, for the gateway's mirror (a worker's
    # router reads it); None when nothing changed
    blocks: BlockEvents | None = None


@dataclass(frozen=True, slots=True)
class Hello:
    """The engine process's greeting once its model is loaded (pickled, sent once)."""

    model_name: str
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    admission: Admission
    hidden_size: int  # the width of an embedding
    describe: tuple[str, ...]  # the lines `serve` prints at start-up
    stats: EngineStats
    block_size: int  # tokens per KV block: how the prefix cache's hashes chain
    max_num_seqs: int


@dataclass(frozen=True, slots=True)
class StartupFailed:
    refusal: Refusal


def engine_main(config: EngineConfig, conn: Connection) -> None:
    """The engine process: load the model, greet, then step until the gateway says stop or goes.
    Ctrl-C and SIGTERM reach the whole process group (a terminal, systemd): the gateway drains its
    streams on them, so the engine ignores both and ends when the gateway stops it or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        core = EngineCore(config)
    except BaseException as exc:  # the gateway reports it; nothing else runs here
        conn.send(StartupFailed(Refusal.of(exc) if isinstance(exc, CtxfuseError) else _load_error(exc)))
        return
    lines = (core.describe_device(), core.kv_plan.describe())
    hello = Hello(
        core.model_name,
        core.tokenizer,
        core.chat_template,
        core.admission,
        core.model_config.hidden_size,
        lines,
        core.stats(),
        core.kv_plan.block_size,
        core.config.max_num_seqs,
    )
    conn.send(hello)
    EngineServer(core, conn).run()


def _load_error(exc: BaseException) -> Refusal:
    return Refusal("ModelLoadError", f"the engine failed to start: {type(exc).__name__}: {exc}")


class EngineServer:
    """The engine process's side of the pipe."""

    def __init__(self, core: EngineCore, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self.engine = AsyncEngine(core, thread=False, after_iteration=self._flush)
        self._outputs: list[RequestOutput] = []
        self._accepted: list[tuple[str, Refusal | None]] = []
        self._embedded: list[Embedded] = []
        self._blocks_epoch: str | None = None  # the cursor into the core's block events already sent
        self._blocks_next = 0
        self._send_lock = threading.Lock()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(Command)

    def run(self) -> None:
        reader = threading.Thread(target=self._read, name="ctxfuse-engine-commands", daemon=True)
        reader.start()
        self.engine.run()

    # -- reader thread ------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                msg = self._decoder.decode(self.conn.recv_bytes())
                if isinstance(msg, AddMsg):
                    self._add(msg)
                elif isinstance(msg, AbortMsg):
                    self.engine.abort(msg.request_id)
                elif isinstance(msg, EmbedMsg):
                    self._embed(msg)
                else:
                    break
        except (EOFError, OSError):  # the gateway went away: stop too
            pass
        self.engine.shutdown()

    def _add(self, msg: AddMsg) -> None:
        spec = msg.params.grammar
        grammar = None if spec is None else self.core.grammars.cached(spec)
        if spec is None or grammar is not None:
            self._enqueue(msg, grammar)
        else:  # compiled on the engine's grammar threads, never on this reader
            self.engine.off_loop(self._compile_then_enqueue, msg)

    def _embed(self, msg: EmbedMsg) -> None:
        rid = msg.request_id

        def done(out: torch.Tensor | BaseException) -> None:
            self._embedded.append(Embedded.of(rid, out))

        self.engine.enqueue_embed(EmbedJob(rid, msg.inputs, msg.pooling, done))

    def _compile_then_enqueue(self, msg: AddMsg) -> None:
        try:
            grammar = self.core.compile_grammar(msg.params)
        except Exception as exc:  # the schema cannot be compiled: refused with the reason
            self._send(Batch([(msg.request_id, Refusal.of(exc))], [], self.core.stats()))
            return
        self._enqueue(msg, grammar)

    def _enqueue(self, msg: AddMsg, grammar: CompiledGrammar | None) -> None:
        rid = msg.request_id
        self.engine.enqueue(
            rid,
            msg.prompt_token_ids,
            msg.params,
            self._sink,
            lambda error: self._accepted.append((rid, None if error is None else Refusal.of(error))),
            msg.priority,
            grammar,
            tuple(msg.image_spans),
        )

    # -- engine (main) thread -----------------------------------------------------------------

    def _sink(self, out: RequestOutput) -> None:
        self._outputs.append(out)

    def _block_changes(self) -> BlockEvents | None:
        log = self.core.block_events
        if self._blocks_epoch == log.epoch and self._blocks_next == log.next_event:
            return None  # the common step: nothing entered or left the prefix cache
        changes = log.since(self._blocks_epoch, self._blocks_next)
        self._blocks_epoch, self._blocks_next = changes.epoch, changes.next_event
        return changes

    def _flush(self) -> None:
        blocks = self._block_changes()
        if not self._outputs and not self._accepted and not self._embedded and blocks is None:
            return
        batch = Batch(self._accepted, self._outputs, self.core.stats(), self._embedded, blocks)
        self._accepted, self._outputs, self._embedded = [], [], []
        self._send(batch)

    def _send(self, batch: Batch) -> None:
        data = self._encode(batch)
        # OSError: the gateway is gone; the reader sees EOF and stops the loop
        with self._send_lock, contextlib.suppress(OSError):
            self.conn.send_bytes(data)
