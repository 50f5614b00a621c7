"""Tenants through the fleet router (issue 17): the router checks tenants' keys as the engine gateway
does, authenticates itself to its worker with the worker's key, and names the caller's tenant, so
the worker keeps each tenant's cached prefixes apart and the router still matches them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.access.keys import KeyStore
from gateway.backends.engine import InProcessBackend
from gateway.backends.fleet.config import BackendSpec, FleetConfig

from ..conftest import MODEL
from .stub_fleet import Running, run_fleet
from .test_forwarded_paths import WORKER_KEY, Seen, _start_worker


@pytest.fixture(scope="module")
def worker_spec(backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendSpec]:
    worker = _start_worker(backend, tmp_path_factory.mktemp("worker"), Seen())
    yield BackendSpec(name="w", url=f"http://127.0.0.1:{worker.bound_port}", kind="ctxfuse")
    worker.should_exit = True


def _router(spec: BackendSpec, data: Path, share: bool = False) -> Running:
    config = FleetConfig(backends=(spec,), health_interval_s=0.2, backend_key=WORKER_KEY)
    return run_fleet(config, data_dir=data, share_prefix_cache=share)


@pytest.fixture(scope="module")
def keyed_router(
    worker_spec: BackendSpec, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    data = tmp_path_factory.mktemp("router")
    router = _router(worker_spec, data)
    yield router.url, data
    router.stop()  # type: ignore[operator]


def _cached(url: str, key: str, doc: list[dict[str, str]]) -> int:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=doc, max_tokens=1)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


def test_tenants_keep_their_own_cached_prefixes_behind_the_router(keyed_router: tuple[str, Path]) -> None:
    url, data = keyed_router
    store = KeyStore(data / "keys.sqlite")
    keys = {
        name: store.create(tenant)[1]
        for name, tenant in (("a1", "alice-fleet"), ("a2", "alice-fleet"), ("b", "bob-fleet"))
    }
    doc = [{"role": "user", "content": "Review: " + "a router keeps each tenant's cache apart. " * 30}]
    assert _cached(url, keys["a1"], doc) == 0
    assert _cached(url, keys["b"], doc) == 0  # bob never hits alice's blocks on the worker
    assert _cached(url, keys["a2"], doc) > 100  # alice's second key does
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="cfk_nope_nope", max_retries=0).models.list()


def test_a_router_told_to_share_the_cache_lets_tenants_reuse_each_others_prefixes(
    worker_spec: BackendSpec, tmp_path: Path
) -> None:
    router = _router(worker_spec, tmp_path, share=True)  # serve --share-prefix-cache
    try:
        store = KeyStore(tmp_path / "keys.sqlite")
        first, second = store.create("carol-shared")[1], store.create("dave-shared")[1]
        doc = [{"role": "user", "content": "Shared: " + "one tenant's prefix serves another here. " * 30}]
        assert _cached(router.url, first, doc) == 0
        assert _cached(router.url, second, doc) > 100
    finally:
        router.stop()  # type: ignore[operator]
