"""The agent's batch outbox end to end on loopback, with real TLS and the real model: a batch accepted
while the gateway is down runs once it is back, exactly once, also across an agent restart; an
app's idempotent retry answers the first object; a full outbox refuses; backoff is capped and
jittered; cancel and list work as on the gateway; one agent per state dir."""

from __future__ import annotations

import json
import os
import random
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from edge.agent import Agent
from edge.config import EdgeConfig
from edge.forwarder import backoff_delay
from edge.outbox import Outbox
from edge.server import agent_uvicorn_config
from gateway.backends.local import engine_gateway
from gateway.config import GatewayConfig
from gateway.edge.server import build_edge_server
from shared.certs import init_ca, issue_device, issue_server
from shared.dir_lock import DirInUse

from .test_edge_e2e import ENGINE, MODEL, start

FAST = {"retry_base_s": 0.05, "retry_cap_s": 0.3, "poll_s": 0.05, "poll_max_s": 0.3, "connect_timeout_s": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tls = tmp_path_factory.mktemp("tls")
    init_ca(tls)
    issue_server(tls, ["127.0.0.1", "localhost"])
    issue_device(tls, "dev1")
    return tls


@pytest.fixture(scope="module")
def backend(loaded_model: LoadedModel) -> Iterator[InProcessBackend]:
    b = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    yield b
    b.shutdown()


@dataclass
class Cloud:
    """A gateway's edge listener at a fixed port, started when a test says so."""

    backend: InProcessBackend
    tls: Path
    data: Path
    port: int
    server: uvicorn.Server | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def up(self) -> None:
        config = GatewayConfig(
            port=0, edge_host="127.0.0.1", edge_port=self.port, tls_dir=self.tls, data_dir=self.data
        )
        self.server = build_edge_server(engine_gateway(self.backend, config))
        self.server.announce = False
        start(self.server, f"edge-listener-{self.port}")

    def down(self) -> None:
        """Stop the listener and wait for it (its batch runner lets go of the data dir)."""
        if self.server is not None:
            self.server.should_exit = True
            for thread in threading.enumerate():
                if thread.name == f"edge-listener-{self.port}":
                    thread.join(30)
            self.server = None

    def batches_run(self) -> int:
        """How many batches the gateway ever made (each is run once)."""
        with sqlite3.connect(self.data / "batches.sqlite") as db:
            return int(db.execute("SELECT COUNT(*) FROM batches").fetchone()[0])

    def statuses(self) -> list[str]:
        with sqlite3.connect(self.data / "batches.sqlite") as db:
            return [str(r[0]) for r in db.execute("SELECT status FROM batches ORDER BY seq")]


@pytest.fixture
def cloud(backend: InProcessBackend, pki: Path, tmp_path: Path) -> Iterator[Cloud]:
    c = Cloud(backend, pki, tmp_path / "gateway", free_port())
    yield c
    c.down()


@dataclass
class Device:
    agent: Agent
    server: uvicorn.Server
    url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)

    def stop(self) -> None:
        """As the agent's process ends: its lifespan stops the forwarder and closes the outbox."""
        self.server.should_exit = True
        for thread in threading.enumerate():
            if thread.name == f"agent-{id(self.agent)}":
                thread.join(10)


def device(cloud: Cloud, state: Path, **options: object) -> Device:
    config = EdgeConfig(
        gateway_url=cloud.url,
        tls_dir=cloud.tls,
        name="dev1",
        port=0,
        state_dir=state,
        **{**FAST, **options},  # type: ignore[arg-type]
    )
    agent = Agent(config)
    server = uvicorn.Server(agent_uvicorn_config(agent, "127.0.0.1", 0))
    return Device(agent, server, f"http://127.0.0.1:{start(server, f'agent-{id(agent)}')}")


