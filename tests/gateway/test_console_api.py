"""The console's API on a real gateway (the default model, on loopback): the page is open and holds
nothing, its data is the operator's only (a tenant's key is refused, 403), keys made through it work
with the OpenAI SDK and stop working once revoked, and a server started open refuses to make keys
(the first would lock every client out)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from cloud.bench.heatmap import HeatmapPanel, render_heatmap
from cloud.serving.in_process import InProcessBackend
from gateway.access.keys import KeyStore

from .conftest import GATEWAY, MODEL, Running, run_in_thread

OPERATOR = "console-operator-key"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def gateway(backend: InProcessBackend, tmp_path: Path) -> Iterator[Running]:
    config = replace(GATEWAY, data_dir=tmp_path, api_key=OPERATOR, bench_results=tmp_path / "bench")
    running = run_in_thread(backend, config)
    yield running
    running.stop()


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_page_is_open_and_loads_only_its_own_files(gateway: Running) -> None:
    page = httpx.get(f"{gateway.url}/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(f"{gateway.url}/console/").text == page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert '<script type="module" src="/console/static/console.js"' in page.text
    script = httpx.get(f"{gateway.url}/console/static/console.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{gateway.url}/console/static/console.css").status_code == 200
    for name in ("index.html", "__init__.py", "..%2Fapi.py", "nothing.js"):  # only the files listed
        missing = httpx.get(f"{gateway.url}/console/static/{name}")
        assert missing.status_code == 404 and missing.json()["error"]["message"], name


def test_the_data_is_the_operators_only(gateway: Running, tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.sqlite")
    _, tenant_key = store.create("acme")
    store.close()
    url = f"{gateway.url}/console/api/snapshot"
    assert httpx.get(url).status_code == 401
    refused = httpx.get(url, headers=_as(tenant_key))
    assert refused.status_code == 403 and "operator" in refused.json()["error"]["message"]
    assert httpx.get(f"{gateway.url}/console/api/keys", headers=_as(tenant_key)).status_code == 403
    made = httpx.post(f"{gateway.url}/console/api/keys", json={"tenant": "x"}, headers=_as(tenant_key))
    assert made.status_code == 403
    snap = httpx.get(url, headers=_as(OPERATOR)).json()
    assert snap["server"]["role"] == "gateway" and snap["server"]["keys_managed"] is True
    assert snap["fleet"] is None and snap["engine"]["num_blocks"] > 0
    assert "ctxfuse_time_to_first_token_seconds_count" in snap["metrics"]

    def operator_usage() -> float:
        metrics = httpx.get(url, headers=_as(OPERATOR)).json()["metrics"]
        return sum(
            v
            for labels, v in metrics.get("ctxfuse_tenant_requests_total", [])
            if labels["tenant"] == "default"
        )

    assert operator_usage() == operator_usage()  # the console's own polling is not a tenant's usage


def test_a_key_made_in_the_console_works_until_it_is_revoked(gateway: Running) -> None:
    keys_url = f"{gateway.url}/console/api/keys"
    body = {"tenant": "acme", "name": "from the console", "rpm": 100, "models": [MODEL]}
    made = httpx.post(keys_url, json=body, headers=_as(OPERATOR))
    assert made.status_code == 201, made.text
    secret = made.json()["key"]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)  # type: ignore[arg-type]
    assert reply.choices[0].message.content is not None
    listed = httpx.get(keys_url, headers=_as(OPERATOR)).json()["data"]
    (row,) = [k for k in listed if k["id"] == made.json()["id"]]
    assert row["tenant"] == "acme" and row["rpm"] == 100 and row["models"] == [MODEL]
    assert "key" not in row and secret not in httpx.get(keys_url, headers=_as(OPERATOR)).text
    snap = httpx.get(f"{gateway.url}/console/api/snapshot", headers=_as(OPERATOR)).json()
    tenants = {labels["tenant"] for labels, _ in snap["metrics"]["ctxfuse_tenant_requests_total"]}
    assert "acme" in tenants  # usage per tenant reaches the console
    revoked = httpx.post(f"{keys_url}/{row['id']}/revoke", headers=_as(OPERATOR))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    deadline = time.monotonic() + 30  # a lookup made before the revocation is cached for seconds
    while True:
        try:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)  # type: ignore[arg-type]
        except openai.AuthenticationError:
            break
        assert time.monotonic() < deadline, "a revoked key still works"
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tenant": "no spaces allowed"}, "tenant"),
        ({"tenant": "acme", "rpm": 0}, "rpm"),
        ({"tenant": "acme", "expires_in_s": -5}, "expires_at"),
        ({"tenant": "acme", "bogus": 1}, "bogus"),
        ({"name": "who"}, "tenant"),
    ],
)
def test_a_bad_key_request_is_a_400_naming_the_field(
    gateway: Running, body: dict[str, object], param: str
) -> None:
    resp = httpx.post(f"{gateway.url}/console/api/keys", json=body, headers=_as(OPERATOR))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_revoking_a_key_that_does_not_exist_is_a_404(gateway: Running) -> None:
    resp = httpx.post(f"{gateway.url}/console/api/keys/000000000000/revoke", headers=_as(OPERATOR))
    assert resp.status_code == 404 and resp.json()["error"]["message"]


def test_an_open_server_shows_its_data_but_makes_no_keys(backend: InProcessBackend, tmp_path: Path) -> None:
    running = run_in_thread(backend, replace(GATEWAY, data_dir=tmp_path))
    try:
        assert httpx.get(f"{running.url}/console/api/snapshot").status_code == 200
        refused = httpx.post(f"{running.url}/console/api/keys", json={"tenant": "acme"})
        assert refused.status_code == 403 and "--api-key" in refused.json()["error"]["message"]
        assert httpx.get(f"{running.url}/console/api/keys").json()["data"] == []
        assert (
            httpx.post(
                f"{running.url}/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1}
            ).status_code
            == 200
        )  # still open
    finally:
        running.stop()


def test_the_long_context_heatmaps_are_listed_and_served_when_present(
    gateway: Running, tmp_path: Path
) -> None:
    listed = httpx.get(f"{gateway.url}/console/api/longctx", headers=_as(OPERATOR)).json()
    assert listed["heatmaps"] == [] and listed["directory"].endswith("longctx")  # none yet: said so
    panel = HeatmapPanel("passkey", ("2K", "4K"), ("0%", "50%"), ((1.0, 0.5), (None, 0.0)))
    (tmp_path / "bench" / "longctx").mkdir(parents=True)
    render_heatmap(tmp_path / "bench" / "longctx" / "heatmap-dense.png", "dense", [panel])
    (tmp_path / "bench" / "longctx" / "results.json").write_text("{}")
    listed = httpx.get(f"{gateway.url}/console/api/longctx", headers=_as(OPERATOR)).json()
    assert listed["heatmaps"] == ["heatmap-dense.png"]
    png = httpx.get(f"{gateway.url}/console/api/longctx/heatmap-dense.png", headers=_as(OPERATOR))
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content == (tmp_path / "bench" / "longctx" / "heatmap-dense.png").read_bytes()
    for name in ("results.json", "..%2F..%2Fkeys.sqlite", "heatmap-none.png"):
        assert (
            httpx.get(f"{gateway.url}/console/api/longctx/{name}", headers=_as(OPERATOR)).status_code == 404
        )
    assert httpx.get(f"{gateway.url}/console/api/longctx/heatmap-dense.png").status_code == 401


def _usage_of(running: Running, tenant: str) -> tuple[float, float, str]:
    """(requests, generated tokens) of `tenant` in `running`'s console, and whose counts they are."""
    snap = httpx.get(f"{running.url}/console/api/snapshot", headers=_as(OPERATOR)).json()
    m = snap["metrics"]
    requests = sum(
        v for labels, v in m.get("ctxfuse_tenant_requests_total", []) if labels["tenant"] == tenant
    )
    tokens = sum(
        v
        for labels, v in m.get("ctxfuse_tenant_tokens_total", [])
        if labels["tenant"] == tenant and labels["kind"] == "generation"
    )
    return requests, tokens, snap["server"]["usage"]


