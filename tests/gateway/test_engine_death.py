"""A dead engine is loud (vLLM's EngineDeadError): the open requests fail with a 503 `engine_dead`
error (an SSE error event mid-stream), new requests are refused at once, /health and /ready answer
503, and `ctxfuse serve` / `ctxfuse worker` exit non-zero so a supervisor restarts them.

The engine dies for real: its process is SIGKILLed (serve's default), or its in-process loop meets a
failure its guard cannot contain (a step that raises, then a `fail_all` that raises too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend

from .conftest import ENGINE, GATEWAY, MODEL, Running, run_in_thread

REPO = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "Count to a thousand."}]
LONG = {"model": MODEL, "messages": HI, "max_tokens": 1500, "ignore_eos": True}
ASK = {"model": MODEL, "messages": HI, "max_tokens": 1500, "extra_body": {"ignore_eos": True}}
GUARD_S = 120  # a hang guard: a dead engine must never leave a request waiting this long


def _break(core: EngineCore) -> None:
    """Make the engine loop die: its step raises, and so does the guard's fail_all."""

    def boom(*_: object) -> Any:
        raise RuntimeError("injected fault")

    core.step = boom  # type: ignore[method-assign]
    core.fail_all = boom  # type: ignore[method-assign]


KEY = "engine-death-test-key"  # serve's and the worker's --api-key (a worker requires one)


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=GUARD_S)


def _stream_until_first_token(client: openai.OpenAI) -> Iterator[Any]:
    """A long stream, read up to its first content token (the engine is stepping it)."""
    stream = iter(client.chat.completions.create(**ASK, stream=True))  # type: ignore[call-overload]
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return stream
    raise AssertionError("the stream ended before its first token")


def _assert_engine_dead(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "engine_dead" and error["type"] == "server_error", error
    assert "engine has stopped" in error["message"], error


@pytest.fixture()
def doomed(loaded_model: LoadedModel) -> Iterator[tuple[InProcessBackend, Running]]:
    """A gateway over an in-process engine of its own (the session's engine must live on)."""
    backend = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    running = run_in_thread(backend, GATEWAY)
    yield backend, running
    running.stop()
    backend.shutdown()


def test_a_dead_in_process_loop_fails_the_stream_and_refuses_new_work(
    doomed: tuple[InProcessBackend, Running],
) -> None:
    backend, running = doomed
    assert httpx.get(f"{running.url}/health").status_code == 200
    stream = _stream_until_first_token(_client(f"{running.url}/v1"))
    _break(backend.engine.core)
    with pytest.raises(openai.APIError, match="engine has stopped: RuntimeError: injected fault"):
        for _ in stream:
            pass
    assert not backend.is_alive()
    for path in ("/health", "/ready"):
        r = httpx.get(f"{running.url}{path}", timeout=GUARD_S)
        assert r.status_code == 503 and "engine has stopped" in r.json()["status"], (path, r.text)
    # new work is refused before anything is queued: a plain request and a stream alike
    _assert_engine_dead(httpx.post(f"{running.url}/v1/chat/completions", json=LONG, timeout=GUARD_S))
    with pytest.raises(openai.InternalServerError) as exc:
        _client(f"{running.url}/v1").chat.completions.create(**ASK, stream=True)  # type: ignore[call-overload]
    assert exc.value.status_code == 503 and exc.value.code == "engine_dead"


def test_a_request_waiting_for_its_answer_gets_a_503_when_the_loop_dies(
    doomed: tuple[InProcessBackend, Running],
) -> None:
    backend, running = doomed
    answer: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: answer.setdefault(
            "r", httpx.post(f"{running.url}/v1/chat/completions", json=LONG, timeout=GUARD_S)
        )
    )
    t.start()
    while backend.stats().num_running == 0:  # the engine is decoding it
        assert t.is_alive(), answer
        threading.Event().wait(0.01)
    _break(backend.engine.core)
    t.join(GUARD_S)
    _assert_engine_dead(answer["r"])
    assert "RuntimeError: injected fault" in answer["r"].json()["error"]["message"]


