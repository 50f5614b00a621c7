"""An edge request is held, as it expands, to the body limit a plain request meets on the OpenAI port.

Real parts on loopback: the gateway's edge listener over mutual TLS with a device certificate from
our CA, its SQLite chunk store, the real model; hostile requests are built by hand as a device could
send them, the legitimate one goes through the real agent with the official `openai` client.
`ChunkStore.bytes_read` counts the chunk bytes the gateway materialized: a refused bomb reads none.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import openai
import pytest
import uvicorn

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from edge.agent import Agent
from edge.config import EdgeConfig
from edge.encode import chunk_strings
from edge.server import agent_uvicorn_config
from gateway.backends.local import engine_gateway
from gateway.config import GatewayConfig
from gateway.edge.budget import max_refs
from gateway.edge.chunk_store import ChunkStore
from gateway.edge.server import build_edge_server
from shared.certs import init_ca, issue_device, issue_server
from shared.chunking import digest
from shared.compression import compress
from shared.edge_protocol import EdgeRequest, text_ref
from shared.tls import client_context
from tests.edge.test_edge_e2e import ENGINE, MODEL, start  # truncate_middle: a body-limit request is answered
from tests.gateway.edge_rig import send_edge_request

LIMIT = 2**20  # the gateway's max_body_bytes here: 1 MiB
BIG = 64 * 1024  # the largest chunk the gateway takes (gateway/edge/link.py MAX_CHUNK_BYTES)


@dataclass
class Edge:
    store: ChunkStore
    url: str  # the edge listener, https
    device: httpx.Client  # mutual TLS with dev1's certificate
    agent_url: str

    def post(self, req: EdgeRequest) -> httpx.Response:
        return send_edge_request(self.device, self.url, req)


@pytest.fixture(scope="module")
def edge(loaded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    tls = tmp_path_factory.mktemp("tls")
    init_ca(tls)
    issue_server(tls, ["127.0.0.1", "localhost"])
    issue_device(tls, "dev1")
    state = tmp_path_factory.mktemp("state")
    backend = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    config = GatewayConfig(
        port=0, edge_host="127.0.0.1", edge_port=0, tls_dir=tls, data_dir=state / "gw", max_body_bytes=LIMIT
    )
    store = ChunkStore(state / "chunks.sqlite", 64 * 2**20)
    listener = build_edge_server(engine_gateway(backend, config, store))
    url = f"https://127.0.0.1:{start(listener, 'edge-listener')}"
    agent_config = EdgeConfig(gateway_url=url, tls_dir=tls, name="dev1", port=0, state_dir=state / "dev1")
    agent = uvicorn.Server(agent_uvicorn_config(Agent(agent_config), "127.0.0.1", 0))
    agent_url = f"http://127.0.0.1:{start(agent, 'agent-dev1')}"
    device = httpx.Client(verify=client_context(tls, "dev1"), timeout=120)
    yield Edge(store, url, device, agent_url)
    device.close()
    agent.should_exit = True
    listener.should_exit = True
    backend.shutdown()


def refused_as_too_large(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 413, resp.text[:300]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "too_large")
    assert f"limit of {LIMIT} bytes" in error["message"]
    return dict(error)


def test_the_68_kib_bomb_is_refused_before_any_chunk_is_read(edge: Edge) -> None:
    # the issue's bomb: one 64 KiB chunk named 2,048 times, 68 KiB on the wire, 128 MiB expanded
    chunk = b"a" * BIG
    d = digest(chunk)
    bomb = EdgeRequest(
        endpoint="completions",
        body={"model": MODEL, "prompt": text_ref(0), "max_tokens": 1},
        texts=[[d] * 2048],
        chunks={d: compress(chunk)},
    )
    wire = len(msgspec.msgpack.encode(bomb))
    assert wire < 70 * 1024 and max_refs(LIMIT) >= 2048  # small, and not caught by the reference cap
    read = edge.store.bytes_read
    error = refused_as_too_large(edge.post(bomb))
    assert "expanded size" in error["message"]
    # counted by stored size: a chunk named N times is N x 64 KiB, and nothing was materialized
    assert edge.store.bytes_read == read


def test_a_text_put_many_times_in_the_body_counts_each_time(edge: Edge) -> None:
    rng = random.Random(7)
    pieces = [bytes(rng.choice(b"abcdefgh ") for _ in range(8192)) for _ in range(8)]  # a 64 KiB text
    body = {"model": MODEL, "messages": [{"role": "user", "content": text_ref(0)}] * 100}  # 6.4 MiB
    req = EdgeRequest(
        endpoint="chat.completions",
        body=body,
        texts=[[digest(p) for p in pieces]],
        chunks={digest(p): compress(p) for p in pieces},
    )
    read = edge.store.bytes_read
    assert "expanded size" in refused_as_too_large(edge.post(req))["message"]
    assert edge.store.bytes_read == read


def test_carried_chunks_are_bounded_as_they_are_decompressed(edge: Edge) -> None:
    # 20 distinct 64 KiB chunks that compress to a few dozen bytes each: 1.25 MiB decompressed
    chunks = [i.to_bytes(4, "big") + b"b" * (BIG - 4) for i in range(20)]
    names = [digest(c) for c in chunks]
    req = EdgeRequest(
        endpoint="completions",
        body={"model": MODEL, "prompt": text_ref(0), "max_tokens": 1},
        texts=[names],
        chunks={d: compress(c) for d, c in zip(names, chunks, strict=True)},
    )
    count = edge.store.count
    assert "carries" in refused_as_too_large(edge.post(req))["message"]
    assert edge.store.count == count  # none of them was stored


def test_more_references_than_the_limit_allows_get_no_answer_about_any(edge: Edge) -> None:
    # unknown digests, one past the cap: no lookup, and no 409 telling which the gateway holds
    unknown = [os.urandom(32) for _ in range(max_refs(LIMIT) + 1)]
    req = EdgeRequest(
        endpoint="completions", body={"model": MODEL, "prompt": text_ref(0), "max_tokens": 1}, texts=[unknown]
    )
    hits, misses = edge.store.hits, edge.store.misses
    resp = edge.post(req)
    refused_as_too_large(resp)
    assert "missing" not in resp.json()
    assert (edge.store.hits, edge.store.misses) == (hits, misses)


def test_a_chunk_not_named_by_the_request_is_not_stored(edge: Edge) -> None:
    stray = b"stray chunk " * 100
    req = EdgeRequest(
        endpoint="completions",
        body={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        texts=[],
        chunks={digest(stray): compress(stray)},
    )
    resp = edge.post(req)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chunks"
    assert edge.store.sizes([digest(stray)], tenant="device:dev1") == {}


def deduplicated_body(size: int) -> dict[str, Any]:
    """A chat body of exactly `size` JSON bytes whose document repeats one block (so its chunks repeat)."""
    rng = random.Random(11)
    block = " ".join(rng.choice(["clause", "party", "notice", "Übergabe", "価格"]) for _ in range(6000))
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": ""}], "max_tokens": 1}
    room = size - len(msgspec.json.encode(body))
    doc = (block * (room // len(block.encode()) + 1)).encode()[:room].decode("utf-8", "ignore")
    doc += "x" * (room - len(doc.encode()))
    body["messages"][0]["content"] = doc
    assert len(msgspec.json.encode(body)) == size
    return body


def ask(edge: Edge, body: dict[str, Any]) -> Any:
    client = openai.OpenAI(base_url=f"{edge.agent_url}/v1", api_key="unused", max_retries=0, timeout=300)
    return client.chat.completions.create(**body)


def test_a_deduplicated_request_at_the_limit_is_served_and_one_byte_more_is_refused(edge: Edge) -> None:
    body = deduplicated_body(LIMIT)
    names = chunk_strings("chat.completions", body, 2048).request.texts[0]  # as the agent names them
    assert len(set(names)) < len(names) / 4  # the same chunks, named many times over
    read = edge.store.bytes_read
    reply = ask(edge, body)
    assert reply.choices[0].finish_reason in ("stop", "length")
    # each distinct chunk read once: what a plain request of this size would hold, not more
    assert 0 < edge.store.bytes_read - read <= LIMIT
    with pytest.raises(openai.APIStatusError) as refused:
        ask(edge, deduplicated_body(LIMIT + 1))
    assert refused.value.status_code == 413
    assert "expanded size" in refused.value.message
