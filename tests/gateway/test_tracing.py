"""Traces (gateway/ops/tracing.py): a router and a worker as two real processes export OTLP over HTTP
to a receiver on loopback, and one trace, the client's, holds the spans of both with their parent
links; with no `OTEL_*` variable nothing is installed at all."""

from __future__ import annotations

import gzip
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, get_args

import httpx
import openai
import pytest
from litestar.types import Receive, Scope, Send
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from gateway.backends.fleet.policy import DecisionKind
from gateway.bench.worker_proc import REPO, WorkerProcess
from gateway.ops import tracing

from .conftest import MODEL

ENGINE_ARGS = ("--dtype", "float32", "--weight-quant", "none", "--kv-cache-memory", "0.25",
               "--max-model-len", "1024", "--max-num-seqs", "2")  # fmt: skip
WORKER_KEY = "tracing-test-worker-key"
PROMPT = "Say the word zeppelin-7f3a."  # must never show in a span


@dataclass(frozen=True, slots=True)
class Received:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf."""

    spans: list[Received]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces":
            self.send_response(404)
            self.end_headers()
            return
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for rs in export.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for scope in rs.scope_spans:
                for s in scope.spans:
                    attrs = {a.key: _value(a.value) for a in s.attributes}
                    self.spans.append(
                        Received(resource["service.name"], s.name, s.trace_id.hex(), s.span_id.hex(),
                                 s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano, attrs)
                    )  # fmt: skip
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def collector() -> Iterator[tuple[str, list[Received]]]:
    spans: list[Received] = []
    handler = type("Collector", (_Collector,), {"spans": spans})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", spans
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def otel_env(monkeypatch: pytest.MonkeyPatch, endpoint: str, service: str) -> dict[str, str]:
    """This process's environment with traces on, as a deployment would set them."""
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", service)
    return dict(os.environ)


def start_router(worker_url: str, data: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "ctxfuse", "serve", "--backend", worker_url, "--port", "0"]
    cmd += ["--data-dir", str(data)]
    env = {**env, "CTXFUSE_BACKEND_KEY": WORKER_KEY}
    env.pop("CTXFUSE_API_KEY", None)
    stderr = (data / "router.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:  # its base_url line, printed once it listens
        if "base_url=" in line:
            return proc, line.split("base_url=")[1].strip().removesuffix("/v1")
    raise RuntimeError(f"the router did not start: {(data / 'router.log').read_text()[-2000:]}")


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 180
    while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the router never found its worker"
        time.sleep(0.1)


def test_one_trace_holds_the_spans_of_router_and_worker_processes(
    gguf_path: Path,
    tmp_path: Path,
    collector: tuple[str, list[Received]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    endpoint, spans = collector
    port = free_port()
    otel_env(monkeypatch, endpoint, "test-worker")
    worker = WorkerProcess(gguf_path, MODEL, *ENGINE_ARGS, api_key=WORKER_KEY, port=port)
    router = None
    try:
        # started together: the router waits for its worker's text side (not ready until then)
        router, url = start_router(
            f"http://127.0.0.1:{port}", tmp_path, otel_env(monkeypatch, endpoint, "test-router")
        )
        worker.wait_ready()
        wait_ready(url)
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=2,
            extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        )
        reply, backend = raw.parse(), raw.headers["x-ctxfuse-backend"]
        assert reply.usage is not None
        router.terminate()  # SIGTERM: each drains and flushes its spans as it exits
        worker.stop()
        assert (router.wait(60), worker.proc.wait()) == (0, 0)
    finally:
        if router is not None and router.poll() is None:
            router.kill()
        worker.kill()

    ours = {s.name: s for s in spans if s.trace_id == trace_id}
    assert set(ours) == {"gateway request", "route", "worker request", "queue", "prefill", "decode"}, [
        (s.service, s.name, s.trace_id) for s in spans
    ]
    assert len([s for s in spans if s.trace_id == trace_id]) == 6  # one attempt, one choice
    gw, route, wr = ours["gateway request"], ours["route"], ours["worker request"]
    queue, prefill, decode = ours["queue"], ours["prefill"], ours["decode"]
    assert {s.service for s in (gw, route)} == {"test-router"}
    assert {s.service for s in (wr, queue, prefill, decode)} == {"test-worker"}
    # the client's span -> gateway request -> route -> worker request -> the engine's phases
    assert gw.parent_id == client_span
    assert route.parent_id == gw.span_id
    assert wr.parent_id == route.span_id
    assert {queue.parent_id, prefill.parent_id, decode.parent_id} == {wr.span_id}
    # the phases back to back inside the worker's request
    assert wr.start_ns <= queue.start_ns <= queue.end_ns == prefill.start_ns
    assert prefill.end_ns == decode.start_ns <= decode.end_ns <= wr.end_ns
    assert gw.attributes["http.route"] == "/v1/chat/completions"
    assert (gw.attributes["http.request.method"], gw.attributes["http.response.status_code"]) == ("POST", 200)
    assert gw.attributes["ctxfuse.tenant"] == "default"
    assert wr.attributes["http.route"] == "/internal/v1/generate"
    assert (route.attributes["ctxfuse.route.attempt"], route.attributes["ctxfuse.route.policy"]) == (
        0,
        "prefix",
    )
    assert route.attributes["ctxfuse.backend"] == backend
    # a worker that was loading when the router started is probed (its circuit half-open)
    assert route.attributes["ctxfuse.route.decision"] in get_args(DecisionKind)
    assert prefill.attributes["ctxfuse.prompt_tokens"] == reply.usage.prompt_tokens
    assert decode.attributes["ctxfuse.output_tokens"] == reply.usage.completion_tokens
    assert decode.attributes["ctxfuse.finish_reason"] == reply.choices[0].finish_reason
    assert all("zeppelin" not in str(v) for s in spans for v in s.attributes.values())


class _App:
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pass


def test_with_no_otel_variable_nothing_is_installed_or_made() -> None:
    if tracing.exporters(os.environ):
        pytest.skip("this shell's OTEL_* variables ask for traces")
    app, backend = _App(), object()
    headers = {"content-type": "application/json"}
    assert tracing.middleware(app, worker=False) is app  # no middleware in the request's path
    assert tracing.traced(backend) is backend  # type: ignore[arg-type]
    with tracing.route_attempt("w0", "v1", "prefix", 0, "least_load", 0, 16) as span:
        tracing.inject(headers)
        tracing.failed(span, "connect")
    assert span is None and headers == {"content-type": "application/json"}
    assert tracing._tracer is None  # no provider, no exporter, no span ever made


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, ()),
        ({"OTEL_SERVICE_NAME": "gw", "OTEL_TRACES_SAMPLER": "always_on"}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp, Console"}, ("otlp", "console")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
        ({"OTEL_SDK_DISABLED": "1", "OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),  # only "true" is true
    ],
)
def test_traces_are_on_only_when_the_otel_variables_name_an_exporter(
    env: dict[str, str], exporters: tuple[str, ...]
) -> None:
    assert tracing.exporters(env) == exporters
