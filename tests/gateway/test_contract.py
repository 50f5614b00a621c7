"""One contract, three ways to run the engine behind the same routes: in the gateway's process, in an
engine process of its own (serve's default), and behind a router over a real `ctxfuse worker` (whose
engine is a child process too, and whose router holds no model file). Each test runs against all
three: streaming, n, logprobs, constraints, an abort when the client leaves, the refusals' shapes,
embeddings, and a dead engine that fails requests instead of hanging them.

Greedy answers are compared across the three: the same weights and the same kernels must write the
same tokens whichever process runs them."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import openai
import pytest

from cloud.serving.process import ProcessBackend
from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.serve import build_fleet_server
from gateway.bench.worker_proc import WorkerProcess
from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from shared.fleet_protocol import WorkerState

from .conftest import ENGINE, GATEWAY, MODEL, Served, run_in_thread

WORKER_ARGS = (
    "--dtype",
    "float32",
    "--weight-quant",
    "none",
    "--kv-cache-memory",
    "0.5",
    "--max-model-len",
    "2048",
)  # fmt: skip  (ENGINE's, as a worker's command line)
WORKER_KEY = "contract-worker-key"
USER = [{"role": "user", "content": "Name three colours."}]
KINDS = ("in_process", "engine_process", "fleet")


@dataclass
class Target:
    """One way of running the engine, as a client and a test see it."""

    kind: str
    url: str
    running: Callable[[], int]  # requests the engine holds (running or waiting)
    generated: Callable[[], float]  # tokens the engine has generated so far

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def post(self, path: str, body: dict[str, object]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=120)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def _served_target(kind: str, url: str) -> Target:
    def metrics() -> str:
        return httpx.get(f"{url}/metrics", timeout=10).text

    return Target(
        kind,
        url,
        lambda: int(
            _metric(metrics(), "ctxfuse_requests_running") + _metric(metrics(), "ctxfuse_requests_waiting")
        ),
        lambda: _metric(metrics(), "ctxfuse_generation_tokens"),
    )


@dataclass
class Fleetside:
    worker: WorkerProcess
    server: GatewayServer
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.worker.stop()


def start_fleet(gguf_path: Path, data_dir: Path) -> tuple[Fleetside, Target]:
    worker = WorkerProcess(gguf_path, MODEL, *WORKER_ARGS, api_key=WORKER_KEY)
    url = worker.wait_ready()
    config = FleetConfig(
        backends=(BackendSpec(name="w0", url=url, kind="ctxfuse"),),
        health_interval_s=0.2,
        backend_key=WORKER_KEY,
    )
    server, _ = build_fleet_server(config, GatewayConfig(port=0, data_dir=data_dir), None, random.Random(0))
    thread = threading.Thread(target=server.run, daemon=True, name="contract-router")
    thread.start()
    deadline = time.monotonic() + 60  # a hang guard only
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the router did not start"
        time.sleep(0.02)
    router = f"http://127.0.0.1:{server.bound_port}"
    while httpx.get(f"{router}/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the router never took its worker"
        time.sleep(0.1)

    def state() -> WorkerState:
        import msgspec

        resp = httpx.get(f"{url}/internal/v1/state", headers=worker.auth, timeout=10)
        return msgspec.json.decode(resp.content, type=WorkerState)

    def generated() -> float:
        return _metric(
            httpx.get(f"{url}/metrics", headers=worker.auth, timeout=10).text, "ctxfuse_generation_tokens"
        )

    side = Fleetside(worker, server, thread)
    return side, Target("fleet", router, lambda: state().load.running + state().load.waiting, generated)


@pytest.fixture(scope="module")
def engine_process_target(gguf_path: Path) -> Iterator[Target]:
    backend = ProcessBackend(replace(ENGINE, model=str(gguf_path)))
    running = run_in_thread(backend, GATEWAY)
    yield _served_target("engine_process", running.url)
    running.stop()
    backend.shutdown()


@pytest.fixture(scope="module")
def fleet_target(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    side, target = start_fleet(gguf_path, tmp_path_factory.mktemp("contract-router"))
    yield target
    side.stop()


@pytest.fixture(params=KINDS)
def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "in_process":
        served: Served = request.getfixturevalue("served")
        return _served_target("in_process", served.url)
    return request.getfixturevalue(f"{request.param}_target")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def greedy_reference(served: Served) -> str:
    """The in-process engine's greedy answer, which every other way must write too."""
    reply = (
        _served_target("in_process", served.url)
        .client()
        .chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    )
    return reply.choices[0].message.content or ""


