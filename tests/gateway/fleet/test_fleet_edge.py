"""The edge listener of a routing gateway: a real agent (mutual TLS, real certificates) talks to a
fleet gateway in front of stub OpenAI servers. The app's prompt reaches a backend byte for byte, a
document asked twice crosses the link once, streams and the model list work, and a batch from the
agent's outbox runs on the fleet."""

from __future__ import annotations

import random
import string
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import openai
import pytest
import uvicorn

from edge.agent import Agent
from edge.config import EdgeConfig
from edge.server import agent_uvicorn_config
from gateway.backends.fleet.serve import build_fleet_server
from gateway.config import GatewayConfig
from gateway.edge.server import build_edge_server
from gateway.server import serve_together
from shared.certs import init_ca, issue_device, issue_server

from ..batches import chat_line, lines_of, start, wait
from ..conftest import MODEL
from .openai_stub import StubServer
from .stub_fleet import fleet_of

_RNG = random.Random(7)
# ~20 KB of made-up words that zstd cannot shrink much, and a few non-ASCII ones to be put back exactly
DOC = " ".join(
    ["Übergabe", "価格", *("".join(_RNG.choices(string.ascii_lowercase, k=6)) for _ in range(3000))]
)


@dataclass
class EdgeFleet:
    agent: Agent
    agent_url: str
    stubs: tuple[StubServer, StubServer]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.agent_url}/v1", api_key="unused", max_retries=0, timeout=30)


def _wait_started(*servers: uvicorn.Server) -> None:
    deadline = time.monotonic() + 30
    while not all(s.started for s in servers):
        assert time.monotonic() < deadline, "a server did not start"
        time.sleep(0.02)


@pytest.fixture()
def edge_fleet(stubs: tuple[StubServer, StubServer], tmp_path: Path) -> Iterator[EdgeFleet]:
    tls = tmp_path / "tls"
    init_ca(tls)
    issue_server(tls, ["127.0.0.1"])
    issue_device(tls, "dev1")
    config = GatewayConfig(port=0, edge_host="127.0.0.1", edge_port=0, tls_dir=tls, data_dir=tmp_path / "gw")
    config = replace(config, chunk_store=tmp_path / "chunks.sqlite", chunk_store_mib=64)
    server, _ = build_fleet_server(fleet_of(*stubs), config, rng=random.Random(0))
    store = server.gateway.chunk_store
    assert store is not None
    edge = build_edge_server(server.gateway)
    server.companions.append(edge)
    thread = threading.Thread(target=serve_together, args=(server, edge), daemon=True, name="fleet+edge")
    thread.start()
    _wait_started(server, edge)
    edge_port = int(edge.servers[0].sockets[0].getsockname()[1])
    agent_config = EdgeConfig(
        gateway_url=f"https://127.0.0.1:{edge_port}",
        tls_dir=tls,
        name="dev1",
        port=0,
        state_dir=tmp_path / "dev1",
    )
    agent = Agent(agent_config)
    agent_server = uvicorn.Server(agent_uvicorn_config(agent, "127.0.0.1", 0))
    agent_thread = threading.Thread(target=agent_server.run, daemon=True, name="agent")
    agent_thread.start()
    _wait_started(agent_server)
    agent_port = int(agent_server.servers[0].sockets[0].getsockname()[1])
    yield EdgeFleet(agent, f"http://127.0.0.1:{agent_port}", stubs)
    agent_server.should_exit = True
    agent_thread.join(timeout=15)
    server.should_exit = edge.should_exit = True
    thread.join(timeout=15)
    store.close()


def test_a_device_reaches_the_fleet_through_the_edge_listener(edge_fleet: EdgeFleet) -> None:
    client = edge_fleet.client()
    first = edge_fleet.agent.uplink.uploaded_bytes
    reply = client.chat.completions.create(
        model="stub", messages=[{"role": "user", "content": f"{DOC}\nWho pays?"}]
    )
    assert reply.choices[0].message.content in ("a", "b")
    once = edge_fleet.agent.uplink.uploaded_bytes - first
    seen = [body for s in edge_fleet.stubs for body in s.behaviour.seen]
    assert seen[-1]["messages"][0]["content"] == f"{DOC}\nWho pays?"  # byte for byte
    again = client.chat.completions.create(
        model="stub", messages=[{"role": "user", "content": f"{DOC}\nWhen?"}]
    )
    twice = edge_fleet.agent.uplink.uploaded_bytes - first - once
    assert again.choices[0].message.content == reply.choices[0].message.content  # the document's backend
    assert twice < once / 4  # the document crossed the link once
    streamed = client.chat.completions.create(
        model="stub", messages=[{"role": "user", "content": f"{DOC}\nStream it."}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) in ("a", "b")
    assert [m.id for m in client.models.list().data] == ["stub", MODEL]  # the listing of a backend


def test_a_batch_from_the_agent_runs_on_the_fleet(edge_fleet: EdgeFleet) -> None:
    client = edge_fleet.client()
    batch = start(client, [chat_line(f"q{i}", f"Question {i}") for i in range(3)])  # type: ignore[arg-type]
    done = wait(client, batch.id, timeout=60)  # type: ignore[arg-type]
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 3
    out = lines_of(client, done.output_file_id)  # type: ignore[arg-type]
    assert {x["response"]["body"]["choices"][0]["message"]["content"] for x in out} <= {"a", "b"}
