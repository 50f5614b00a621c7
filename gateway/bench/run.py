"""The gateway benchmark: for a plain and a streamed chat completion, the full gateway against the
baseline app, each at a fixed connection count (added latency) and then stepping connections up
(the highest rate whose p99 stays within the budget). Prints nothing; returns the figures."""

from __future__ import annotations

import json
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.bench.baseline import Recorded
from gateway.bench.fake_engine import MODEL_NAME
from gateway.bench.load import LoadResult, run_wrk, wrk_path
from gateway.bench.serve import ServerProcess
from shared.errors import CtxfuseError

ROUTE = "/v1/chat/completions"
WARMUP_S = 1.0


@dataclass(frozen=True, slots=True)
class GatewayBenchOptions:
    duration_s: float = 5.0  # per wrk run
    connections: int = 1  # for the added-latency comparison
    steps: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # connection counts for the rate search
    p99_budget_ms: float = 50.0
    # also serve the gateway on uvicorn's httptools without connection limits, side by side
    compare_unlimited: bool = False


def request_body(streaming: bool) -> str:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
        "stream": streaming,
    }
    return json.dumps(body, separators=(",", ":"))


def _post(url: str, body: str) -> tuple[list[tuple[str, str]], bytes]:
    req = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return list(resp.getheaders()), resp.read()


def _rate_search(url: str, body: str, opts: GatewayBenchOptions, known: LoadResult) -> list[LoadResult]:
    """Step connections up until p99 leaves the budget (in a closed loop, more only adds queueing)."""
    results = []
    for c in opts.steps:
        r = known if c == known.connections else run_wrk(url, body, c, opts.duration_s)
        results.append(r)
        if r.p99_ms >= opts.p99_budget_ms:
            break
    return results


def _best_within(results: list[LoadResult], budget_ms: float) -> dict[str, float | int] | None:
    ok = [r for r in results if r.p99_ms < budget_ms and r.errors == 0]
    return max(ok, key=lambda r: r.requests_per_s).as_dict() if ok else None


def _measure_mode(
    gateway: ServerProcess,
    streaming: bool,
    opts: GatewayBenchOptions,
    tmp: Path,
    unlimited: ServerProcess | None = None,
) -> dict[str, Any]:
    body = request_body(streaming)
    headers, reply = _post(gateway.url + ROUTE, body)
    recorded_path = tmp / f"recorded-{int(streaming)}.json"
    Recorded.from_response(headers, reply, streaming).save(recorded_path)
    baseline = ServerProcess("baseline", str(recorded_path))
    try:
        baseline.wait_ready()
        if _post(baseline.url + ROUTE, body)[1] != b"".join(Recorded.load(recorded_path).chunks):
            raise CtxfuseError("the baseline app does not answer with the recorded bytes")
        servers = {"gateway": gateway, "baseline": baseline}
        if unlimited is not None:
            servers["gateway_unlimited"] = unlimited
        for s in servers.values():
            run_wrk(s.url + ROUTE, body, max(opts.steps), WARMUP_S)
        fixed = {
            name: run_wrk(s.url + ROUTE, body, opts.connections, opts.duration_s)
            for name, s in servers.items()
        }
        steps = {name: _rate_search(s.url + ROUTE, body, opts, fixed[name]) for name, s in servers.items()}
    finally:
        baseline.stop()
    g, b = fixed["gateway"], fixed["baseline"]
    limits: dict[str, Any] = {}
    if unlimited is not None:
        u = fixed["gateway_unlimited"]
        limits = {
            "gateway_unlimited": u.as_dict(),
            "connection_limits_p50_ms": round(g.p50_ms - u.p50_ms, 3),
            "connection_limits_p99_ms": round(g.p99_ms - u.p99_ms, 3),
        }
    return {
        "response_bytes": len(reply),
        "gateway": g.as_dict(),
        "baseline": b.as_dict(),
        "added_p50_ms": round(g.p50_ms - b.p50_ms, 3),
        "added_p99_ms": round(g.p99_ms - b.p99_ms, 3),
        **limits,
        f"max_rate_p99_under_{opts.p99_budget_ms:g}ms": {
            name: _best_within(rs, opts.p99_budget_ms) for name, rs in steps.items()
        },
        "steps": {name: [r.as_dict() for r in rs] for name, rs in steps.items()},
    }


def run(opts: GatewayBenchOptions) -> dict[str, Any]:
    wrk_path()  # fail before starting anything when wrk is missing
    result: dict[str, Any] = {
        "options": {
            "duration_s": opts.duration_s,
            "connections": opts.connections,
            "steps": list(opts.steps),
            "p99_budget_ms": opts.p99_budget_ms,
        },
        "load": "wrk -t1, closed loop of N kept-alive connections; latency to the last byte of the response",
        "servers": "uvicorn, 1 worker each, own process, loopback; the gateway with an instant fake engine",
    }
    gateway = ServerProcess("gateway")
    unlimited = ServerProcess("gateway-unlimited") if opts.compare_unlimited else None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            gateway.wait_ready()
            if unlimited is not None:
                unlimited.wait_ready()
            for name, streaming in (("non_streaming", False), ("streaming", True)):
                result[name] = _measure_mode(gateway, streaming, opts, Path(tmp), unlimited)
        finally:
            gateway.stop()
            if unlimited is not None:
                unlimited.stop()
    return result
