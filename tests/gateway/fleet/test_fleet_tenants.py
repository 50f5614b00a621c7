"""Tenants through the fleet router (issue 17): the router checks tenants' keys as the engine gateway
does, authenticates itself to its worker with the worker's key, and names the caller's tenant, so
the worker keeps each tenant's cached prefixes apart and the router still matches them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.backend import InProcessBackend
from gateway.fleet.config import BackendSpec, FleetConfig
from gateway.key_store import KeyStore

from ..conftest import MODEL
from .stub_fleet import Running, run_fleet
from .test_forwarded_paths import WORKER_KEY, Seen, _start_worker


@pytest.fixture(scope="module")
def keyed_router(
    backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    worker = _start_worker(backend, tmp_path_factory.mktemp("worker"), Seen())
    spec = BackendSpec(name="w", url=f"http://127.0.0.1:{worker.bound_port}", kind="ctxfuse")
    data = tmp_path_factory.mktemp("router")
    router: Running = run_fleet(
        FleetConfig(backends=(spec,), health_interval_s=0.2, backend_key=WORKER_KEY), data_dir=data
    )
    yield router.url, data
    router.stop()  # type: ignore[operator]
    worker.should_exit = True


def test_tenants_keep_their_own_cached_prefixes_behind_the_router(keyed_router: tuple[str, Path]) -> None:
    url, data = keyed_router
    store = KeyStore(data / "keys.sqlite")
    keys = {
        name: store.create(tenant)[1]
        for name, tenant in (("a1", "alice-fleet"), ("a2", "alice-fleet"), ("b", "bob-fleet"))
    }
    doc = [{"role": "user", "content": "Review: " + "a router keeps each tenant's cache apart. " * 30}]

    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        r = client.chat.completions.create(model=MODEL, messages=doc, max_tokens=1)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(keys["a1"]) == 0
    assert cached(keys["b"]) == 0  # bob never hits alice's blocks on the worker
    assert cached(keys["a2"]) > 100  # alice's second key does
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="cfk_nope_nope", max_retries=0).models.list()
