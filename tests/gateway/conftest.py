"""One real gateway per test session: the default model, an in-process engine, uvicorn on a free
loopback port in a background thread, and the official `openai` client pointed at it."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import openai
import pytest

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from gateway.access.keys import KeyStore
from gateway.config import GatewayConfig
from gateway.seam import Backend
from gateway.server import GatewayServer, build_server

MODEL = "smollm2-135m-instruct"
ENGINE = EngineConfig(
    served_model_name=MODEL, dtype="float32", weight_quant="none", kv_cache_memory_gib=0.5, max_model_len=2048
)
GATEWAY = GatewayConfig(port=0, max_body_bytes=2**20)


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT, without /v1
    backend: InProcessBackend
    server: GatewayServer

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, api_key: str = "unused", timeout: float = 60.0) -> openai.OpenAI:
        # no retries: a test must see the first answer, not a retried one
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=timeout)


@dataclass
class Running:
    server: GatewayServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.bound_port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def run_in_thread(backend: Backend, config: GatewayConfig) -> Running:
    """`config` served in a thread; a config without a data dir gets a fresh one (one gateway per data
    dir, and tests never touch the user's)."""
    if config.data_dir is None:
        config = replace(config, data_dir=Path(tempfile.mkdtemp(prefix="ctxfuse-test-gateway-")))
    server = build_server(backend, config, announce=False)
    thread = threading.Thread(target=server.run, name="test-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test gateway did not start")
        time.sleep(0.02)
    return Running(server, thread)


@pytest.fixture(scope="session")
def backend(loaded_model: LoadedModel) -> Iterator[InProcessBackend]:
    b = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    yield b
    b.shutdown()


@pytest.fixture(scope="session")
def served(backend: InProcessBackend) -> Iterator[Served]:
    running = run_in_thread(backend, GATEWAY)
    yield Served(running.url, backend, running.server)
    running.stop()


@pytest.fixture(scope="session")
def client(served: Served) -> openai.OpenAI:
    return served.client()


def wait_idle(backend: Backend, free_blocks: int, timeout: float = 10.0) -> None:
    """Wait until nothing runs or waits and the free block count is back to `free_blocks`. Raises
    after `timeout` seconds with the last stats: a hang guard, not a speed bound (STYLE.md rule 12)."""
    start = time.monotonic()
    while True:
        s = backend.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == free_blocks:
            return
        if time.monotonic() - start > timeout:
            raise AssertionError(f"engine not idle after {timeout}s: {s}")
        time.sleep(0.01)


@pytest.fixture
def keyed(backend: InProcessBackend, tmp_path: Path) -> Iterator[tuple[Running, KeyStore]]:
    """A gateway that requires keys (tenants' keys from `store`, or its own --api-key)."""
    store = KeyStore(tmp_path / "keys.sqlite")
    running = run_in_thread(backend, replace(GATEWAY, data_dir=tmp_path, api_key="admin-shortcut"))
    yield running, store
    running.stop()
