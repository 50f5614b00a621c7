"""The chunk store in Redis as several replicas see it: two stores over one real Redis (two replicas'
views) share chunks, one LRU order and one byte bound; an unreachable Redis makes every call a
SharedStateDown, and the edge route a 503 in OpenAI's error shape; the same request, sent again
once Redis is back, is served (the per-store behaviours, shared with SQLite, are in test_chunk_store.py)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from gateway.backends.local import engine_gateway
from gateway.bench.fake_engine import MODEL_NAME, InstantBackend
from gateway.config import GatewayConfig
from gateway.edge.chunk_store_redis import RedisChunkStore
from gateway.edge.server import build_edge_server
from gateway.shared_state.redis_link import RedisLink, SharedStateDown
from gateway.state import Gateway
from shared.certs import init_ca, issue_device, issue_server
from shared.chunking import digest
from shared.compression import compress
from shared.edge_protocol import EdgeRequest, text_ref
from shared.tls import client_context
from tests.edge.test_edge_e2e import start
from tests.gateway.edge_rig import send_edge_request
from tests.gateway.test_chunk_store import SIZE, A, B, C, D, chunk, held
from tests.redis_rig import unreachable_url

T = "tenant-a"


def replica(url: str, max_bytes: int) -> RedisChunkStore:
    """The chunk store one replica opens: its own link (connection pool) to the shared Redis."""
    return RedisChunkStore(RedisLink(url), max_bytes)


def test_a_chunk_put_through_one_replica_is_found_through_the_other_for_its_tenant_only(
    redis_url: str,
) -> None:
    one, two = replica(redis_url, 3 * SIZE), replica(redis_url, 3 * SIZE)
    one.put_many(dict([A, B]), tenant=T)
    assert two.missing([A[0], B[0], C[0]], tenant=T) == [C[0]]
    assert two.sizes([A[0], C[0]], tenant=T) == {A[0]: SIZE}
    assert two.get_many([B[0], A[0]], tenant=T) == dict([A, B])
    assert two.missing([A[0]], tenant="other") == [A[0]]  # another tenant's device must send the bytes
    assert (two.count, two.total_bytes) == (one.count, one.total_bytes) == (2, 2 * SIZE)
    assert (one.hits, two.hits, two.misses) == (0, 4, 2)  # lookups are counted where they are made


def test_the_lru_order_is_one_across_replicas(redis_url: str) -> None:
    one, two = replica(redis_url, 3 * SIZE), replica(redis_url, 3 * SIZE)
    one.put_many(dict([A, B, C]), tenant=T)
    two.get_many([A[0]], tenant=T)  # order: B C A, whoever was asked
    one.put(*D, tenant=T)  # over budget by one chunk: B goes, though `one` never read A
    assert held(two, A, B, C, D) == [True, False, True, True]


def test_replicas_putting_at_once_never_overrun_the_bound(redis_url: str) -> None:
    pool = [chunk(f"chunk-{i}") for i in range(40)]
    budget = 10 * SIZE
    stores = [replica(redis_url, budget) for _ in range(2)]
    errors: list[BaseException] = []

    def worker(store: RedisChunkStore, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                # a put's own chunks (at most 3) fit the budget, so each put ends within it, and
                # nothing runs between two puts: the bound holds whenever anyone looks
                store.put_many(dict(rng.sample(pool, rng.randint(1, 3))), tenant=T)
                held_now = store.total_bytes
                if held_now > budget:
                    raise AssertionError(f"{held_now} bytes held, budget {budget}")
        except BaseException as e:  # a thread's failure is reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(stores[i % 2], i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    link = RedisLink(redis_url)
    keys = stores[0].keys
    stored: dict[bytes, bytes] = link.sync.hgetall(keys.data)  # type: ignore[assignment]
    assert stores[1].total_bytes == sum(len(v) for v in stored.values()) <= budget
    assert stores[1].count == len(stored) == link.sync.zcard(keys.lru)
    assert all(digest(data) == d for d, data in stored.items())


def test_every_call_on_an_unreachable_redis_raises_shared_state_down() -> None:
    store = replica(unreachable_url(), 3 * SIZE)  # opening sends nothing: a replica starts while it is down
    calls: list[Callable[[], object]] = [
        lambda: store.missing([A[0]], tenant=T),
        lambda: store.sizes([A[0]], tenant=T),
        lambda: store.get_many([A[0]], tenant=T),
        lambda: store.put(*A, tenant=T),
        lambda: store.count,
        lambda: store.total_bytes,
    ]
    for call in calls:
        with pytest.raises(SharedStateDown) as raised:
            call()
        assert raised.value.status == 503


# -- the edge route ---------------------------------------------------------------------------------


@dataclass
class Edge:
    gateway: Gateway
    url: str  # the edge listener, https
    device: httpx.Client  # mutual TLS with dev1's certificate


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    """An edge listener (mutual TLS, a device certificate) over the instant fake engine."""
    tls = tmp_path_factory.mktemp("tls")
    init_ca(tls)
    issue_server(tls, ["127.0.0.1"])
    issue_device(tls, "dev1")
    state: Path = tmp_path_factory.mktemp("state")
    config = GatewayConfig(port=0, edge_host="127.0.0.1", edge_port=0, tls_dir=tls, data_dir=state)
    gateway = engine_gateway(InstantBackend(), config)
    listener: uvicorn.Server = build_edge_server(gateway)
    url = f"https://127.0.0.1:{start(listener, 'edge-listener')}"
    device = httpx.Client(verify=client_context(tls, "dev1"), timeout=30)
    yield Edge(gateway, url, device)
    device.close()
    listener.should_exit = True


def test_the_edge_route_answers_503_while_redis_is_down_and_the_retry_succeeds_once_it_is_back(
    edge: Edge, redis_url: str
) -> None:
    text = b"a long document " * 200
    d = digest(text)
    req = EdgeRequest(
        endpoint="completions",
        body={"model": MODEL_NAME, "prompt": text_ref(0), "max_tokens": 1},
        texts=[[d]],
        chunks={d: compress(text)},
    )
    edge.gateway.chunk_store = replica(unreachable_url(), 2**20)
    down = send_edge_request(edge.device, edge.url, req)
    assert down.status_code == 503, down.text
    error = down.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("server_error", "service_unavailable")
    assert "Redis" in error["message"]

    edge.gateway.chunk_store = store = replica(redis_url, 2**20)  # back: the device sends it again
    again = send_edge_request(edge.device, edge.url, req)
    assert again.status_code == 200, again.text
    assert (store.count, store.total_bytes) == (1, len(text))
