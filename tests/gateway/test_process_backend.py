"""The engine core in its own process (serve's default): the same answers as the in-process engine,
refusals with their reasons, aborts that free blocks, and a dead engine process that fails open
requests and the readiness check instead of hanging them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from cloud.engine.serving.engine_process import Refusal
from cloud.serving.in_process import InProcessBackend
from cloud.serving.process import ProcessBackend
from shared.block_hash import hash_block
from shared.engine_types import SamplingParams
from shared.errors import ContextLengthExceededError, EngineError, ModelLoadError, QueueFullError

from .conftest import ENGINE, GATEWAY, MODEL, Running, run_in_thread, wait_idle

REPO = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def engine_config(gguf_path: Path):  # type: ignore[no-untyped-def]
    return replace(ENGINE, model=str(gguf_path))


@pytest.fixture(scope="module")
def process_backend(engine_config) -> Iterator[ProcessBackend]:  # type: ignore[no-untyped-def]
    b = ProcessBackend(engine_config)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def process_server(process_backend: ProcessBackend) -> Iterator[Running]:
    running = run_in_thread(process_backend, GATEWAY)
    yield running
    running.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def test_embeddings_through_the_engine_process_match_the_in_process_engine(
    process_server: Running,
    served,  # type: ignore[no-untyped-def]
) -> None:
    ask = {"model": MODEL, "input": ["an engine in a child process", "hi"], "encoding_format": "float"}
    ours = _client(process_server.url).embeddings.create(**ask)  # type: ignore[arg-type]
    theirs = served.client().embeddings.create(**ask)
    assert [d.index for d in ours.data] == [0, 1] and ours.usage == theirs.usage
    for a, b in zip(ours.data, theirs.data, strict=True):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-5


def test_greedy_answers_match_the_in_process_engine(
    process_server: Running,
    served,
    backend: InProcessBackend,  # type: ignore[no-untyped-def]
) -> None:
    ask = {
        "model": MODEL,
        "messages": HI,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    ours = _client(process_server.url).chat.completions.create(**ask)  # type: ignore[arg-type]
    theirs = served.client().chat.completions.create(**ask)
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.usage.completion_tokens == theirs.usage.completion_tokens == 24  # type: ignore[union-attr]
    a, b = ours.choices[0].logprobs.content, theirs.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [t.token for t in a] == [t.token for t in b]
    assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-4)


def test_streams_n_choices_with_usage(process_server: Running) -> None:
    stream = _client(process_server.url).chat.completions.create(
        model=MODEL,
        messages=HI,  # type: ignore[arg-type]
        max_tokens=8,
        n=2,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = {0: "", 1: ""}
    finish = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert finish == {0: "length", 1: "length"}
    assert all(text.values())
    assert usage is not None and usage.completion_tokens == 16


def test_refusals_keep_their_status_and_reason(
    process_server: Running, process_backend: ProcessBackend
) -> None:
    r = httpx.post(
        f"{process_server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "max_tokens": 5000},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 2048" in r.json()["error"]["message"]
    # an error raised in the engine process comes back with its class, status and fields
    err = Refusal.of(QueueFullError("the waiting queue is full", retry_after_s=3.0)).error()
    assert isinstance(err, QueueFullError) and err.status == 429 and err.retry_after_s == 3.0
    assert isinstance(Refusal.of(ContextLengthExceededError("x")).error(), ContextLengthExceededError)
    assert isinstance(Refusal.of(RuntimeError("boom")).error(), EngineError)


def test_a_client_that_leaves_frees_its_blocks(
    process_server: Running, process_backend: ProcessBackend
) -> None:
    free = process_backend.stats().num_blocks
    wait_idle(process_backend, free, timeout=60)
    body = {"model": MODEL, "messages": HI, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{process_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first token: leave mid-stream
    wait_idle(process_backend, free, timeout=60)


def test_a_schema_is_compiled_in_the_engine_process(process_server: Running) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
    }
    r = _client(process_server.url).chat.completions.create(
        model=MODEL,
        messages=HI,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},  # type: ignore[typeddict-item]
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert json.loads(r.choices[0].message.content or "")["colour"] in ("red", "green", "blue")


def test_the_prefix_cache_s_blocks_cross_the_pipe_as_a_router_names_them(
    process_backend: ProcessBackend,
) -> None:
    """A worker's router reads the mirror: after a prompt ran, it holds the prompt's full blocks
    under exactly the hashes a router computes from the same token ids (shared/block_hash.py)."""
    ids = process_backend.encode_chat([{"role": "user", "content": "Tell me a story. " * 12}]).token_ids
    size = process_backend.block_size
    assert len(ids) >= 2 * size

    async def run() -> None:
        gen = await process_backend.submit(ids, SamplingParams(max_tokens=1), "mirror-probe")
        async for _ in gen:
            pass

    before, held_before = process_backend.block_events.next_event, process_backend.block_events.held()
    asyncio.run(run())
    chain, parent = [], None
    for i in range(len(ids) // size):
        parent = hash_block(parent, ids[i * size : (i + 1) * size])
        chain.append(parent)
    assert set(chain) <= process_backend.block_events.held()
    delta = process_backend.block_events.since(process_backend.block_events.epoch, before)
    # a router polling the worker sees the new ones (the template's leading blocks may be held already)
    assert not delta.reset and set(chain) - held_before <= set(delta.stored)
    assert set(chain) - held_before  # the story's own blocks were new


def test_a_dead_engine_process_fails_requests_and_readiness(engine_config) -> None:  # type: ignore[no-untyped-def]
    b = ProcessBackend(engine_config)
    running = run_in_thread(b, GATEWAY)
    try:
        assert httpx.get(f"{running.url}/ready").status_code == 200
        body = {"model": MODEL, "messages": HI, "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{running.url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    os.kill(b.engine_pid, signal.SIGKILL)  # the OOM killer, say
                    break
            rest = list(lines)
        assert any(line.startswith('data: {"error":') and "engine process exited" in line for line in rest), (
            rest
        )
        assert "data: [DONE]" not in rest
        assert not b.is_alive()
        assert httpx.get(f"{running.url}/ready").status_code == 503
        r2 = httpx.post(
            f"{running.url}/v1/chat/completions", json={"model": MODEL, "messages": HI}, timeout=30
        )
        assert r2.status_code == 503 and "engine has stopped" in r2.json()["error"]["message"]
    finally:
        running.stop()
        b.shutdown()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state  # a zombie nobody reaps has still exited


def test_the_engine_process_ends_when_the_gateway_dies(gguf_path: Path) -> None:
    script = (
        "import os, sys\n"
        "from dataclasses import replace\n"
        "from tests.gateway.conftest import ENGINE\n"
        "from cloud.serving.process import ProcessBackend\n"
        "b = ProcessBackend(replace(ENGINE, model=sys.argv[1]))\n"
        "print(b.engine_pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    gateway = subprocess.Popen(
        [sys.executable, "-c", script, str(gguf_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert gateway.stdout is not None
    engine_pid = int(gateway.stdout.readline())
    assert not _gone(engine_pid)
    gateway.kill()  # no shutdown, no atexit: the pipe just closes
    gateway.wait()
    for _ in range(600):  # a hang guard (60 s), not a speed bound
        if _gone(engine_pid):
            break
        time.sleep(0.1)
    assert _gone(engine_pid)


def test_a_model_that_cannot_load_is_refused_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError) as exc:
        ProcessBackend(replace(ENGINE, model=str(bad)))
    assert "broken.gguf" in str(exc.value), exc.value
