"""A real worker (the app of `ctxfuse worker`) over the real default model, on loopback: its internal
routes report the engine's load and name the prefix-cache blocks with the same chained hashes a
gateway computes from the prompt's token ids; the OpenAI routes answer as on a gateway; a plain
gateway has no internal routes."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import msgspec
import openai
import pytest

from cloud.serving.in_process import InProcessBackend
from ctxfuse.engine_serve import worker_engine
from gateway.backends.worker import MSGPACK
from gateway.config import GatewayConfig
from gateway.server import build_server
from shared.block_hash import hash_block
from shared.errors import CtxfuseError
from shared.fleet_protocol import HASH_SCHEME, BlockEvents, WorkerState

from .conftest import ENGINE, GATEWAY, MODEL, Running, Served, wait_idle

KEY = "worker-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}  # a worker requires its router's key


def start_worker(backend: InProcessBackend, config: GatewayConfig) -> Running:
    """The worker app over the session's engine, served in a thread (like conftest.run_in_thread)."""
    server = build_server(backend, config, announce=False, worker=worker_engine(backend))
    thread = threading.Thread(target=server.run, name="test-worker", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test worker did not start")
        time.sleep(0.02)
    return Running(server, thread)


@pytest.fixture(scope="module")
def worker(backend: InProcessBackend) -> Iterator[Running]:
    running = start_worker(backend, replace(GATEWAY, api_key=KEY))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def worker_client(worker: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def get_state(url: str) -> WorkerState:
    r = httpx.get(f"{url}/internal/v1/state", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=WorkerState)


def get_blocks(url: str, since: int, epoch: str | None) -> BlockEvents:
    params: dict[str, Any] = {"since": since} if epoch is None else {"since": since, "epoch": epoch}
    r = httpx.get(f"{url}/internal/v1/blocks", params=params, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == MSGPACK
    return msgspec.msgpack.decode(r.content, type=BlockEvents)


def long_messages() -> list[dict[str, Any]]:
    """A user message of about 200 tokens that starts with a fresh nonce: no block of it is cached."""
    text = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(20))
    return [{"role": "user", "content": f"[{uuid.uuid4().hex}] Remember this list. {text} Which is item 7?"}]


def chained_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """What a gateway computes for a prompt: the engine's chained hash of each full block."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


def test_state_reports_the_engines_figures(worker: Running, backend: InProcessBackend) -> None:
    wait_idle(backend, backend.stats().num_blocks)
    core = backend.engine.core
    state = get_state(worker.url)
    assert (state.model, state.hash_scheme, state.draining) == (MODEL, HASH_SCHEME, False)
    assert state.block_size == core.kv_plan.block_size == 16
    assert state.epoch == core.block_events.epoch
    assert state.next_event == core.block_events.next_event
    load = state.load
    assert (load.running, load.waiting, load.max_num_seqs, load.kv_usage) == (0, 0, ENGINE.max_num_seqs, 0.0)


def test_state_counts_a_running_request(
    worker: Running, worker_client: openai.OpenAI, backend: InProcessBackend
) -> None:
    stream = worker_client.chat.completions.create(
        model=MODEL, messages=long_messages(), max_tokens=200, stream=True
    )
    try:
        next(iter(stream))  # the first chunk: the request is admitted and decoding
        load = get_state(worker.url).load
        assert load.running == 1 and load.waiting == 0
        assert 0.0 < load.kv_usage < 1.0
    finally:
        stream.close()
    wait_idle(backend, backend.stats().num_blocks)


def test_blocks_after_a_chat_are_the_prompts_chained_block_hashes(
    worker: Running, worker_client: openai.OpenAI, backend: InProcessBackend
) -> None:
    # what a routing gateway knows before: every held block (a reset), and the cursor after them
    before = get_blocks(worker.url, 0, None)
    block_size = get_state(worker.url).block_size
    messages = long_messages()
    reply = worker_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    ids = backend.encode_chat(messages).token_ids
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids) >= 180
    # With max_tokens=1 the engine computes the prompt and nothing else (the one sampled token is
    # never fed back), and registers each block once it is fully computed: all len(ids) // 16 full
    # prompt blocks, the one holding the last prompt token too when it is full (only a lookup leaves
    # that token out). The leading blocks (the chat template's system prompt) were held already.
    expected = chained_hashes(ids, block_size)
    assert len(expected) == len(ids) // block_size
    events = get_blocks(worker.url, before.next_event, before.epoch)
    assert (events.reset, events.epoch) == (False, before.epoch)
    assert events.stored == [h for h in expected if h not in set(before.stored)]
    assert len(events.stored) >= len(expected) - 1  # the nonce sits in the first block or the second
    assert not set(events.evicted) & set(expected)
    assert events.next_event == get_state(worker.url).next_event

    # the cursor then says nothing new
    later = get_blocks(worker.url, events.next_event, before.epoch)
    assert (later.reset, later.stored, later.evicted) == (False, [], [])

    # the same prompt again is served from those blocks and stores none anew
    again = worker_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    hit_blocks = (len(ids) - 1) // block_size  # at least one token is always computed
    assert again.usage.prompt_tokens_details.cached_tokens == hit_blocks * block_size
    assert get_blocks(worker.url, events.next_event, before.epoch).stored == []


def test_another_epoch_or_none_gets_every_held_block(worker: Running, backend: InProcessBackend) -> None:
    wait_idle(backend, backend.stats().num_blocks)  # the engine thread is idle: `cached` holds still
    held = set(backend.engine.core.pool.cached)
    assert held  # the tests above left blocks in the prefix cache
    state = get_state(worker.url)
    for epoch in ("an-earlier-worker", None):
        events = get_blocks(worker.url, state.next_event, epoch)
        assert (events.reset, events.epoch, events.next_event) == (True, state.epoch, state.next_event)
        assert set(events.stored) == held and len(events.stored) == len(held)
        assert events.evicted == []


def test_a_cursor_that_is_not_a_number_is_a_400(worker: Running) -> None:
    r = httpx.get(f"{worker.url}/internal/v1/blocks", params={"since": "soon"}, headers=AUTH, timeout=10)
    assert r.status_code == 400


def test_openai_routes_answer_on_the_worker_and_the_batch_api_is_absent(
    worker: Running, worker_client: openai.OpenAI
) -> None:
    assert [m.id for m in worker_client.models.list().data] == [MODEL]
    reply = worker_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    assert reply.choices[0].message.content
    assert httpx.get(f"{worker.url}/ready", timeout=10).status_code == 200
    assert httpx.get(f"{worker.url}/v1/batches", headers=AUTH, timeout=10).status_code == 404


def test_internal_routes_are_never_open(backend: InProcessBackend, worker: Running) -> None:
    """Before: workers ran without a key and /internal (prefix-cache hashes) was open to anyone."""
    with pytest.raises(CtxfuseError, match="a worker needs a credential"):
        start_worker(backend, GATEWAY)  # no key: refused at start
    for path in ("/internal/v1/state", "/internal/v1/blocks", "/v1/models"):
        assert httpx.get(f"{worker.url}{path}", timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.get(f"{worker.url}{path}", headers=wrong, timeout=10).status_code == 401
    assert httpx.get(f"{worker.url}/internal/v1/state", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{worker.url}/internal/v1/blocks", headers=AUTH, timeout=10).status_code == 200


def test_internal_routes_are_absent_on_a_plain_gateway(served: Served) -> None:
    for path in ("/internal/v1/state", "/internal/v1/blocks"):
        assert httpx.get(f"{served.url}{path}", timeout=10).status_code == 404
