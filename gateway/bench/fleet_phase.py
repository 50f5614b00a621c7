"""One phase of the fleet bench: a fleet gateway with one routing policy, in a thread of this process,
in front of the bench's workers, and a seeded workload sent through it by an asyncio httpx client at
a fixed concurrency. Every request streams; its TTFT runs from sending to the first content chunk."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.backends.fleet.config import BackendSpec, FleetConfig, Policy
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.serve import build_fleet_server
from gateway.bench.fleet_workload import Query
from gateway.config import GatewayConfig

HEALTH_INTERVAL_S = 0.25  # block events are read this often: a prefix is known soon after its prefill
_DECISION = re.compile(r'^ctxfuse_routing_decisions_total\{decision="(\w+)"\} ([0-9.e+]+)$', re.M)


@dataclass(frozen=True, slots=True)
class Sample:
    user: int
    ok: bool
    ttft_s: float  # 0 when the request failed
    prompt_tokens: int
    cached_tokens: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class PhaseResult:
    policy: Policy
    samples: list[Sample]
    wall_s: float
    decisions: dict[str, int]  # the gateway's ctxfuse_routing_decisions_total by decision


@dataclass(frozen=True, slots=True)
class PhaseSetup:
    worker_urls: list[str]
    model: Path
    served_name: str
    concurrency: int
    max_tokens: int
    seed: int
    worker_key: str  # the workers' --api-key, sent by the router as its --backend-key


class _Gateway:
    """build_fleet_server run in a daemon thread, as tests/gateway/fleet run it."""

    def __init__(self, config: FleetConfig, model: Path, seed: int) -> None:
        self.server, self.fleet = build_fleet_server(
            config, GatewayConfig(port=0), model=model, rng=random.Random(seed)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="fleet-bench-gateway")

    def start(self, timeout_s: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        # routable ctxfuse workers with their block size read: before that, no request could match
        while not (self.server.started and _all_report_blocks(self.fleet)):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fleet gateway did not start, or did not reach its workers")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def _all_report_blocks(fleet: Fleet) -> bool:
    return all(b.reports_blocks and b.takes_work() for b in fleet.backends)


def decisions(metrics_text: str) -> dict[str, int]:
    return {m[1]: int(float(m[2])) for m in _DECISION.finditer(metrics_text)}


def _body(q: Query, setup: PhaseSetup) -> dict[str, object]:
    return {
        "model": setup.served_name,
        "messages": [{"role": "system", "content": q.document}, {"role": "user", "content": q.text}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": setup.max_tokens,
        "temperature": 0,
    }


async def _send(client: httpx.AsyncClient, url: str, q: Query, setup: PhaseSetup) -> Sample:
    start = time.perf_counter()
    ttft, usage = 0.0, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=_body(q, setup)) as resp:
            if resp.status_code != 200:
                return Sample(q.user, False, 0.0, 0, 0, f"HTTP {resp.status_code}: {await resp.aread()!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(q.user, False, 0.0, 0, 0, str(event["error"]))
                choices = event.get("choices") or [{}]
                if not ttft and choices[0].get("delta", {}).get("content"):
                    ttft = time.perf_counter() - start
                usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        return Sample(q.user, False, 0.0, 0, 0, f"{type(exc).__name__}: {exc}")
    if not ttft or usage is None:
        return Sample(q.user, False, 0.0, 0, 0, "no content chunk or no usage in the stream")
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return Sample(q.user, True, ttft, int(usage["prompt_tokens"]), cached)


async def _drive(url: str, queries: list[Query], setup: PhaseSetup) -> list[Sample]:
    """`concurrency` senders take the queries in order: a closed loop, never more in flight."""
    samples: list[Sample] = []
    todo = iter(queries)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), trust_env=False) as client:

        async def sender() -> None:
            for q in todo:  # one shared iterator: each query is taken once, in the workload's order
                samples.append(await _send(client, url, q, setup))

        await asyncio.gather(*(sender() for _ in range(setup.concurrency)))
    return samples


def run_phase(policy: Policy, queries: list[Query], setup: PhaseSetup) -> PhaseResult:
    backends = tuple(
        BackendSpec(name=f"w{i}", url=u, kind="ctxfuse") for i, u in enumerate(setup.worker_urls)
    )
    config = FleetConfig(
        backends=backends, policy=policy, health_interval_s=HEALTH_INTERVAL_S, backend_key=setup.worker_key
    )
    gateway = _Gateway(config, setup.model, setup.seed)
    url = gateway.start()
    try:
        start = time.perf_counter()
        samples = asyncio.run(_drive(url, queries, setup))
        wall_s = time.perf_counter() - start
        counted = decisions(httpx.get(f"{url}/metrics", trust_env=False).text)
    finally:
        gateway.stop()
    return PhaseResult(policy, samples, wall_s, counted)
