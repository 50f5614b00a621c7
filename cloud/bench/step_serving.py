"""The serving half of `ctxfuse bench step-profile` (step_profile.py): the same prompt per way
`ctxfuse serve` runs its engine, timed per token at the gateway's Backend and at an HTTP client of a
real server on loopback."""

from __future__ import annotations

import asyncio
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import msgspec

from cloud.bench.step_timers import ProfileOptions
from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from shared.engine_types import SamplingParams

if TYPE_CHECKING:  # the serving backends load only where the seam is measured
    from cloud.serving.in_process import InProcessBackend
    from cloud.serving.process import ProcessBackend

    Backend = InProcessBackend | ProcessBackend


HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Mode:
    """How `ctxfuse serve` runs its engine."""

    name: str
    in_process: bool  # on a thread of the gateway's process (`--engine-in-process`)

    @property
    def serve_args(self) -> list[str]:
        return ["--engine-in-process"] if self.in_process else []


MODES = (Mode("engine process (default)", False), Mode("engine in-process", True))


@dataclass(slots=True)
class Stream:
    """One request's tokens as they arrived, timed where they were read (a mode's figure: the median
    of its rounds' per_token_ms)."""

    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float  # from the send to the first content
    per_token_ms: float  # (last arrival - first) / (tokens after the first arrival)


@dataclass(slots=True)
class ModeFigures:
    mode: str
    seam: list[Stream] = field(default_factory=list)  # the engine behind the gateway's Backend
    api: list[Stream] = field(default_factory=list)  # through `ctxfuse serve`, at the HTTP client

    @staticmethod
    def median(streams: list[Stream]) -> float:
        return statistics.median(s.per_token_ms for s in streams) if streams else float("nan")


def _stream(start: float, arrivals: list[tuple[float, int]], prompt_tokens: int, total: int) -> Stream:
    """arrivals: (time, tokens it brought); total: the completion's token count."""
    if len(arrivals) < 2 or total < 2:
        raise RuntimeError("fewer than two arrivals carried tokens")
    (first, first_tokens), (last, _) = arrivals[0], arrivals[-1]
    return Stream(
        prompt_tokens, total, 1000 * (first - start), 1000 * (last - first) / (total - first_tokens)
    )


async def _seam_once(backend: Backend, prompt: list[int], new_tokens: int, request_id: str) -> Stream:
    """One request through the Backend the gateway's routes use (ProcessBackend, InProcessBackend)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    gen = await backend.submit(prompt, params, request_id)
    arrivals: list[tuple[float, int]] = []
    try:
        async for out in gen:
            if out.error is not None:
                raise RuntimeError(f"request {request_id} failed: {out.error}")
            if out.token_ids:
                arrivals.append((time.perf_counter(), len(out.token_ids)))
    finally:
        gen.close()
    return _stream(start, arrivals, len(prompt), sum(n for _, n in arrivals))


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Server:
    """`ctxfuse serve` in a subprocess on a loopback port, with its own data directory; its output goes
    to a log file shown when it fails to start."""

    def __init__(self, args: list[str], workdir: Path) -> None:
        self.port = _free_port()
        self.log = workdir / f"serve-{self.port}.log"
        data = workdir / f"data-{self.port}"
        cmd = [sys.executable, "-m", "ctxfuse", "serve", "--host", HOST, "--port", str(self.port)]
        cmd += ["--data-dir", str(data), "--log-level", "warning", *args]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://{HOST}:{self.port}"

    def wait_ready(self, client: httpx.Client, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"ctxfuse serve exited with status {self.proc.returncode}:\n{tail}")
            try:
                if client.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"ctxfuse serve not ready after {timeout_s:.0f} s (log: {self.log})")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stream_api(client: httpx.Client, url: str, model: str, text: str, new_tokens: int) -> Stream:
    """One streamed chat completion, timed as its content chunks arrive at this client."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    decoder = msgspec.json.Decoder(_Chunk)
    arrivals: list[tuple[float, int]] = []
    usage: _Usage | None = None
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:500]}")
        for line in resp.iter_lines():
            now = time.perf_counter()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = decoder.decode(line[5:].strip())
            if any(c.delta.content for c in chunk.choices):
                arrivals.append((now, 1))  # a chunk per step: c=1 decodes one token a step
            usage = chunk.usage or usage
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    return _stream(start, arrivals, usage.prompt_tokens, usage.completion_tokens)


class Targets:
    """Every way a token reaches a caller, started once and kept up while the rounds alternate between
    them: per mode, the engine behind the gateway's Backend (our core on an AsyncEngine thread, or an
    engine process behind a pipe) and `ctxfuse serve` at an HTTP client."""

    def __init__(self, core: EngineCore, prompt: list[int], text: str, opts: ProfileOptions, workdir: Path):
        from cloud.serving.process import ProcessBackend

        self.core, self.prompt, self.text = core, prompt, text
        model = ["--model", opts.model] if opts.model else []
        self.servers = {m.name: Server(model + m.serve_args, workdir) for m in MODES}
        self.loop = asyncio.new_event_loop()
        self.client = httpx.Client(trust_env=False, timeout=httpx.Timeout(600.0))
        self.engine_process: ProcessBackend | None = None
        try:
            self.engine_process = ProcessBackend(EngineConfig(model=opts.model))
            for server in self.servers.values():
                server.wait_ready(self.client)
            self.model = msgspec.json.decode(self._get("/v1/models"), type=_Models).data[0].id
        except BaseException:
            self.close()
            raise

    def _get(self, path: str) -> bytes:
        return self.client.get(next(iter(self.servers.values())).url + path).content

    def seam(self, mode: Mode, new_tokens: int, request_id: str) -> Stream:
        from cloud.engine.serving.async_engine import AsyncEngine
        from cloud.serving.in_process import InProcessBackend

        if not mode.in_process and self.engine_process is not None:
            return self.loop.run_until_complete(
                _seam_once(self.engine_process, self.prompt, new_tokens, request_id)
            )
        # the core steps on an AsyncEngine thread for this request only: between them it is the rounds'
        backend = InProcessBackend(AsyncEngine(self.core))
        try:
            return self.loop.run_until_complete(_seam_once(backend, self.prompt, new_tokens, request_id))
        finally:
            backend.shutdown()

    def api(self, mode: Mode, new_tokens: int) -> Stream:
        return stream_api(self.client, self.servers[mode.name].url, self.model, self.text, new_tokens)

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        if self.engine_process is not None:
            self.engine_process.shutdown()
        self.client.close()
        self.loop.close()