def test_a_stream_writes_the_greedy_answer_with_usage(target: Target, greedy_reference: str) -> None:
    stream = target.client().chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_reference
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_n_choices_each_with_its_index(target: Target) -> None:
    reply = target.client().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage is not None and reply.usage.completion_tokens == 12


def test_logprobs_name_each_token_with_its_alternatives(target: Target, greedy_reference: str) -> None:
    reply = target.client().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 12
    assert "".join(t.token for t in content) == greedy_reference
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-4  # greedy: the chosen token is the top one


def test_a_schema_constrains_the_answer(target: Target) -> None:
    schema = {
        "type": "object",
        "properties": {
            "colour": {"type": "string", "enum": ["red", "green", "blue"]},
            "count": {"type": "integer"},
        },
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    reply = target.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a colour and a number, as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": schema, "strict": True},
        },
    )
    value = json.loads(reply.choices[0].message.content or "")
    assert value["colour"] in ("red", "green", "blue") and isinstance(value["count"], int)
    chosen = target.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "max_tokens": 8, "guided_choice": ["yes", "no"], "temperature": 0},
    )
    assert chosen.status_code == 200 and chosen.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_client_that_leaves_aborts_its_request(target: Target) -> None:
    before = target.generated()
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{target.url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # one token arrived: now leave
    deadline = time.monotonic() + 120  # a hang guard only
    while target.running():
        assert time.monotonic() < deadline, "the abandoned request still runs"
        time.sleep(0.05)
    assert target.generated() - before < 1500  # stopped, not run to its max_tokens


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"temperature": 3}, 400, "decimal_above_max_value", "temperature"),
        ({"bogus_field": 1}, 400, "unknown_parameter", "bogus_field"),
        ({"max_tokens": 5000}, 400, "context_length_exceeded", "max_tokens"),
        ({"guided_regex": "(ab"}, 400, "invalid_regex", "guided_regex"),
        ({"model": "no-such-model"}, 404, "model_not_found", "model"),
    ],
)
def test_refusals_have_the_same_shape_everywhere(
    target: Target, body: dict[str, object], status: int, code: str, param: str
) -> None:
    resp = target.post("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 4, **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["message"] and error["type"]


def test_embeddings_are_the_same_vectors_everywhere(target: Target, served: Served) -> None:
    ask = {"model": MODEL, "input": ["an engine behind a seam", "hi"]}
    ours = target.client().embeddings.create(**ask)  # type: ignore[arg-type]
    reference = _served_target("in_process", served.url).client().embeddings.create(**ask)  # type: ignore[arg-type]
    assert [d.index for d in ours.data] == [0, 1] and ours.usage == reference.usage
    for a, b in zip(ours.data, reference.data, strict=True):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-5


@pytest.mark.parametrize("kind", ["engine_process", "fleet"])
def test_a_dead_engine_fails_requests_instead_of_hanging_them(
    kind: str, gguf_path: Path, tmp_path: Path
) -> None:
    """The in-process engine's death is tests/gateway/test_engine_death.py's: its thread cannot be
    killed from outside. Here the engine process, or the worker, is killed with -9."""
    if kind == "engine_process":
        backend = ProcessBackend(replace(ENGINE, model=str(gguf_path)))
        running = run_in_thread(backend, GATEWAY)
        url, kill, stop = running.url, lambda: backend._process.kill(), running.stop
    else:
        side, target = start_fleet(gguf_path, tmp_path)
        url, kill, stop = target.url, side.worker.kill, side.stop
    try:
        kill()
        deadline = time.monotonic() + 60  # a hang guard only
        while httpx.get(f"{url}/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "still ready with its engine gone"
            time.sleep(0.1)
        resp = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": USER}, timeout=60)
        assert resp.status_code in (502, 503), resp.text
        error = resp.json()["error"]
        assert error["message"] and error["type"] and error["code"]
    finally:
        stop()
        if kind == "engine_process":
            backend.shutdown()
