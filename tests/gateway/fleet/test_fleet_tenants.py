"""Tenants through the fleet router (issue 17): the router checks tenants' keys as the engine gateway
does, authenticates itself to its worker with the worker's key, and names the caller's tenant, so
the worker keeps each tenant's cached prefixes apart and the router still matches them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from cloud.serving.in_process import InProcessBackend
from gateway.access.keys import KeyLimits, KeyStore
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
        # the default partition may already hold the template's first block (other tests share it)
        before = _cached(router.url, first, doc)
        assert _cached(router.url, second, doc) > before + 100  # the whole document, from carol
    finally:
        router.stop()  # type: ignore[operator]


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_router_holds_a_key_to_its_allowed_models(keyed_router: tuple[str, Path]) -> None:
    url, data = keyed_router
    key = KeyStore(data / "keys.sqlite").create("erin-models", KeyLimits(models=("another-model",)))[1]
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _client(url, key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert "may not use the model" in refused.value.message


HELLO = [{"role": "user", "content": "Say hello in five words."}]


def _stream(client: openai.OpenAI, include_usage: bool) -> list[ChatCompletionChunk]:
    options: dict[str, bool] | openai.Omit = {"include_usage": True} if include_usage else openai.omit
    stream = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=400,
        temperature=0,
        stream=True,
        stream_options=options,  # type: ignore[arg-type]
    )
    return list(stream)


def test_tokens_per_minute_through_the_router_count_what_was_used(keyed_router: tuple[str, Path]) -> None:
    url, data = keyed_router
    tpm = 100_000
    client = _client(url, KeyStore(data / "keys.sqlite").create("frank-tpm", KeyLimits(tpm=tpm))[1])
    asked = _stream(client, include_usage=True)
    usage = asked[-1].usage
    assert usage is not None and not asked[-1].choices  # the client asked: its usage chunk arrives
    assert usage.completion_tokens < 400  # the answer ended well before max_tokens
    # the same stream unasked: the router asks for the usage on its own behalf and keeps it to itself
    unasked = _stream(client, include_usage=False)
    assert all(c.choices for c in unasked) and all(c.usage is None for c in unasked)
    assert "".join(c.choices[0].delta.content or "" for c in unasked) == "".join(
        c.choices[0].delta.content or "" for c in asked if c.choices
    )
    last = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=1)
    used = last.parse().usage
    assert used is not None
    # both streams counted at what they used (not at prompt + max_tokens), the last one too
    expected = tpm - 2 * usage.total_tokens - used.total_tokens
    assert int(last.headers["x-ratelimit-remaining-tokens"]) == expected


def test_the_router_refuses_what_cannot_fit_a_keys_minute(keyed_router: tuple[str, Path]) -> None:
    url, data = keyed_router
    client = _client(url, KeyStore(data / "keys.sqlite").create("gina-tpm", KeyLimits(tpm=40))[1])
    long = [{"role": "user", "content": "Summarize: " + "tokens are counted before dispatch. " * 20}]
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=1)  # type: ignore[arg-type]
    assert "tokens per minute" in refused.value.message
    assert refused.value.response.headers.get("retry-after") is not None


def test_embeddings_pass_the_router_within_the_keys_models_and_tokens(keyed_router: tuple[str, Path]) -> None:
    url, data = keyed_router
    store = KeyStore(data / "keys.sqlite")
    _, key = store.create("erin-fleet", KeyLimits(tpm=1000))
    _, narrow = store.create("erin-fleet", KeyLimits(models=("another-model",)))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    first = client.embeddings.create(
        model=MODEL, input=["through the router", "and back"], encoding_format="float"
    )
    assert [len(d.embedding) for d in first.data] == [576, 576]
    second = client.embeddings.with_raw_response.create(model=MODEL, input="again", encoding_format="float")
    used = first.usage.total_tokens + second.parse().usage.total_tokens
    assert second.headers["x-ratelimit-remaining-tokens"] == str(1000 - used)  # settled to real usage
    with pytest.raises(openai.PermissionDeniedError, match="may not use the model"):
        openai.OpenAI(base_url=f"{url}/v1", api_key=narrow, max_retries=0).embeddings.create(
            model=MODEL, input="x"
        )
