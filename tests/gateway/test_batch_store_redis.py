"""The Batch API over Redis when Redis cannot be reached: every store call raises SharedStateDown, and
the Files and Batch routes answer 503 with the OpenAI error body, at once, never a 500 or a hang and
never from this replica's own state. (The store's contract on a reachable Redis is
test_batch_store.py's, run against both backends; the runner riding out a Redis outage and its leases
are in test_batch_runner.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from cloud.serving.in_process import InProcessBackend
from gateway.backends.local import engine_gateway
from gateway.batch.executor import upstream_executor
from gateway.batch.files import ContentRef
from gateway.batch.input import BatchItem
from gateway.batch.runner import BatchRunner
from gateway.batch.store_redis import RedisBatchStore
from gateway.config import GatewayConfig
from gateway.server import server_for
from gateway.shared_state.redis_link import RedisLink, SharedStateDown
from shared.batch_protocol import BatchCreateRequest
from tests.redis_rig import unreachable_url

from .batches import chat_line, jsonl
from .conftest import Running

CHAT = "/v1/chat/completions"


def test_every_store_call_on_an_unreachable_redis_raises_shared_state_down() -> None:
    link = RedisLink(unreachable_url())
    store = RedisBatchStore(link)
    req = BatchCreateRequest(input_file_id="file-x", endpoint=CHAT, completion_window="24h")
    calls = [
        lambda: store.put_file("batch", "a.jsonl", b"{}", owner="t"),
        lambda: store.get_file("file-x", "t"),
        lambda: store.file_content("file-x"),
        lambda: store.read_content(ContentRef(1, 10), 0, 10),
        lambda: store.list_files(10, None, None, owner="t"),
        lambda: store.delete_file("file-x", owner="t"),
        store.sweep,
        lambda: store.create_batch(req, owner="t"),
        lambda: store.get_batch("batch_x"),
        lambda: store.list_batches(10, None, owner="t"),
        lambda: store.active_ids(10, frozenset()),
        lambda: store.transition("batch_x", "cancelling"),
        lambda: store.start("batch_x", [BatchItem(1, "a", b"{}")]),
        lambda: store.pending("batch_x"),
        lambda: store.put_result("batch_x", 1, True, b"{}"),
        lambda: store.finish("batch_x", "completed"),
    ]
    for call in calls:
        with pytest.raises(SharedStateDown) as err:
            call()
        assert err.value.status == 503 and "Redis" in err.value.message
    link.close()


def serve_batches_over(backend: InProcessBackend, tmp_path: Path, redis_url: str) -> Running:
    """A real gateway whose Batch API is over `redis_url` (its keys stay in its data dir, so the
    requests reach the batch routes)."""
    gateway = engine_gateway(backend, GatewayConfig(port=0, data_dir=tmp_path))
    gateway.batches = BatchRunner(upstream_executor(gateway), tmp_path / "unused", redis=RedisLink(redis_url))
    server = server_for(gateway, announce=False)
    thread = threading.Thread(target=server.run, name="test-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test gateway did not start"
        time.sleep(0.02)
    return Running(server, thread)


def test_the_batch_routes_answer_503_with_the_openai_body_while_redis_is_down(
    backend: InProcessBackend, tmp_path: Path
) -> None:
    running = serve_batches_over(backend, tmp_path, unreachable_url())
    try:
        with httpx.Client(base_url=running.url, timeout=30) as http:
            files = {"file": ("in.jsonl", jsonl([chat_line("a")]))}
            answers = [
                http.get("/v1/files"),
                http.post("/v1/files", data={"purpose": "batch"}, files=files),
                http.get("/v1/files/file-x/content"),
                http.get("/v1/batches"),
                http.post(
                    "/v1/batches", json={"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h"}
                ),
                http.post("/v1/batches/batch_x/cancel"),
            ]
            for r in answers:
                assert r.status_code == 503, r.text
                error = r.json()["error"]
                assert set(error) >= {"message", "type", "param", "code"}
                assert (
                    error["message"].startswith("the Batch API is unavailable")
                    and "Redis" in error["message"]
                )
            assert http.get("/health").status_code == 200  # the gateway itself is up
    finally:
        running.stop()
