"""The Batch API's SQLite work runs off the event loop: while a store call waits on the database (a
slow disk, held here by a gate on the store's lock), /health and the rest of the gateway still answer."""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

import httpx

from cloud.serving.in_process import InProcessBackend
from gateway.config import GatewayConfig

from .conftest import run_in_thread

HANG_GUARD_S = 60.0  # how long the gate holds at most; far longer than HEALTH_S
HEALTH_S = 10.0  # /health gets this long: on the loop, the gate would hold it past that


class GatedLock:
    """Stands in for the store's lock: a caller says it is waiting, then waits until the test opens
    the gate (as a write stuck on a slow disk would hold the lock)."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.open = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self.waiting.set()
        self.open.wait(HANG_GUARD_S)
        self._lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()


def test_health_answers_while_a_batch_route_waits_on_the_database(
    backend: InProcessBackend, tmp_path: Path
) -> None:
    running = run_in_thread(backend, GatewayConfig(port=0, data_dir=tmp_path))
    gate = GatedLock()
    try:
        with httpx.Client(base_url=running.url, timeout=HANG_GUARD_S) as http:
            assert http.get("/v1/files").status_code == 200  # opens the store
            runner = running.server.gateway.batches
            assert runner is not None
            runner.store._lock = gate
            listed: list[int] = []
            url = f"{running.url}/v1/files"
            lister = threading.Thread(
                target=lambda: listed.append(httpx.get(url, timeout=HANG_GUARD_S).status_code)
            )
            lister.start()
            assert gate.waiting.wait(HANG_GUARD_S)  # the list call is inside the store, stuck
            health = http.get("/health", timeout=HEALTH_S)  # blocked loop: times out
            assert health.status_code == 200 and not listed
            gate.open.set()
            lister.join(HANG_GUARD_S)
            assert listed == [200]
    finally:
        gate.open.set()
        running.stop()