def batch_input(n: int, max_tokens: int = 2) -> bytes:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Say {i}"}],
                "max_tokens": max_tokens,
            },
        }
        for i in range(n)
    ]
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def submit(dev: Device, n: int, max_tokens: int = 2) -> str:
    client = dev.client()
    f = client.files.create(file=("in.jsonl", batch_input(n, max_tokens)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "validating" and b.input_file_id == f.id
    return b.id


def wait_forwarded(dev: Device, batch_id: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not forwarded(dev, batch_id):
        assert time.monotonic() < deadline, f"batch {batch_id} was not forwarded"
        time.sleep(0.02)


def forwarded(dev: Device, batch_id: str) -> bool:
    """The gateway holds the batch (or it has finished): past the outbox's upload steps."""
    states = {p.batch_id: p.state for p in dev.agent.outbox.pending()}
    return states.get(batch_id, "completed") in ("batch_created", "completed")


def wait_done(dev: Device, batch_id: str, timeout_s: float = 40) -> openai.types.Batch:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b = dev.client().batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} did not finish")


def custom_ids(dev: Device, b: openai.types.Batch) -> list[str]:
    assert b.status == "completed" and b.output_file_id is not None, b
    text = dev.client().files.content(b.output_file_id).text
    return sorted(json.loads(line)["custom_id"] for line in text.splitlines() if line)


def test_a_batch_accepted_while_the_gateway_is_down_runs_once_it_is_back(
    cloud: Cloud, tmp_path: Path
) -> None:
    dev = device(cloud, tmp_path / "dev")
    try:
        batch_id = submit(dev, 3)
        time.sleep(0.5)  # the forwarder meets a dead link a few times
        assert dev.client().batches.retrieve(batch_id).status == "validating"
        cloud.up()
        done = wait_done(dev, batch_id)
        assert custom_ids(dev, done) == ["req-0", "req-1", "req-2"]
        assert done.request_counts is not None and done.request_counts.completed == 3
        assert cloud.batches_run() == 1
    finally:
        dev.stop()


def test_an_agent_restart_before_completion_still_runs_the_batch_exactly_once(
    cloud: Cloud, tmp_path: Path
) -> None:
    first = device(cloud, tmp_path / "dev")
    batch_id = submit(first, 2)
    first.stop()  # accepted, never forwarded
    cloud.up()
    second = device(cloud, tmp_path / "dev")  # a new agent over the same state
    try:
        done = wait_done(second, batch_id)
        assert custom_ids(second, done) == ["req-0", "req-1"]
        third_id = submit(second, 1)
        wait_forwarded(second, third_id)
    finally:
        second.stop()  # forwarded, not yet fetched
    third = device(cloud, tmp_path / "dev")
    try:
        assert custom_ids(third, wait_done(third, third_id)) == ["req-0"]
        assert cloud.batches_run() == 2
    finally:
        third.stop()


def test_an_idempotent_retry_answers_the_first_object(cloud: Cloud, tmp_path: Path) -> None:
    dev = device(cloud, tmp_path / "dev")
    try:
        files = [
            httpx.post(
                f"{dev.url}/v1/files",
                files={"file": ("in.jsonl", batch_input(1))},
                data={"purpose": "batch"},
                headers={"Idempotency-Key": "f-1"},
                timeout=10,
            ).json()
            for _ in range(2)
        ]
        assert files[0] == files[1]
        body = {
            "input_file_id": files[0]["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        made = [
            httpx.post(f"{dev.url}/v1/batches", json=body, headers={"Idempotency-Key": "b-1"}, timeout=10)
            for _ in range(2)
        ]
        assert made[0].json() == made[1].json()
        other = {**body, "metadata": {"x": "y"}}
        again = httpx.post(
            f"{dev.url}/v1/batches", json=other, headers={"Idempotency-Key": "b-1"}, timeout=10
        )
        assert again.status_code == 422 and again.json()["error"]["code"] == "idempotency_key_reused"
        assert len(dev.agent.outbox.pending()) == 1
    finally:
        dev.stop()


def test_a_full_outbox_refuses_new_files(cloud: Cloud, tmp_path: Path) -> None:
    data = batch_input(2)
    dev = device(cloud, tmp_path / "dev", outbox_max_bytes=len(data) * 2 + 10)
    try:
        client = dev.client()
        for _ in range(2):
            client.files.create(file=("in.jsonl", data), purpose="batch")
        with pytest.raises(openai.RateLimitError) as err:
            client.files.create(file=("in.jsonl", data), purpose="batch")
        assert err.value.status_code == 429 and err.value.code == "outbox_full"
    finally:
        dev.stop()


def test_a_full_outbox_can_drop_the_oldest_instead(cloud: Cloud, tmp_path: Path) -> None:
    data = batch_input(2)
    dev = device(
        cloud, tmp_path / "dev", outbox_max_bytes=len(data) * 2 + 10, outbox_full_policy="drop_oldest"
    )
    try:
        client = dev.client()
        ids = [client.files.create(file=("in.jsonl", data), purpose="batch").id for _ in range(3)]
        assert dev.agent.outbox.get_file(ids[0]) is None
        assert all(dev.agent.outbox.get_file(i) is not None for i in ids[1:])
        assert dev.agent.outbox.used_bytes() <= dev.agent.config.outbox_max_bytes
    finally:
        dev.stop()


def test_backoff_doubles_with_full_jitter_up_to_the_cap() -> None:
    rng = random.Random(7)
    for failures in range(40):
        ceiling = min(300.0, 1.0 * 2**failures)
        delays = [backoff_delay(failures, 1.0, 300.0, rng) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert max(delays) > 0.8 * ceiling and min(delays) < 0.2 * ceiling  # spread over the whole range
    assert backoff_delay(10_000, 1.0, 300.0, rng) <= 300.0


def test_a_batch_not_yet_forwarded_is_cancelled_here_at_once(cloud: Cloud, tmp_path: Path) -> None:
    dev = device(cloud, tmp_path / "dev")
    try:
        client = dev.client()
        batch_id = submit(dev, 2)
        cancelled = client.batches.cancel(batch_id)
        assert cancelled.status == "cancelled" and cancelled.cancelled_at and cancelled.cancelling_at
        assert client.batches.cancel(batch_id).status == "cancelled"  # again: the same answer
        assert client.batches.retrieve(batch_id).status == "cancelled"
        cloud.up()
        done_id = submit(dev, 1)
        assert wait_done(dev, done_id).status == "completed"
        assert cloud.batches_run() == 1  # the cancelled batch never reached the gateway
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(done_id)
        with pytest.raises(openai.NotFoundError):
            client.batches.cancel("batch_nope")
    finally:
        dev.stop()


def test_a_forwarded_batch_is_cancelled_on_the_gateway(cloud: Cloud, tmp_path: Path) -> None:
    cloud.up()
    dev = device(cloud, tmp_path / "dev")
    try:
        batch_id = submit(dev, 8, max_tokens=48)
        wait_forwarded(dev, batch_id)
        assert dev.client().batches.cancel(batch_id).status == "cancelling"
        done = wait_done(dev, batch_id)
        assert done.status == "cancelled" and done.cancelled_at and done.request_counts is not None
        assert done.request_counts.completed < 8
        assert cloud.statuses() == ["cancelled"]
    finally:
        dev.stop()


def test_batches_and_files_list_newest_first_with_a_cursor(cloud: Cloud, tmp_path: Path) -> None:
    dev = device(cloud, tmp_path / "dev")  # the gateway stays down: lists are the outbox's own
    try:
        client = dev.client()
        ids = [submit(dev, 1) for _ in range(3)]
        page = client.batches.list(limit=2)
        assert [b.id for b in page.data] == [ids[2], ids[1]] and page.has_more
        rest = client.batches.list(limit=2, after=ids[1])
        assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
        inputs = [client.batches.retrieve(i).input_file_id for i in ids]
        assert [f.id for f in client.files.list(purpose="batch").data] == inputs[::-1]
        with pytest.raises(openai.ConflictError):  # the forwarder still needs it
            client.files.delete(inputs[0])
        spare = client.files.create(file=("spare.jsonl", batch_input(1)), purpose="batch").id
        assert client.files.delete(spare).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(spare)
    finally:
        dev.stop()


def test_an_accepted_batch_is_on_disk_before_it_is_acknowledged(tmp_path: Path) -> None:
    # synchronous=FULL (2) in WAL: a file or batch the app was told about survives power loss
    outbox = Outbox(tmp_path / "dev" / "outbox.sqlite", 2**20, "refuse")
    assert outbox._db.execute("PRAGMA synchronous").fetchone() == (2,)
    assert outbox._db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    outbox.close()


def test_a_second_agent_on_one_state_dir_refuses_to_start(cloud: Cloud, tmp_path: Path) -> None:
    state = tmp_path / "dev"
    dev = device(cloud, state)
    try:
        with pytest.raises(DirInUse) as err:
            Agent(dev.agent.config)
        assert str(state) in err.value.message and str(os.getpid()) in err.value.message
    finally:
        dev.stop()
    Outbox(state / "outbox.sqlite", 2**20, "refuse").close()  # free once the first has stopped


def test_a_cancel_made_while_the_link_is_down_reaches_the_gateway_when_it_is_back(
    cloud: Cloud, tmp_path: Path
) -> None:
    cloud.up()
    dev = device(cloud, tmp_path / "dev")
    try:
        batch_id = submit(dev, 8, max_tokens=48)
        wait_forwarded(dev, batch_id)
        cloud.down()
        assert dev.client().batches.cancel(batch_id).status == "cancelling"  # recorded here
        time.sleep(0.5)  # the forwarder meets the dead link
        assert dev.client().batches.retrieve(batch_id).status == "cancelling"
        assert cloud.statuses() in (["validating"], ["in_progress"])  # the gateway has not heard
        cloud.up()
        done = wait_done(dev, batch_id)
        assert done.status == "cancelled" and cloud.statuses() == ["cancelled"]
    finally:
        dev.stop()
