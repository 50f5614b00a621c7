"""`ctxfuse bench shared-state`: what keeping limits and keys in Redis (`--redis-url`) adds to a
request, measured side by side. Two gateways over the instant fake engine, each in its own process
(`python -m gateway.bench.serve keyed ...`), each answering a tenant key with requests- and
tokens-per-minute limits (so every request is looked up, admitted, reserved, settled and released):
one keeps them in its own process and SQLite file, the other in a Redis on loopback. wrk drives each
in turn, alternating for `rounds` rounds; the figure is the median of the rounds' p50 and p99 and
their difference."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from gateway.bench.load import LoadResult, run_wrk, wrk_path
from gateway.bench.redis_proc import RedisProcess
from gateway.bench.run import ROUTE, request_body
from gateway.bench.serve import ServerProcess

RPM, TPM = 10**9, 10**12  # counted on every request, never reached


class _Keyed(ServerProcess):
    """A keyed gateway, and the secret of its tenant's key."""

    def __init__(self, data: Path, redis_url: str | None) -> None:
        from gateway.access.keys import KeyLimits

        data.mkdir()
        store = _key_store(data, redis_url)
        _, self.key = store.create("bench", KeyLimits(rpm=RPM, tpm=TPM))
        store.close()
        super().__init__("keyed", str(data), *([redis_url] if redis_url else []))

    def measure(self, body: str, connections: int, duration_s: float) -> LoadResult:
        return run_wrk(
            self.url + ROUTE, body, connections, duration_s, {"Authorization": f"Bearer {self.key}"}
        )


def _key_store(data: Path, redis_url: str | None) -> Any:
    from gateway.access.keys import KeyStore

    if redis_url is None:
        return KeyStore(data / "keys.sqlite")
    from gateway.access.keys_redis import RedisKeyStore
    from gateway.shared_state.redis_link import RedisLink

    return RedisKeyStore(RedisLink(redis_url))


def run(duration_s: float, connections: int, rounds: int, redis_url: str | None) -> dict[str, Any]:
    wrk_path()
    with tempfile.TemporaryDirectory(prefix="ctxfuse-bench-shared-") as tmp:
        server = None
        if redis_url is None:
            server = RedisProcess(Path(tmp))
            redis_url = server.url
        sides: dict[str, _Keyed] = {}
        try:
            sides["local"] = _Keyed(Path(tmp) / "local", None)
            sides["redis"] = _Keyed(Path(tmp) / "redis", redis_url)
            for g in sides.values():
                g.wait_ready()
            return _measure(sides, duration_s, connections, rounds)
        finally:
            for g in sides.values():
                g.stop()
            if server is not None:
                server.stop()


def _measure(sides: dict[str, _Keyed], duration_s: float, connections: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "load": f"wrk -t1 -c{connections}, {duration_s:g} s per side per round, {rounds} rounds alternating",
        "servers": "gateway over the instant fake engine, a keyed tenant with rpm and tpm limits",
    }
    for mode, streaming in (("non_streaming", False), ("streaming", True)):
        body = request_body(streaming)
        for g in sides.values():
            g.measure(body, connections, 1.0)  # warm-up
        runs: dict[str, list[LoadResult]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, g in sides.items():
                result = g.measure(body, connections, duration_s)
                if result.errors:
                    raise SystemExit(f"{name}: {result.errors} errors under load")
                runs[name].append(result)
        med = {
            name: {
                "p50_ms": round(statistics.median(r.p50_ms for r in rs), 3),
                "p99_ms": round(statistics.median(r.p99_ms for r in rs), 3),
                "requests_per_s": round(statistics.median(r.requests_per_s for r in rs), 1),
            }
            for name, rs in runs.items()
        }
        out[mode] = {
            **med,
            "redis_added_p50_ms": round(med["redis"]["p50_ms"] - med["local"]["p50_ms"], 3),
            "redis_added_p99_ms": round(med["redis"]["p99_ms"] - med["local"]["p99_ms"], 3),
        }
    return out


def add_shared_state_bench_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser(
        "shared-state",
        help="latency that keeping limits and keys in Redis adds, beside the same gateway without; JSON",
    )
    p.add_argument("--duration", type=float, default=4.0, help="seconds per side per round (default 4)")
    p.add_argument("--connections", type=int, default=1, help="wrk connections (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument(
        "--redis-url", default=None, help="a Redis to use (default: start redis-server on loopback)"
    )
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    print(json.dumps(run(args.duration, args.connections, args.rounds, args.redis_url), indent=2))
    return 0
