"""The loopback rig: a throwaway CA, the gateway (plain-HTTP and mutual-TLS edge listeners sharing one
Gateway and chunk store) over the instant fake engine in its own process, as it would run in the
cloud, and an edge agent in front of the edge listener, in this process (its byte counter is read
directly). `rig()` tears all of it down on exit."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from edge.agent import Agent
from edge.config import EdgeConfig
from edge.server import agent_uvicorn_config
from gateway.bench.serve import ServerProcess, free_port
from shared.certs import init_ca, issue_device, issue_server

HOST = "127.0.0.1"
DEVICE = "bench-device"
START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Rig:
    agent: Agent
    agent_url: str  # what an app on the device calls (plain HTTP)
    gateway_url: str  # the gateway's plain-HTTP listener, for apps that call it directly


def _start(server: uvicorn.Server, name: str) -> tuple[threading.Thread, int]:
    """Run `server` in a thread; return the thread and the bound port once it listens."""
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the bench's {name} did not start")
        time.sleep(0.02)
    return thread, int(server.servers[0].sockets[0].getsockname()[1])


@contextmanager
def _running(server: uvicorn.Server, name: str) -> Iterator[int]:
    thread, port = _start(server, name)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def rig(configure: Callable[[EdgeConfig], EdgeConfig] | None = None) -> Iterator[Rig]:
    """`configure`, when given, adjusts the agent's configuration (e.g. shorter batch polls)."""
    with tempfile.TemporaryDirectory(prefix="ctxfuse-bench-edge-") as tmp, ExitStack() as stack:
        tls = Path(tmp) / "tls"
        init_ca(tls)
        issue_server(tls, [HOST, "localhost"])
        issue_device(tls, DEVICE)
        edge_port = free_port()
        gateway = ServerProcess("edge", str(edge_port), str(tls), str(Path(tmp) / "chunks.sqlite"))
        stack.callback(gateway.stop)
        gateway.wait_ready()
        gateway.wait_ready(port=edge_port)
        gateway_port = gateway.port
        config = EdgeConfig(
            gateway_url=f"https://{HOST}:{edge_port}",
            tls_dir=tls,
            name=DEVICE,
            port=0,
            state_dir=Path(tmp) / "agent",
        )
        agent = Agent(configure(config) if configure else config)
        agent_server = uvicorn.Server(agent_uvicorn_config(agent, HOST, 0, "warning"))
        agent_port = stack.enter_context(_running(agent_server, "edge agent"))
        yield Rig(agent, f"http://{HOST}:{agent_port}", f"http://{HOST}:{gateway_port}")
