"""A fleet gateway over stub OpenAI-compatible servers (openai_stub.py), run in a thread."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.serve import build_fleet_server
from gateway.config import GatewayConfig
from gateway.state import Gateway

from .openai_stub import StubServer


@dataclass
class Running:
    url: str
    fleet: Fleet
    stop: object
    gateway: Gateway  # the router's state: the same one app as over an engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text


def run_fleet(
    config: FleetConfig, seed: int = 0, data_dir: Path | None = None, share_prefix_cache: bool = False
) -> Running:
    """`data_dir`: where its Batch API keeps files and batches (give one to any test that uses it)."""
    gateway = GatewayConfig(port=0, data_dir=data_dir, share_prefix_cache=share_prefix_cache)
    server, fleet = build_fleet_server(config, gateway, rng=random.Random(seed))
    thread = threading.Thread(target=server.run, daemon=True, name="fleet-gateway")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fleet gateway did not start")
        time.sleep(0.02)
    port = int(server.servers[0].sockets[0].getsockname()[1])

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=15)

    return Running(f"http://127.0.0.1:{port}", fleet, stop, server.gateway)


def fleet_of(
    *stubs: StubServer, versions: tuple[str, ...] = (), weights: tuple[float, ...] = (), **kw: object
) -> FleetConfig:
    specs = tuple(
        BackendSpec(
            name=s.behaviour.name,
            url=s.url,
            kind="auto",
            version=versions[i] if versions else "v1",
            weight=weights[i] if weights else 1.0,
        )
        for i, s in enumerate(stubs)
    )
    defaults: dict[str, object] = {"health_interval_s": 0.2, "cooldown_s": 0.5, "failures_to_open": 2}
    return FleetConfig(backends=specs, **{**defaults, **kw})  # type: ignore[arg-type]
