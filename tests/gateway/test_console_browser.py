"""The console in a real browser: Debian's chromium, headless, driven by Playwright, against a real
gateway (the default model) and a real router before two `ctxfuse worker` processes. The page loads
with no console errors, each view shows what the server knows, a key made in the page works with the
OpenAI SDK until it is revoked there, and the playground streams an answer and colours a structured
answer's fields by their confidence.

CTXFUSE_CONSOLE_SHOTS=DIR saves a screenshot of each view there (docs/console/ holds the last ones).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import openai
import pytest
from playwright.sync_api import expect

from cloud.bench.heatmap import HeatmapPanel, render_heatmap
from cloud.serving.in_process import InProcessBackend
from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.serve import build_fleet_server
from gateway.bench.worker_proc import WorkerProcess
from gateway.config import GatewayConfig

from .conftest import GATEWAY, MODEL, Running, run_in_thread

CHROMIUM = shutil.which("chromium")
# CI installs chromium (make test's system step): there a missing browser fails, never skips
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"), reason="Debian's chromium is not installed"
)
OPERATOR = "console-operator-key"
WORKER_KEY = "console-test-worker-key"
WORKER_ENGINE = (
    "--dtype", "float32", "--weight-quant", "none", "--kv-cache-memory", "0.25", "--max-model-len", "1024",
)  # fmt: skip
WAIT_MS = 60_000  # a hang guard, not a speed bound
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@dataclass
class Console:
    page: Any  # playwright's Page
    errors: list[str]
    url: str

    def open(self, view: str = "fleet", key: str = OPERATOR) -> None:
        self.page.goto(f"{self.url}/console#{view}")
        self.page.fill("#key", key)
        self.page.click("#signin button")

    def shot(self, name: str) -> None:
        where = os.environ.get("CTXFUSE_CONSOLE_SHOTS")
        if where:  # after two more refreshes, so the charts have points to draw
            self.page.wait_for_timeout(4500)
            Path(where).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(where) / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM or "chromium", args=["--no-sandbox"])
        yield b
        b.close()


def _console(browser: Any, url: str) -> Iterator[Console]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield Console(page, errors, url)
    context.close()
    assert errors == [], f"the console logged errors: {errors}"


@pytest.fixture(scope="module")
def gateway(backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    data = tmp_path_factory.mktemp("console-gateway")
    panels = [
        HeatmapPanel(
            task,
            ("2K", "4K", "8K"),
            ("0%", "50%", "100%"),
            ((1.0, 1.0, 0.5), (1.0, 0.5, 0.0), (1.0, 1.0, None)),
        )
        for task in ("passkey", "needle")
    ]
    (data / "bench" / "longctx").mkdir(parents=True)
    render_heatmap(data / "bench" / "longctx" / "heatmap-dense.png", "dense (a drawn example)", panels)
    config = replace(GATEWAY, data_dir=data, api_key=OPERATOR, bench_results=data / "bench")
    running = run_in_thread(backend, config)
    yield running
    running.stop()


@pytest.fixture
def console(browser: Any, gateway: Running) -> Iterator[Console]:
    yield from _console(browser, gateway.url)


def test_the_console_loads_without_errors_and_shows_the_gateway_and_its_engine(console: Console) -> None:
    page = console.page
    page.goto(f"{console.url}/console")
    page.wait_for_selector("#notice:not([hidden])")  # asks for a key before it asks the server
    assert "Sign in" in page.inner_text("#notice")
    page.fill("#key", OPERATOR)
    page.click("#signin button")
    expect(page.locator("#server-line")).to_contain_text("ready")
    assert "gateway" in page.inner_text("#server-line")
    assert page.is_visible("#fleet-none")  # no fleet behind a gateway with its own engine
    console.shot("fleet-gateway")
    page.click("#tabs button[data-view=engine]")
    page.wait_for_selector("#engine tbody tr")
    assert "KV cache in use" in page.inner_text("#engine")
    assert "float32" in page.inner_text("#engine")  # what the KV is stored as
    heatmap = page.locator("#heatmaps img")
    expect(heatmap).to_have_count(1)
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=heatmap.element_handle())
    console.shot("engine")


def test_a_key_made_in_the_console_works_with_the_sdk_until_revoked_there(console: Console) -> None:
    page = console.page
    console.open("tenants")
    page.fill("#new-key input[name=tenant]", "acme")
    page.fill("#new-key input[name=name]", "made in the browser")
    page.fill("#new-key input[name=rpm]", "120")
    page.click("#new-key button[type=submit]")
    page.wait_for_selector("#secret:not([hidden])")
    secret = page.inner_text("#secret-value").strip()
    assert secret.startswith("cfk_")
    client = openai.OpenAI(base_url=f"{console.url}/v1", api_key=secret, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content is not None
    key_id = secret.split("_")[1]
    row = f"#keys tr[data-key='{key_id}']"
    page.wait_for_selector(row)
    assert "acme" in page.inner_text(row) and "active" in page.inner_text(row)
    page.wait_for_selector("#usage tr[data-tenant=acme]")  # its usage, from the metrics
    console.shot("tenants")
    page.click(f"{row} button.revoke")
    expect(page.locator(row)).to_contain_text("revoked")
    deadline = time.monotonic() + 30  # a lookup made before the revocation is cached for seconds
    while True:
        try:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
        except openai.AuthenticationError:
            break
        assert time.monotonic() < deadline, "a key revoked in the console still works"
        time.sleep(0.2)


def test_a_bad_key_request_shows_the_servers_reason(console: Console) -> None:
    page = console.page
    console.open("tenants")
    page.fill("#new-key input[name=tenant]", "not a tenant name")
    page.click("#new-key button[type=submit]")
    page.wait_for_selector("#notice:not([hidden])")
    assert "tenant" in page.inner_text("#notice") and page.is_hidden("#secret")
    # the browser logs the 400 it was sent, which is this test's point; nothing else may be logged
    assert sum("status of 400" in e for e in console.errors) == 1
    console.errors[:] = [e for e in console.errors if "status of 400" not in e]


def test_the_playground_streams_an_answer_and_colours_a_structured_one(console: Console) -> None:
    page = console.page
    console.open("playground")
    page.wait_for_selector(f"#model option[value='{MODEL}']", state="attached")
    # count the answer's updates: a streamed answer is written piece by piece, not once
    page.evaluate(
        """() => { window.updates = 0; new MutationObserver((m) => { window.updates += m.length; })
        .observe(document.querySelector('#transcript'),
                 {subtree: true, childList: true, characterData: true}); }"""
    )
    page.fill("#max-tokens", "24")
    page.fill("#prompt", "Count from one to ten in words.")
    page.click("#send")
    page.wait_for_selector(".turn .meta .cached")
    first = page.locator(".turn").nth(0)
    assert first.locator(".assistant").inner_text().strip()
    assert page.evaluate("window.updates") > 3
    page.fill("#prompt", "And back down to one.")  # the second turn finds the first in the cache
    page.click("#send")
    page.wait_for_selector(".turn:nth-child(2) .meta .cached")
    cached = page.locator(".turn").nth(1).locator(".cached").inner_text()
    assert int(cached.split(",")[1].split()[0]) > 0, cached
    console.shot("playground")
    page.click("#clear")
    page.click("details:has(#schema) summary")
    page.fill("#schema", json.dumps(SCHEMA))
    page.fill("#max-tokens", "40")
    page.fill("#prompt", "Name a large city and its population.")
    page.click("#send")
    page.wait_for_selector(".assistant.structured .leaf[data-p]")
    leaves = page.locator(".leaf[data-p]")
    pointers = {leaves.nth(i).get_attribute("data-pointer") for i in range(leaves.count())}
    assert pointers == {"/city", "/population"}
    probabilities = [float(leaves.nth(i).get_attribute("data-p")) for i in range(leaves.count())]
    assert all(0 < p <= 1 for p in probabilities), probabilities
    console.shot("playground-structured")
    page.click("#clear")
    page.fill("#schema", "")
    page.click("details:has(#tools) summary")
    page.fill("#tools", json.dumps([WEATHER_TOOL]))
    page.select_option("#tool-choice", "required")
    page.fill("#prompt", "What is the weather in Paris?")
    page.click("#send")
    page.wait_for_selector(".turn .meta .cached")
    assert page.locator(".turn .assistant").inner_text().startswith("get_weather(")


@pytest.fixture(scope="module")
def router(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router (with the operator's key) before two real workers."""
    workers = [WorkerProcess(gguf_path, MODEL, *WORKER_ENGINE, api_key=WORKER_KEY) for _ in range(2)]
    try:
        specs = tuple(
            BackendSpec(name=f"w{i}", url=w.wait_ready(), kind="ctxfuse") for i, w in enumerate(workers)
        )
        config = FleetConfig(backends=specs, health_interval_s=0.2, backend_key=WORKER_KEY)
        data = tmp_path_factory.mktemp("console-router")
        gateway = GatewayConfig(port=0, data_dir=data, api_key=OPERATOR)
        server, _ = build_fleet_server(config, gateway, gguf_path, random.Random(0))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{int(server.servers[0].sockets[0].getsockname()[1])}"
        server.should_exit = True
        thread.join(timeout=30)
    finally:
        for w in workers:
            w.stop()


def test_the_fleet_view_shows_two_real_workers(browser: Any, router: str) -> None:
    for console in _console(browser, router):
        page = console.page
        client = openai.OpenAI(base_url=f"{router}/v1", api_key=OPERATOR, max_retries=0)
        for i in range(3):  # some traffic, so the routing has held prefixes to show
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=2
            )
        console.open("fleet")
        expect(page.locator("#backends tbody tr")).to_have_count(2)
        expect(page.locator("#backends tbody tr td:nth-child(5)")).to_have_text(["up", "up"])
        assert "router" in page.inner_text("#server-line")
        names = page.locator("#backends tbody tr").evaluate_all("rows => rows.map(r => r.dataset.backend)")
        assert sorted(names) == ["w0", "w1"]
        assert "closed" in page.inner_text("#backends")
        expect(page.locator("#versions tbody tr")).not_to_have_count(0)
        console.shot("fleet-router")
