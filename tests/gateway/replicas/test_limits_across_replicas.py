"""Two gateway replicas over one Redis, as a load balancer spreads a client over them: a key's
requests-per-minute limit yields exactly that many 200s across both, a key revoked with `ctxfuse keys
revoke --redis-url` is refused by both within seconds, and a replica whose Redis cannot be reached
refuses keyed requests with a 503 in OpenAI's error shape (no 500, no hang)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from gateway.bench.worker_proc import REPO
from tests.gateway.replicas.rig import MODEL, Cluster, ReplicaProcess
from tests.redis_rig import unreachable_url

RPM = 4


def _keys_cli(redis_url: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CTXFUSE_REDIS_URL"}
    out = subprocess.run(
        [sys.executable, "-m", "ctxfuse", "keys", *args[:1], "--redis-url", redis_url, *args[1:]],
        cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return out.stdout


def _created(redis_url: str, *limits: str) -> tuple[str, str]:
    """(key id, secret) of a new key of tenant acme, made through the CLI as an operator would."""
    out = _keys_cli(redis_url, "create", "--tenant", "acme", *limits)
    secret = next(w for w in out.split() if w.startswith("cfk_") and not w.endswith("_..."))
    return secret.split("_")[1], secret


def _chat(url: str, secret: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}, timeout=120
    )


def test_a_per_key_limit_yields_exactly_that_many_200s_across_both_replicas(cluster: Cluster) -> None:
    _, secret = _created(cluster.redis_url, "--rpm", str(RPM))
    a, b = cluster.replicas[0], cluster.replicas[1]
    codes = [_chat((a if i % 2 else b).url, secret).status_code for i in range(2 * RPM + 1)]
    assert codes.count(200) == RPM, codes
    assert codes.count(429) == RPM + 1, codes


def test_a_key_revoked_through_the_cli_is_refused_by_every_replica(cluster: Cluster) -> None:
    key_id, secret = _created(cluster.redis_url)
    assert all(_chat(r.url, secret).status_code == 200 for r in cluster.replicas)
    _keys_cli(cluster.redis_url, "revoke", key_id)
    deadline = time.monotonic() + 30  # replicas cache a lookup for two seconds
    pending = list(cluster.replicas)
    while pending and time.monotonic() < deadline:
        pending = [r for r in pending if _chat(r.url, secret).status_code != 401]
        time.sleep(0.2)
    assert not pending, "a replica still took a revoked key"


def test_a_replica_whose_redis_is_unreachable_answers_503_and_stays_alive(cluster: Cluster) -> None:
    data = cluster.workdir / "replica-no-redis"
    data.mkdir(exist_ok=True)
    lone = ReplicaProcess("r-down", cluster.backends, unreachable_url(), data, cluster.tls_dir, cluster.model)
    try:
        answer = _chat(lone.url, "cfk_0123456789ab_" + "x" * 43)
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "service_unavailable" and "Redis" in error["message"]
        assert httpx.get(f"{lone.url}/health", timeout=10).status_code == 200
    finally:
        lone.stop()
