"""kill -9 of the real agent process (`ctxfuse edge`) at several moments, each time restarted over the
same state dir: with the gateway down after batches were accepted, while the forwarder is
forwarding, and while results are being fetched. Every batch whose creation was answered 200 ends
completed with one result per custom_id, and the gateway (real model, real mutual TLS, in this
process) made and ran each exactly once. A second agent on a state dir in use refuses to start."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from .test_outbox import Cloud, backend, batch_input, cloud, free_port, pki

__all__ = ["backend", "cloud", "pki"]  # fixtures shared with test_outbox.py
CTXFUSE = Path(sys.executable).parent / "ctxfuse"


class AgentProcess:
    """`ctxfuse edge` as its own process, on a fixed port and state dir, killed with SIGKILL."""

    def __init__(self, cloud: Cloud, state: Path) -> None:
        self.cloud, self.state, self.port = cloud, state, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(CTXFUSE),
            "edge",
            *("--gateway", self.cloud.url, "--tls-dir", str(self.cloud.tls), "--name", "dev1"),
            *("--port", str(self.port), "--state-dir", str(self.state)),
            *("--retry-cap-s", "0.3", "--log-level", "warning"),
        ]

    def start(self) -> None:
        log = (self.state.parent / "agent.log").open("ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, "the agent exited"
            assert time.monotonic() < deadline, "the agent did not start"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def agent(cloud: Cloud, tmp_path: Path) -> Iterator[AgentProcess]:
    a = AgentProcess(cloud, tmp_path / "dev")
    yield a
    if a.proc is not None and a.proc.poll() is None:
        a.kill()


def submit(a: AgentProcess, n: int) -> str:
    """File and batch; the id counts as accepted only once both were answered 200."""
    client = a.client()
    f = client.files.create(file=("in.jsonl", batch_input(n)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    return b.id


def until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def made_on_gateway(cloud: Cloud) -> int:
    """Batches the gateway has made so far (none before its database and its tables exist)."""
    if not (cloud.data / "batches.sqlite").exists():
        return 0
    try:
        return cloud.batches_run()
    except sqlite3.OperationalError:  # the gateway is creating its tables right now
        return 0


def statuses(a: AgentProcess, ids: list[str]) -> list[str]:
    return [a.client().batches.retrieve(i).status for i in ids]


def test_kill_9_at_any_moment_loses_no_accepted_batch_and_runs_none_twice(
    cloud: Cloud, agent: AgentProcess
) -> None:
    sizes: dict[str, int] = {}
    agent.start()  # the gateway is down
    for n in (2, 1):
        sizes[submit(agent, n)] = n
    agent.kill()  # right after acceptance, the forwarder meeting a dead link

    agent.start()
    assert statuses(agent, list(sizes)) == ["validating"] * 2  # both survived
    for n in (2, 1):
        sizes[submit(agent, n)] = n
    agent.kill()

    agent.start()
    cloud.up()
    until(lambda: made_on_gateway(cloud) >= 1, 30, "nothing was forwarded")
    agent.kill()  # forwarding underway
    forwarded_at_kill = cloud.batches_run()

    agent.start()
    sizes[submit(agent, 2)] = 2  # accepted while the others are on their way
    until(lambda: "completed" in statuses(agent, list(sizes)), 60, "nothing completed")
    agent.kill()  # results being fetched (the first has them, the rest not yet)

    agent.start()
    ids = list(sizes)
    until(lambda: set(statuses(agent, ids)) == {"completed"}, 90, "not every batch completed")
    client = agent.client()
    for batch_id, n in sizes.items():
        b = client.batches.retrieve(batch_id)
        assert b.request_counts is not None and b.request_counts.completed == n and b.output_file_id
        lines = client.files.content(b.output_file_id).text.splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in lines) == [f"req-{i}" for i in range(n)]

    with sqlite3.connect(agent.state / "outbox.sqlite") as db:
        remote_of = dict(db.execute("SELECT id, remote_id FROM batches").fetchall())
    with sqlite3.connect(cloud.data / "batches.sqlite") as db:
        gateway_batches = {r[0] for r in db.execute("SELECT id FROM batches")}
        per_request = db.execute("SELECT batch_id, custom_id, COUNT(*), MIN(ok) FROM requests GROUP BY 1, 2")
        runs = {(r[0], r[1]): (r[2], r[3]) for r in per_request}
        inputs = db.execute("SELECT COUNT(*) FROM files WHERE purpose = 'batch'").fetchone()[0]
    assert 1 <= forwarded_at_kill <= len(sizes)
    assert sorted(remote_of) == sorted(ids)  # one gateway batch per accepted batch, no more
    assert gateway_batches == set(remote_of.values()) and len(gateway_batches) == len(ids)
    assert inputs == len(ids)  # each input file uploaded once
    expected = {(remote_of[b], f"req-{i}") for b, n in sizes.items() for i in range(n)}
    assert set(runs) == expected and set(runs.values()) == {(1, 1)}  # each request run once, ok


def test_a_second_agent_process_on_one_state_dir_refuses_to_start(agent: AgentProcess) -> None:
    agent.start()
    second = subprocess.run(
        [*agent.command()[:-6], "--port", str(free_port()), "--state-dir", str(agent.state)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second.stderr
    assert agent.proc is not None and f"pid {agent.proc.pid} ctxfuse edge outbox" in second.stderr
    assert f"ctxfuse: the agent state dir (--state-dir) {agent.state} is in use" in second.stderr