def test_replicas_over_one_redis_show_the_same_keys_and_usage(
    backend: InProcessBackend, redis_url: str, tmp_path: Path
) -> None:
    """A key made in one replica's console is listed (and works) in the other's; a tenant's requests
    on one replica are counted in both consoles."""
    config = replace(GATEWAY, api_key=OPERATOR, redis_url=redis_url)
    a = run_in_thread(backend, replace(config, data_dir=tmp_path / "a"))
    b = run_in_thread(backend, replace(config, data_dir=tmp_path / "b"))
    try:
        made = httpx.post(f"{a.url}/console/api/keys", json={"tenant": "acme"}, headers=_as(OPERATOR))
        assert made.status_code == 201, made.text
        listed = httpx.get(f"{b.url}/console/api/keys", headers=_as(OPERATOR)).json()["data"]
        assert [k["id"] for k in listed] == [made.json()["id"]]
        client = openai.OpenAI(base_url=f"{a.url}/v1", api_key=made.json()["key"], max_retries=0)
        generated = 0
        for _ in range(2):
            reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)  # type: ignore[arg-type]
            assert reply.usage is not None
            generated += reply.usage.completion_tokens
        assert _usage_of(a, "acme")[:2] == (2, generated)  # its own, at once
        deadline = time.monotonic() + 30  # the other's: within a flush (2 s); a hang guard
        while (seen := _usage_of(b, "acme"))[:2] != (2, generated):
            assert time.monotonic() < deadline, f"replica b sees {seen}"
            time.sleep(0.2)
        assert "every replica" in seen[2]
        assert _usage_of(a, "acme")[:2] == (2, generated)  # flushed, not counted twice
    finally:
        a.stop()
        b.stop()
