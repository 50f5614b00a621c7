"""Issue 17, finding 3: the fleet router forwards `/v1/models/{id}` to a worker. A real router in front
of a real worker (the app of `ctxfuse worker` over the default model, on loopback): every way of
hiding `../internal/v1/blocks` in the id gets a 400 in OpenAI's error shape, and the worker never sees
a request for its internal routes other than the router's own health checks. An ordinary model id is
still forwarded and answered."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from litestar.types import ASGIApp, Receive, Scope, Send

from cloud.serving.in_process import InProcessBackend
from ctxfuse.engine_serve import worker_engine
from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.config import GatewayConfig
from gateway.server import GatewayServer, build_server

from ..conftest import MODEL
from ..raw_http import get_raw_path
from .stub_fleet import Running, run_fleet

TRAVERSALS = [
    "/v1/models/..%2F..%2Finternal%2Fv1%2Fblocks",  # as found
    "/v1/models/..%2f..%2finternal%2fv1%2fblocks",
    "/v1/models/..%5C..%5Cinternal%5Cv1%5Cblocks",
    "/v1/models/../../internal/v1/blocks",  # raw dot segments (a client that does not normalize)
    "/v1/models/%2e%2e/%2e%2e/internal/v1/blocks",
    "/v1/models/%252e%252e/%252e%252e/internal/v1/blocks",  # encoded twice
    "/v1/models/x%00/../../../internal/v1/blocks",
]

WORKER_KEY = "traversal-worker-key"  # the worker requires it; the router sends it


@dataclass
class Seen:
    """What reached the worker's app: (path, query string) of every request."""

    requests: list[tuple[str, bytes]] = field(default_factory=list)

    def not_health_checks(self) -> list[tuple[str, bytes]]:
        """Requests other than the router's health checks (state, and blocks since its cursor)."""
        return [
            (path, query)
            for path, query in self.requests
            if path != "/internal/v1/state" and not (path == "/internal/v1/blocks" and b"since=" in query)
        ]


class Recorder:
    """Notes each request the worker's app receives, then hands it on untouched."""

    def __init__(self, app: ASGIApp, seen: Seen) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.requests.append((scope["path"], scope["query_string"]))
        await self.app(scope, receive, send)


@dataclass
class Stack:
    router: Running
    seen: Seen


def _start_worker(backend: InProcessBackend, data_dir: Path, seen: Seen) -> GatewayServer:
    config = GatewayConfig(port=0, max_body_bytes=2**20, data_dir=data_dir, api_key=WORKER_KEY)
    server = build_server(backend, config, announce=False, worker=worker_engine(backend))
    server.config.app = Recorder(server.config.app, seen)  # before run(), which loads it
    thread = threading.Thread(target=server.run, name="traversal-worker", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the worker did not start")
        time.sleep(0.02)
    return server


@pytest.fixture(scope="module")
def stack(backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    seen = Seen()
    worker = _start_worker(backend, tmp_path_factory.mktemp("worker"), seen)
    url = f"http://127.0.0.1:{worker.bound_port}"
    spec = BackendSpec(name="w", url=url, kind="ctxfuse")
    config = FleetConfig(backends=(spec,), health_interval_s=0.2, backend_key=WORKER_KEY)
    router = run_fleet(config, data_dir=tmp_path_factory.mktemp("router"))
    yield Stack(router, seen)
    router.stop()  # type: ignore[operator]
    worker.should_exit = True


@pytest.mark.parametrize("path", TRAVERSALS)
def test_a_traversal_through_the_model_route_is_refused_before_the_worker(stack: Stack, path: str) -> None:
    before = len(stack.seen.not_health_checks())
    status, body = get_raw_path(stack.router.url, path)
    assert status == 400, body[:200]
    error = json.loads(body)["error"]
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert stack.seen.not_health_checks()[before:] == []  # nothing but health checks reached the worker


def test_an_ordinary_model_id_still_reaches_the_worker(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.router.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert client.models.retrieve(MODEL).id == MODEL
    assert ("/v1/models/" + MODEL, b"") in stack.seen.requests  # the recorder sees what is forwarded
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")  # the worker's own 404, relayed
