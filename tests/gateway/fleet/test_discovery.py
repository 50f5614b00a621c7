"""Workers found through DNS ([discovery]): a router over stub servers on 127.0.0.1 and 127.0.0.2 (one
port, as a headless Service's pods share one), whose name resolves through a resolver the test
controls; and one real lookup of `localhost`."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from gateway.backends.fleet.config import BackendSpec, DiscoverySpec, FleetConfig
from gateway.backends.fleet.discovery import Discovery
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.health import check
from gateway.backends.fleet.metrics import FleetMetrics
from gateway.backends.fleet.serve import build_fleet_server
from gateway.config import GatewayConfig

from .openai_stub import Behaviour, stub_app

NAME = "workers.ctxfuse.test"


class Stub:
    """openai_stub's app on a chosen address and port."""

    def __init__(self, name: str, host: str, port: int) -> None:
        self.host = host
        config = uvicorn.Config(
            stub_app(Behaviour(name)), host=host, port=port, log_config=None, lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"stub-{name}")
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the stub server did not start on {host}:{port}")
            time.sleep(0.01)
        self.port = int(self.server.servers[0].sockets[0].getsockname()[1])

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture()
def pods() -> Iterator[tuple[Stub, Stub]]:
    """Two stubs on one port, 127.0.0.1 and 127.0.0.2 (the whole of 127/8 is loopback on Linux)."""
    a = Stub("a", "127.0.0.1", 0)
    b = Stub("b", "127.0.0.2", a.port)
    yield a, b
    a.stop()
    b.stop()


