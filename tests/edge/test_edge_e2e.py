"""The edge link end to end on loopback with real TLS and the real model: an OpenAI client talks to
the agent, the agent to the gateway's mutual-TLS listener. A long document asked many questions
uploads once; prompts arrive byte-identical; a chunk the gateway lost comes back through the 409
path; a restart keeps the chunk store; streaming works; revoked devices and a dead link give the
app a clean 503."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import uvicorn

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from edge.agent import Agent
from edge.config import EdgeConfig
from edge.server import agent_uvicorn_config
from gateway.backends.local import EngineUpstream, engine_gateway
from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from gateway.edge.server import build_edge_server
from gateway.state import Gateway
from shared.certs import init_ca, issue_device, issue_server, revoke_device

MODEL = "smollm2-135m-instruct"
ENGINE = EngineConfig(
    served_model_name=MODEL,
    dtype="float32",
    weight_quant="none",
    kv_cache_memory_gib=0.5,
    max_model_len=2048,
    context_overflow="truncate_middle",  # a 16K-token document still gets an answer here
)
WORDS = ["contract", "clause", "party", "shall", "notice", "Übergabe", "価格", "término", "🙂", "section"]


def document(seed: int, tokens: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens // 2))  # about two tokens a word


def start(server: uvicorn.Server, name: str) -> int:
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.02)
    return int(server.servers[0].sockets[0].getsockname()[1])


@dataclass
class Link:
    tls: Path
    gateway: Gateway
    gateway_url: str
    agent: Agent
    agent_url: str
    store_path: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.agent_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tls = tmp_path_factory.mktemp("tls")
    init_ca(tls)
    issue_server(tls, ["127.0.0.1", "localhost"])
    for name in ("dev1", "dev2"):
        issue_device(tls, name)
    return tls


def agent_for(tls: Path, gateway_url: str, name: str, state: Path) -> tuple[Agent, uvicorn.Server, str]:
    config = EdgeConfig(gateway_url=gateway_url, tls_dir=tls, name=name, port=0, state_dir=state)
    agent = Agent(config)
    server = uvicorn.Server(agent_uvicorn_config(agent, "127.0.0.1", 0))
    port = start(server, f"agent-{name}")
    return agent, server, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def link(loaded_model: LoadedModel, pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Link]:
    state = tmp_path_factory.mktemp("state")
    backend = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    store_path = state / "chunks.sqlite"
    config = GatewayConfig(port=0, edge_host="127.0.0.1", edge_port=0, tls_dir=pki, data_dir=state / "gw")
    gateway = engine_gateway(backend, config, ChunkStore(store_path, 256 * 2**20))
    edge = build_edge_server(gateway)
    gateway_url = f"https://127.0.0.1:{start(edge, 'edge-listener')}"
    agent, agent_server, agent_url = agent_for(pki, gateway_url, "dev1", state / "dev1")
    yield Link(pki, gateway, gateway_url, agent, agent_url, store_path)
    agent_server.should_exit = True
    edge.should_exit = True
    backend.shutdown()


def ask(
    link: Link, doc: str, question: str, **kw: object
) -> tuple[openai.types.chat.ChatCompletion, int, int]:
    """A chat request through the agent; returns the reply, the plain JSON size and the link bytes."""
    messages = [{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]
    plain = len(
        msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0})
    )
    before = link.agent.uplink.uploaded_bytes
    reply = link.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        temperature=0,
        **kw,  # type: ignore[arg-type]
    )
    return reply, plain, link.agent.uplink.uploaded_bytes - before


def test_a_16k_token_document_asked_ten_questions_uploads_once(link: Link) -> None:
    doc = document(1, 16_384)
    sent = []
    for i in range(10):
        reply, plain, link_bytes = ask(link, doc, f"What does clause {i} say?")
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert (
            reply.usage is not None and reply.usage.prompt_tokens_details.model_extra["truncated_tokens"] > 0
        )
        sent.append((plain, link_bytes))
    first_plain, first = sent[0]
    assert first < first_plain  # even the first is compressed
    for plain, later in sent[1:]:
        assert later < 0.05 * plain, sent  # the document travels by reference only


def test_the_prompt_the_engine_sees_is_byte_identical(link: Link) -> None:
    prompt = document(2, 3000) + " \u00e9\u0301 \r\n\t tab\u2028 ☃ 𝄞 end"
    r = link.client().completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt)


def test_streaming_works_through_the_agent(link: Link) -> None:
    doc = document(3, 4000)
    chunks = list(
        link.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": doc + "\nSummarise."}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_chunk_the_gateway_lost_comes_back_through_the_409_path(link: Link, tmp_path: Path) -> None:
    doc = document(4, 6000)
    _, _, first = ask(link, doc, "Who are the parties?")
    old = link.gateway.chunk_store
    link.gateway.chunk_store = ChunkStore(tmp_path / "empty.sqlite", 2**20 * 64)  # it lost everything
    try:
        reply, _, again = ask(link, doc, "Who are the parties?")
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert again > first * 0.8  # the agent believed the chunks held, was told otherwise, sent them
    finally:
        link.gateway.chunk_store.close()
        link.gateway.chunk_store = old


def test_a_gateway_restart_keeps_the_chunk_store(link: Link) -> None:
    doc = document(5, 6000)
    _, plain, first = ask(link, doc, "When is notice due?")
    assert link.gateway.chunk_store is not None
    link.gateway.chunk_store.close()
    link.gateway.chunk_store = ChunkStore(link.store_path, 256 * 2**20)  # as a restarted gateway opens it
    _, _, after = ask(link, doc, "When is notice due?")
    assert after < 0.05 * plain < first


def test_the_gateway_knows_which_device_sent_what(link: Link) -> None:
    ask(link, "hello " * 10, "Hi?")
    metrics = link.gateway.metrics.render().decode()
    assert 'ctxfuse_edge_received_bytes_total{device="dev1"}' in metrics
    agent_metrics = httpx.get(f"{link.agent_url}/metrics", timeout=10).text
    assert (
        "ctxfuse_edge_request_bytes_total" in agent_metrics
        and "ctxfuse_edge_upload_bytes_total" in agent_metrics
    )


def test_models_are_listed_through_the_agent(link: Link) -> None:
    assert [m.id for m in link.client().models.list()] == [MODEL]


def test_a_revoked_device_gets_a_503_with_retry_after(link: Link, tmp_path: Path) -> None:
    revoke_device(link.tls, "dev2")
    _, server, url = agent_for(link.tls, link.gateway_url, "dev2", tmp_path)
    try:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "gateway_unreachable"
    finally:
        server.should_exit = True


def test_an_unreachable_gateway_gives_the_app_a_503(link: Link, tmp_path: Path) -> None:
    _, server, url = agent_for(link.tls, "https://127.0.0.1:9", "dev1", tmp_path)
    try:
        with pytest.raises(openai.InternalServerError) as err:
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"]
    finally:
        server.should_exit = True


def test_bad_json_from_an_app_is_a_400(link: Link) -> None:
    r = httpx.post(
        f"{link.agent_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},  # any other type is a 415 (local_guard.py)
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_edge_route_is_not_served_on_the_plain_port(link: Link, tmp_path: Path) -> None:
    from gateway.server import build_server

    config = GatewayConfig(port=0, data_dir=tmp_path / "gw")
    upstream = link.gateway.upstream
    assert isinstance(upstream, EngineUpstream)
    server = build_server(upstream.backend, config, announce=False)
    port = start(server, "plain")
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/edge/v1/request", content=b"\x80", timeout=10)
        assert r.status_code == 404
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
    finally:
        server.should_exit = True
