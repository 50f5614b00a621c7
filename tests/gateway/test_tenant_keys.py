"""Tenants' API keys (issue 17): stored hashed, created, listed, rotated and revoked with `ctxfuse
keys`, and enforced by the real gateway on loopback (the default model, the official `openai`
client): who may call, which models, requests and tokens per minute (counted from real usage) and
requests in flight, answered 429 with Retry-After and OpenAI's x-ratelimit-* headers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.access.keys import KeyLimits, KeyStore

from .conftest import MODEL, Running

HI = [{"role": "user", "content": "Hi"}]


def test_keys_are_stored_hashed_and_revoked_expired_or_rotated_keys_stop_working(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.sqlite")
    record, secret = store.create("acme", KeyLimits(rpm=5), name="ci")
    other, _ = store.create("globex")
    assert store.lookup(secret) == record and record.tenant == "acme" and record.limits.rpm == 5
    assert store.lookup(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert store.lookup("sk-" + secret) is None
    store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    # never in plaintext: the key, nor its secret part (cfk_<id>_<secret>; the secret may hold "_")
    assert secret.encode() not in raw and secret.split("_", 2)[2].encode() not in raw
    store = KeyStore(tmp_path / "keys.sqlite")
    assert [k.id for k in store.list()] == [record.id, other.id]
    assert [k.id for k in store.list("globex")] == [other.id]
    new, new_secret = store.rotate(record.id)
    assert store.lookup(secret) is None and store.lookup(new_secret) == new
    assert (new.tenant, new.limits, new.name) == ("acme", record.limits, "ci")
    store.revoke(new.id)
    assert store.lookup(new_secret) is None
    _, short = store.create("acme", expires_at=time.time() + 60)
    assert store.lookup(short) is not None and store.lookup(short, now=time.time() + 61) is None


def test_a_key_write_is_on_disk_before_it_is_acknowledged(tmp_path: Path) -> None:
    # synchronous=FULL (2) in WAL: an acknowledged revocation survives power loss (NORMAL, 1, may
    # lose the last commits and bring a revoked key back)
    store = KeyStore(tmp_path / "keys.sqlite")
    assert store._db.execute("PRAGMA synchronous").fetchone() == (2,)
    assert store._db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    store.close()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ctxfuse", "keys", *argv], capture_output=True, text=True, timeout=120
    )


def test_the_keys_command_shows_the_secret_once(tmp_path: Path) -> None:
    made = _cli("create", "--data-dir", str(tmp_path), "--tenant", "acme", "--rpm", "3", "--models", "a,b")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip().splitlines()[-1]
    key = KeyStore(tmp_path / "keys.sqlite").lookup(secret)
    assert key is not None and key.limits == KeyLimits(models=("a", "b"), rpm=3)
    listed = _cli("list", "--data-dir", str(tmp_path))
    assert key.id in listed.stdout and secret not in listed.stdout and "rpm=3" in listed.stdout
    assert _cli("revoke", "--data-dir", str(tmp_path), key.id).returncode == 0
    assert KeyStore(tmp_path / "keys.sqlite").lookup(secret) is None
    bad = _cli("create", "--data-dir", str(tmp_path), "--tenant", "../x")
    assert bad.returncode != 0 and "tenant" in bad.stderr


def _client(running: Running, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_only_known_keys_get_in_and_a_key_keeps_to_its_models(keyed: tuple[Running, KeyStore]) -> None:
    running, store = keyed
    _, key = store.create("acme")
    _, narrow = store.create("acme", KeyLimits(models=("another-model",)))
    assert _client(running, key).chat.completions.create(model=MODEL, messages=HI, max_tokens=1).choices
    assert _client(running, "admin-shortcut").models.list().data  # --api-key still works
    for wrong in ("cfk_000000000000_nope", key + "x", "admin-shortcu"):
        with pytest.raises(openai.AuthenticationError):
            _client(running, wrong).models.list()
    missing = httpx.get(f"{running.url}/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError, match="may not use the model"):
        _client(running, narrow).chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert httpx.get(f"{running.url}/health").status_code == 200  # probes stay open


def test_n_plus_one_requests_in_a_minute_get_exactly_one_429(keyed: tuple[Running, KeyStore]) -> None:
    running, store = keyed
    _, key = store.create("acme", KeyLimits(rpm=3))
    _, other = store.create("globex", KeyLimits(rpm=3))
    client = _client(running, key)
    statuses = []
    for _ in range(4):
        try:
            raw = client.models.with_raw_response.list()
            statuses.append(raw.http_response.status_code)
            assert raw.headers["x-ratelimit-limit-requests"] == "3"
        except openai.RateLimitError as err:
            statuses.append(429)
            assert err.code == "rate_limit_exceeded" and "3 requests per minute" in err.message
            assert 1 <= int(err.response.headers["retry-after"]) <= 60
            assert err.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert statuses == [200, 200, 200, 429]
    assert _client(running, other).models.list().data  # another key's minute is its own


def test_tokens_per_minute_are_counted_from_real_usage(keyed: tuple[Running, KeyStore]) -> None:
    running, store = keyed
    _, key = store.create("acme", KeyLimits(tpm=400))
    client = _client(running, key)
    first = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8)
    assert first.usage is not None
    used = first.usage.total_tokens  # reserved as prompt + 8, settled to what it used
    second = client.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=1)
    left = 400 - used - second.parse().usage.total_tokens  # type: ignore[union-attr]
    assert second.headers["x-ratelimit-limit-tokens"] == "400"
    assert second.headers["x-ratelimit-remaining-tokens"] == str(left)  # after this request's own
    with pytest.raises(openai.RateLimitError, match="more than this key's 400 tokens per minute"):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=500)
    with pytest.raises(openai.RateLimitError, match="400 tokens per minute reached") as err:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=left)  # prompt + left > left
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_a_request_the_engine_refuses_at_submit_is_charged_nothing(keyed: tuple[Running, KeyStore]) -> None:
    """A regex that does not compile is refused when the engine takes the request, after the key's
    tokens were reserved: the reservation goes back, whole."""
    running, store = keyed
    _, key = store.create("acme", KeyLimits(tpm=400))
    client = _client(running, key)
    for _ in range(3):  # 3 x (prompt + 300) would not fit a 400-token minute if any were charged
        with pytest.raises(openai.BadRequestError, match="regex"):
            client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=300, extra_body={"guided_regex": "(ab"}
            )
    reply = client.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=300)
    used = reply.parse().usage.total_tokens  # type: ignore[union-attr]
    assert reply.headers["x-ratelimit-remaining-tokens"] == str(400 - used)


def test_requests_in_flight_are_capped_per_key(keyed: tuple[Running, KeyStore]) -> None:
    running, store = keyed
    _, key = store.create("acme", KeyLimits(max_concurrent=1))
    client = _client(running, key)
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=64, stream=True)
    next(iter(stream))  # the first request is running
    with pytest.raises(openai.RateLimitError, match="1 requests in flight"):
        client.models.list()
    stream.close()
    deadline = time.monotonic() + 30
    while True:  # the slot frees once the server sees the stream end
        try:
            assert client.models.list().data
            break
        except openai.RateLimitError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_one_tenant_never_hits_another_tenants_cached_prefix(keyed: tuple[Running, KeyStore]) -> None:
    """Before: `cached_tokens` (and TTFT) told one caller whether another had sent a prompt prefix."""
    running, store = keyed
    # tenants of their own: the engine is the session's, and a tenant's earlier requests (the chat
    # template's first block) would be cached hits of its own
    _, alice = store.create("alice-cache")
    _, alice2 = store.create("alice-cache")
    _, bob = store.create("bob-cache")
    doc = [{"role": "user", "content": "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 30}]

    def cached(key: str) -> int:
        r = _client(running, key).chat.completions.create(model=MODEL, messages=doc, max_tokens=1)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(alice) == 0
    assert cached(bob) == 0  # the same prompt, another tenant: nothing of alice's is reused
    assert cached(alice2) > 100  # the same tenant under another key shares its own cache


def test_files_batches_and_idempotency_keys_belong_to_their_tenant(keyed: tuple[Running, KeyStore]) -> None:
    """Before: anyone with the one key (or any enrolled device) listed, read, cancelled and deleted
    every other caller's files and batches."""
    running, store = keyed
    _, a_key = store.create("alice")
    _, b_key = store.create("bob")
    alice, bob = _client(running, a_key), _client(running, b_key)
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'
    idem = {"Idempotency-Key": "same-key"}
    a_file = alice.files.create(file=("a.jsonl", line), purpose="batch", extra_headers=idem)
    b_file = bob.files.create(file=("a.jsonl", line), purpose="batch", extra_headers=idem)
    assert a_file.id != b_file.id  # one key, two tenants: two files, no replay of the other's
    a_batch = alice.batches.create(
        input_file_id=a_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert [f.id for f in bob.files.list()] == [b_file.id]
    assert all(b.id != a_batch.id for b in bob.batches.list())
    for attempt in (
        lambda: bob.files.retrieve(a_file.id),
        lambda: bob.files.content(a_file.id),
        lambda: bob.files.delete(a_file.id),
        lambda: bob.batches.retrieve(a_batch.id),
        lambda: bob.batches.cancel(a_batch.id),
        lambda: bob.batches.create(
            input_file_id=a_file.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert alice.files.retrieve(a_file.id).id == a_file.id  # still there, untouched
    assert alice.batches.retrieve(a_batch.id).status != "cancelling"


def test_a_batch_runs_in_its_owners_cache_partition(keyed: tuple[Running, KeyStore]) -> None:
    running, store = keyed
    # tenants of their own: the engine is the session's, and a tenant's earlier requests (the chat
    # template's first block) would be cached hits of its own
    _, a_key = store.create("alice-batch")
    _, b_key = store.create("bob-batch")
    alice, bob = _client(running, a_key), _client(running, b_key)
    doc = [{"role": "user", "content": "Batch: " + "every line runs as the tenant that sent it. " * 30}]
    body = {"model": MODEL, "messages": doc, "max_tokens": 1}
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body})
    f = alice.files.create(file=("in.jsonl", line.encode()), purpose="batch")
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := alice.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline
        time.sleep(0.1)

    def cached(client: openai.OpenAI) -> int:
        r = client.chat.completions.create(model=MODEL, messages=doc, max_tokens=1)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(bob) == 0  # the batch's blocks are alice's
    assert cached(alice) > 100


def test_metrics_count_each_tenants_requests_and_tokens(keyed: tuple[Running, KeyStore]) -> None:
    running, keys = keyed
    _, acme = keys.create("acme")
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=acme, max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    assert reply.usage is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{running.url}/v1", api_key="cfk_000000000000_nope", max_retries=0
        ).models.list()
    lines = httpx.get(f"{running.url}/metrics", timeout=30).text.splitlines()

    def value(prefix: str) -> float:
        return sum(float(x.split()[-1]) for x in lines if x.startswith(prefix))

    assert value('ctxfuse_tenant_requests_total{status="200",tenant="acme"}') == 1
    assert value('ctxfuse_tenant_tokens_total{kind="prompt",tenant="acme"}') == reply.usage.prompt_tokens
    assert (
        value('ctxfuse_tenant_tokens_total{kind="generation",tenant="acme"}') == reply.usage.completion_tokens
    )
    assert value('ctxfuse_tenant_requests_total{status="401"') == 0  # no principal: no tenant to count