class FakeDNS:
    """A resolver with getaddrinfo's shape, answering NAME with `addresses` (changed by the test)."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.lookups = 0

    def __call__(self, host: str, port: int) -> Sequence[tuple[Any, Any, Any, Any, tuple[Any, ...]]]:
        self.lookups += 1
        if host != NAME or not self.addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in self.addresses]


def _fleet(config: FleetConfig, dns: FakeDNS | None = None) -> Fleet:
    fleet = Fleet(config, None, None, FleetMetrics(CollectorRegistry()))
    if dns is not None:
        fleet.resolver = dns
    return fleet


def _spec(port: int, **kw: Any) -> DiscoverySpec:
    return DiscoverySpec(**{"dns": NAME, "port": port, "kind": "openai", "version": "v1", **kw})


def test_addresses_that_come_are_added_and_those_gone_dropped_and_named_backends_stay() -> None:
    named = BackendSpec(name="fixed", url="http://10.9.9.9:8001", version="v1")
    dns = FakeDNS("10.0.0.1", "10.0.0.2")
    fleet = _fleet(FleetConfig(backends=(named,), discovery=_spec(8001)), dns)
    found = Discovery(fleet, _spec(8001))
    change = asyncio.run(found.refresh())
    assert change is not None and change.added == ("10.0.0.1:8001", "10.0.0.2:8001")
    assert [b.url for b in fleet.backends] == [
        "http://10.9.9.9:8001",
        "http://10.0.0.1:8001",
        "http://10.0.0.2:8001",
    ]
    fleet.index.add("10.0.0.1:8001", [b"k1", b"k2"])
    dns.addresses = ["10.0.0.2", "10.0.0.3", "10.9.9.9"]  # .9 is the named backend's: not added twice
    change = asyncio.run(found.refresh())
    assert change is not None and (change.added, change.dropped) == (("10.0.0.3:8001",), ("10.0.0.1:8001",))
    assert [b.name for b in fleet.backends] == ["fixed", "10.0.0.2:8001", "10.0.0.3:8001"]
    assert fleet.index.held_by("10.0.0.1:8001") == 0 and len(fleet.index) == 0
    dns.addresses = []  # a headless Service with no ready pod: no such name
    change = asyncio.run(found.refresh())
    assert change is not None and change.dropped == ("10.0.0.2:8001", "10.0.0.3:8001")
    assert [b.name for b in fleet.backends] == ["fixed"]


def test_a_dns_failure_keeps_the_workers_known() -> None:
    dns = FakeDNS("10.0.0.1")
    fleet = _fleet(FleetConfig(backends=(), discovery=_spec(8001)), dns)
    found = Discovery(fleet, _spec(8001))
    asyncio.run(found.refresh())

    def unanswered(host: str, port: int) -> Sequence[tuple[Any, Any, Any, Any, tuple[Any, ...]]]:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    fleet.resolver = unanswered
    assert asyncio.run(found.refresh()) is None
    assert [b.name for b in fleet.backends] == ["10.0.0.1:8001"]


def test_a_discovered_backend_is_sent_the_fleet_key_and_waits_for_its_health_check() -> None:
    dns = FakeDNS("10.0.0.7")
    config = FleetConfig(backends=(), discovery=_spec(8001, kind="ctxfuse"), backend_key="sekrit")
    fleet = _fleet(config, dns)
    asyncio.run(Discovery(fleet, config.discovery).refresh())  # type: ignore[arg-type]
    (found,) = fleet.backends
    assert (found.kind, found.reachable, found.takes_work()) == ("ctxfuse", False, False)
    auth = fleet.client.auth
    assert auth is not None
    sent = next(auth.auth_flow(httpx.Request("GET", "http://10.0.0.7:8001/internal/v1/state")))
    assert sent.headers["authorization"] == "Bearer sekrit"
    elsewhere = next(auth.auth_flow(httpx.Request("GET", "http://10.0.0.8:8001/v1/models")))
    assert "authorization" not in elsewhere.headers  # the key goes to the fleet's backends only


def test_localhost_resolves_for_real_to_a_backend_the_health_check_reaches(pods: tuple[Stub, Stub]) -> None:
    a, _ = pods
    spec = DiscoverySpec(dns="localhost", port=a.port, kind="openai", version="v1")
    fleet = Fleet(FleetConfig(backends=(), discovery=spec), None, None, FleetMetrics(CollectorRegistry()))

    async def discover_and_check() -> None:
        await Discovery(fleet, spec).refresh()  # the system's own getaddrinfo
        await asyncio.gather(*(check(fleet, b) for b in fleet.backends))
        await fleet.close()

    asyncio.run(discover_and_check())
    local = next(b for b in fleet.backends if b.url == f"http://127.0.0.1:{a.port}")
    assert (local.name, local.reachable, local.kind) == (f"127.0.0.1:{a.port}", True, "openai")
    assert "stub" in local.models  # what the stub's /v1/models listed, read by the health check


def _answers(client: openai.OpenAI, n: int = 16) -> set[str]:
    out = set()
    for _ in range(n):
        r = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}])
        out.add(r.choices[0].message.content or "")
    return out


def _until(fleet: Fleet, names: set[str], reachable: bool = True) -> None:
    deadline = time.monotonic() + 20
    while {b.name for b in fleet.backends if b.reachable or not reachable} != names:
        assert time.monotonic() < deadline, [(b.name, b.reachable) for b in fleet.backends]
        time.sleep(0.02)


def test_a_worker_gone_from_dns_stops_taking_requests_and_one_that_appears_starts(
    pods: tuple[Stub, Stub],
) -> None:
    a, b = pods
    dns = FakeDNS("127.0.0.1", "127.0.0.2")
    config = FleetConfig(
        backends=(), discovery=_spec(a.port, refresh_s=0.05), health_interval_s=0.2, cooldown_s=0.5
    )
    server, fleet = build_fleet_server(config, GatewayConfig(port=0))
    fleet.resolver = dns
    thread = threading.Thread(target=server.run, daemon=True, name="fleet-gateway")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        a_name, b_name = f"127.0.0.1:{a.port}", f"127.0.0.2:{b.port}"
        _until(fleet, {a_name, b_name})
        assert httpx.get(f"{url}/ready").status_code == 200
        assert _answers(client) == {"a", "b"}

        dns.addresses = ["127.0.0.1"]  # b's pod went away (its server still runs: DNS alone decides)
        _until(fleet, {a_name}, reachable=False)
        assert _answers(client) == {"a"}
        listed = httpx.get(f"{url}/fleet/v1/backends").json()["backends"]
        assert [x["name"] for x in listed] == [a_name]

        dns.addresses = ["127.0.0.2"]  # a replaced by b
        _until(fleet, {b_name})
        assert _answers(client) == {"b"}
        assert dns.lookups >= 3
    finally:
        server.should_exit = True
        thread.join(timeout=15)