def test_the_server_stops_by_itself_once_its_engine_died(loaded_model: LoadedModel) -> None:
    from gateway.server import build_server

    backend = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    server = build_server(backend, GATEWAY, announce=False, exit_on_engine_death=True)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            threading.Event().wait(0.02)
        stream = _stream_until_first_token(_client(f"http://127.0.0.1:{server.bound_port}/v1"))
        _break(backend.engine.core)
        with pytest.raises(openai.APIError, match="engine has stopped"):
            for _ in stream:
                pass
        thread.join(GUARD_S)
        assert not thread.is_alive() and server.engine_died
    finally:
        server.should_exit = True
        thread.join(30)
        backend.shutdown()


# -- real processes, as a supervisor runs them ------------------------------------------------------

_ENGINE_ARGS = ["--dtype", "float32", "--weight-quant", "none", "--kv-cache-memory", "0.25"]

# `ctxfuse worker` whose engine loop dies on SIGUSR1 (the fault armed by the signal, not a test hook in
# the product): the loop's next step raises, and so does the guard's fail_all
_WORKER_WITH_FAULT = """
import signal, sys
from cloud.engine.core import EngineCore
from ctxfuse.cli import main

def boom(*_):
    raise RuntimeError("injected fault")

def arm(*_):
    EngineCore.step = boom
    EngineCore.fail_all = boom

signal.signal(signal.SIGUSR1, arm)
raise SystemExit(main(sys.argv[1:]))
"""


def _start(cmd: list[str], tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "CTXFUSE_API_KEY": KEY}
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=(tmp_path / "stderr").open("w"), text=True, env=env
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the server listens (or dies)
    assert "base_url=" in line, (line, (tmp_path / "stderr").read_text())
    return proc, line.split("base_url=")[1].strip()


def _engine_child(pid: int) -> int:
    """The engine process that `ctxfuse serve` spawned (multiprocessing may add a resource tracker)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
                return int(child)
    raise AssertionError("serve has no engine process")


def _dies_loudly(proc: subprocess.Popen[str], base_url: str, stream: Iterator[Any], tmp_path: Path) -> None:
    with pytest.raises(openai.APIError, match="engine has stopped"):
        for _ in stream:
            pass
    # until it has exited, the server refuses at once with the same error; after, nothing listens
    # (or the connection closes as it exits): never a wait
    with contextlib.suppress(httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        auth = {"Authorization": f"Bearer {KEY}"}
        _assert_engine_dead(
            httpx.post(f"{base_url}/chat/completions", json=LONG, headers=auth, timeout=GUARD_S)
        )
    assert proc.wait(GUARD_S) == 1
    assert "the engine has stopped" in (tmp_path / "stderr").read_text()


def test_serve_exits_non_zero_when_its_engine_process_is_killed(gguf_path: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ctxfuse", "serve", "--port", "0", "--model", str(gguf_path)]
    cmd += ["--served-model-name", MODEL, *_ENGINE_ARGS, "--max-model-len", "2048"]
    proc, base_url = _start([*cmd, "--data-dir", str(tmp_path)], tmp_path)
    try:
        stream = _stream_until_first_token(_client(base_url))
        os.kill(_engine_child(proc.pid), signal.SIGKILL)  # the OOM killer, say
        _dies_loudly(proc, base_url, stream, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_exits_non_zero_when_its_engine_process_is_killed(gguf_path: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ctxfuse", "worker", "--port", "0", "--model", str(gguf_path)]
    proc, base_url = _start([*cmd, "--served-model-name", MODEL, *_ENGINE_ARGS], tmp_path)
    try:
        stream = _stream_until_first_token(_client(base_url))
        os.kill(_engine_child(proc.pid), signal.SIGKILL)
        _dies_loudly(proc, base_url, stream, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_exits_non_zero_when_its_in_process_engine_loop_dies(gguf_path: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", _WORKER_WITH_FAULT, "worker", "--port", "0", "--model", str(gguf_path)]
    cmd += ["--engine-in-process"]  # the fault is injected into this process's EngineCore
    proc, base_url = _start([*cmd, "--served-model-name", MODEL, *_ENGINE_ARGS], tmp_path)
    try:
        stream = _stream_until_first_token(_client(base_url))
        proc.send_signal(signal.SIGUSR1)
        _dies_loudly(proc, base_url, stream, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
