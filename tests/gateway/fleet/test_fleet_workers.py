"""The fleet over real `ctxfuse worker` processes (the real model, on loopback): requests sharing a
long prefix land on the worker that holds it, and spread when it is saturated; a worker killed with
-9 costs no request that had not started streaming, and a stream from it ends with an error event."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.proxy import BACKEND_HEADER
from gateway.backends.fleet.serve import build_fleet_server
from gateway.bench.worker_proc import WorkerProcess
from gateway.config import GatewayConfig

from ..batches import chat_line, lines_of, start, wait

MODEL = "smollm2-135m-instruct"
ENGINE_ARGS = (
    "--dtype", "float32", "--weight-quant", "none", "--kv-cache-memory", "0.25",
    "--max-model-len", "2048", "--max-num-seqs", "2",
)  # fmt: skip
DOCUMENT = (
    "Section {i}. The tenant pays rent on the first day of each month, keeps the garden tidy, and "
    "tells the landlord of any damage within seven days; the landlord repairs the roof and the boiler. "
)

WORKER_KEY = "fleet-test-worker-key"  # the workers' --api-key, the router's backend_key
AUTH = {"Authorization": f"Bearer {WORKER_KEY}"}


@dataclass
class Fleetside:
    url: str
    fleet: Fleet
    workers: dict[str, WorkerProcess]  # backend name -> its process
    killed: str = ""  # the worker the kill test took down

    def chat(self, text: str, **kw: object) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, **kw}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)

    def decisions(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith("ctxfuse_routing_decisions_total{"):
                out[line.split('"')[1]] = float(line.split()[-1])
        return out


@pytest.fixture(scope="module")
def fleetside(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleetside]:
    workers = {f"w{i}": WorkerProcess(gguf_path, MODEL, *ENGINE_ARGS, api_key=WORKER_KEY) for i in range(2)}
    try:
        specs = tuple(BackendSpec(name=n, url=w.wait_ready(), kind="ctxfuse") for n, w in workers.items())
        config = FleetConfig(
            backends=specs, health_interval_s=0.2, cooldown_s=1.0, failures_to_open=2, backend_key=WORKER_KEY
        )
        gateway = GatewayConfig(port=0, data_dir=tmp_path_factory.mktemp("fleet-data"))
        server, fleet = build_fleet_server(config, gateway, gguf_path, random.Random(0))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        port = int(server.servers[0].sockets[0].getsockname()[1])
        yield Fleetside(f"http://127.0.0.1:{port}", fleet, workers)
        server.should_exit = True
        thread.join(timeout=30)
    finally:
        for w in workers.values():
            w.kill()


def document(seed: int, sections: int = 12) -> str:
    return "".join(DOCUMENT.format(i=seed * 100 + i) for i in range(sections))


def wait_for_blocks(side: Fleetside, name: str, at_least: int) -> None:
    deadline = time.monotonic() + 10
    while side.fleet.index.held_by(name) < at_least:
        assert time.monotonic() < deadline, "the worker's block events never arrived"
        time.sleep(0.05)


def test_requests_sharing_a_long_prefix_land_on_the_worker_holding_it(fleetside: Fleetside) -> None:
    doc = document(1)
    first = fleetside.chat(f"{doc}\nWho repairs the roof?")
    assert first.status_code == 200, first.text
    holder = first.headers[BACKEND_HEADER]
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    wait_for_blocks(fleetside, holder, prompt_tokens // 16 - 2)
    for q in ("When is rent due?", "Who keeps the garden?", "How soon is damage reported?"):
        r = fleetside.chat(f"{doc}\n{q}")
        assert r.headers[BACKEND_HEADER] == holder
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prompt_tokens - 64  # all of the document came from the holder's cache
    assert fleetside.decisions().get("affinity_hit", 0) >= 3


def test_a_hot_prefix_spreads_when_its_worker_is_saturated(fleetside: Fleetside) -> None:
    doc = document(2)
    first = fleetside.chat(f"{doc}\nQuestion 0?")
    holder = first.headers[BACKEND_HEADER]
    wait_for_blocks(fleetside, holder, 10)
    before = fleetside.decisions().get("load_spill", 0)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 at once against max_num_seqs 2 each
        replies = list(
            pool.map(lambda i: fleetside.chat(f"{doc}\nQuestion {i}?", max_tokens=16), range(1, 9))
        )
    assert all(r.status_code == 200 for r in replies)
    served_by = {r.headers[BACKEND_HEADER] for r in replies}
    assert served_by == {"w0", "w1"}  # the holder took what it could; the rest spilled
    assert fleetside.decisions().get("load_spill", 0) > before


def _counter(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not want or want in line) and not line.startswith("#"):
            total += float(line.split()[-1])
    return total


def test_the_router_plans_each_request_and_its_worker_runs_it_behind_the_seam(fleetside: Fleetside) -> None:
    """The router templates and tokenizes, meters and streams itself; a worker gets token ids on its
    internal generate route, never the OpenAI body."""
    worker = fleetside.workers["w0"].url

    def on_w0(route: str) -> float:
        text = httpx.get(f"{worker}/metrics", headers=AUTH).text
        return _counter(text, "ctxfuse_http_requests_total", route=route)

    generated_before = on_w0("/internal/v1/generate")
    router_tokens = _counter(httpx.get(f"{fleetside.url}/metrics").text, "ctxfuse_generation_tokens_total")
    replies = [fleetside.chat(f"Seam question {i}?", max_tokens=3, ignore_eos=True) for i in range(4)]
    assert [r.status_code for r in replies] == [200] * 4
    served = [r.headers[BACKEND_HEADER] for r in replies]
    assert on_w0("/internal/v1/generate") - generated_before == served.count("w0")
    assert on_w0("/v1/chat/completions") == 0  # nothing relayed as an OpenAI body
    after = _counter(httpx.get(f"{fleetside.url}/metrics").text, "ctxfuse_generation_tokens_total")
    assert after - router_tokens == 12  # metered by the router, from the outputs it streamed


def test_tokenize_detokenize_and_a_model_are_answered_by_a_worker(fleetside: Fleetside) -> None:
    worker = next(iter(fleetside.workers.values())).url
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    routed = httpx.post(f"{fleetside.url}/tokenize", json={"model": MODEL, "messages": messages})
    direct = httpx.post(f"{worker}/tokenize", json={"model": MODEL, "messages": messages}, headers=AUTH)
    assert routed.status_code == 200 and routed.json() == direct.json()
    assert routed.headers[BACKEND_HEADER] in fleetside.workers
    tokens = routed.json()["tokens"]
    back = httpx.post(f"{fleetside.url}/detokenize", json={"model": MODEL, "tokens": tokens})
    assert "How many tokens is this?" in back.json()["prompt"]
    bad = httpx.post(f"{fleetside.url}/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"  # the worker's 400, as is
    assert httpx.get(f"{fleetside.url}/v1/models/{MODEL}").json()["id"] == MODEL
    missing = httpx.get(f"{fleetside.url}/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_batch_runs_on_the_workers(fleetside: Fleetside) -> None:
    client = openai.OpenAI(base_url=f"{fleetside.url}/v1", api_key="unused", max_retries=0, timeout=60)
    doc = document(3, sections=4)
    # answered before the batch starts: its worker holds the document, and the router knows it
    assert fleetside.chat(f"{doc}\nQuestion 0?").status_code == 200
    lines = [chat_line(f"q{i}", f"{doc}\nQuestion {i}?", max_tokens=4) for i in range(1, 4)]
    batch = wait(client, start(client, lines).id, timeout=120)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 0)
    out = lines_of(client, batch.output_file_id)
    assert sorted(x["custom_id"] for x in out) == ["q1", "q2", "q3"]
    usages = [x["response"]["body"]["usage"] for x in out]
    assert all(u["completion_tokens"] > 0 for u in usages)
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) > 0  # the shared document


def test_a_killed_worker_costs_only_the_stream_it_was_sending(fleetside: Fleetside) -> None:
    """Run last in this module: it kills a worker."""
    stream = httpx.stream(
        "POST",
        f"{fleetside.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        },
        timeout=120,
    )
    with stream as r:
        victim = r.headers[BACKEND_HEADER]
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"content"' in first or '"role"' in first
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            pending = [pool.submit(fleetside.chat, f"{document(3 + i, 4)}\nWhat is due?") for i in range(6)]
            time.sleep(0.3)  # some of them are now waiting on the victim
            fleetside.workers[victim].kill()
            rest = [line for line in lines if line.startswith("data: ")]
            replies = [p.result() for p in pending]
    assert rest and '"error"' in rest[-1]  # the stream ended with an error event ...
    assert not any("[DONE]" in line for line in rest)  # ... never with a clean end
    assert [r.status_code for r in replies] == [200] * 6  # none that had not started failed
    assert {r.headers[BACKEND_HEADER] for r in replies[-2:]} == {"w0", "w1"} - {victim}
    fleetside.killed = victim


def test_a_restarted_worker_is_followed_from_its_new_epoch(fleetside: Fleetside, gguf_path: Path) -> None:
    """After the kill above: a new worker process on the victim's address."""
    name = fleetside.killed
    backend = next(b for b in fleetside.fleet.backends if b.name == name)
    old_epoch, port = backend.epoch, int(backend.url.rsplit(":", 1)[1])
    fleetside.workers[name] = WorkerProcess(gguf_path, MODEL, *ENGINE_ARGS, api_key=WORKER_KEY, port=port)
    fleetside.workers[name].wait_ready()
    deadline = time.monotonic() + 20
    while backend.epoch == old_epoch or not backend.reachable:
        assert time.monotonic() < deadline, "the router never saw the restarted worker"
        time.sleep(0.1)
    assert fleetside.fleet.index.held_by(name) == 0  # what the dead process held is forgotten
    deadline = time.monotonic() + 20
    while backend.circuit.state != "closed":  # a probe request closes its circuit again
        assert fleetside.chat("Hello again").status_code == 200
        assert time.monotonic() < deadline, backend.circuit.state
        time.sleep(0.2)
    assert name in {fleetside.chat(f"Question {i}?").headers[BACKEND_HEADER] for i in range(12)}
