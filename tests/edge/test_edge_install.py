"""The edge installs like edge software: a virtual environment with only `ctxfuse[edge]`, from its
lock, runs `ctxfuse certs` and `ctxfuse edge` without torch, transformers or xgrammar, and the agent
answers an OpenAI client through a real gateway over mutual TLS. Without the image encoder's files
(built where the cloud extra is installed) images travel as sent and the gateway renders them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from gateway.backends.local import engine_gateway
from gateway.bench.edge.pictures import encoded, traffic_light
from gateway.bench.serve import free_port
from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from gateway.edge.server import build_edge_server

from ..gateway.test_images_api import data_url, image_message
from ..install_env import imported_modules, installed_env, run
from .test_edge_e2e import ENGINE, MODEL, start

CLOUD_SIDE = ("torch", "transformers", "xgrammar", "triton", "gguf", "tokenizers", "accelerate")


@pytest.fixture(scope="module")
def edge_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment with the edge lock and ctxfuse itself (a built wheel, not this checkout)."""
    return installed_env(tmp_path_factory, "edge.lock")


def test_the_edge_environment_holds_no_cloud_side(edge_env: Path) -> None:
    code = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))"
    assert run(edge_env / "bin" / "python", "-c", code, *CLOUD_SIDE).split() == []
    run(edge_env / "bin" / "python", "-m", "pip", "check", "--disable-pip-version-check")


def test_a_cloud_command_on_the_edge_says_which_extra_it_needs(edge_env: Path) -> None:
    proc = subprocess.run(
        [edge_env / "bin" / "ctxfuse", "serve"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "needs `pip install 'ctxfuse[cloud]'`" in proc.stderr and "Traceback" not in proc.stderr


@dataclass
class EdgeRun:
    url: str
    output: Path  # the agent's log and `-X importtime`'s lines (a file: a pipe could fill and stall it)


@pytest.fixture(scope="module")
def edge_run(
    edge_env: Path, loaded_model: LoadedModel, vision_files: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeRun]:
    tmp = tmp_path_factory.mktemp("edge-run")
    ctxfuse = edge_env / "bin" / "ctxfuse"
    tls = tmp / "tls"
    run(ctxfuse, "certs", "init", tls)
    run(ctxfuse, "certs", "server", tls, "--host", "127.0.0.1")
    run(ctxfuse, "certs", "issue", tls, "dev1")

    backend = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    config = GatewayConfig(port=0, edge_host="127.0.0.1", edge_port=0, tls_dir=tls, data_dir=tmp / "gw")
    gateway = engine_gateway(backend, config, ChunkStore(tmp / "chunks.sqlite", 64 * 2**20))
    listener: uvicorn.Server = build_edge_server(gateway)
    gateway_url = f"https://127.0.0.1:{start(listener, 'edge-listener')}"

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CTXFUSE"))}
    env["CTXFUSE_HOME"] = str(tmp / "home")  # a device with no encoder files
    output = tmp / "agent.log"
    with output.open("w") as log:
        python = edge_env / "bin" / "python"
        cmd = [
            python,
            "-X",
            "importtime",
            "-m",
            "ctxfuse",
            "edge",
            "--gateway",
            gateway_url,
            "--name",
            "dev1",
        ]
        agent = subprocess.Popen(
            [*cmd, "--tls-dir", tls, "--port", str(port)],
            env=env,
            stdout=log,  # its log lines
            stderr=log,
            cwd=tmp,  # not this checkout: the installed package runs
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # a hang guard only
    while True:
        assert agent.poll() is None, output.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the agent did not start"
        time.sleep(0.2)
    yield EdgeRun(url, output)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0  # a clean exit on SIGTERM
    listener.should_exit = True
    backend.shutdown()


def client(edge_run: EdgeRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge_run.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_agent_answers_through_the_gateway(edge_run: EdgeRun) -> None:
    assert [m.id for m in client(edge_run).models.list()] == [MODEL]
    reply = client(edge_run).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3, temperature=0
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_without_encoder_files_images_travel_as_sent_and_the_gateway_renders_them(edge_run: EdgeRun) -> None:
    reply = client(edge_run).chat.completions.create(
        model=MODEL, messages=image_message(data_url(encoded(traffic_light()))), max_tokens=2, temperature=0
    )
    assert (
        reply.usage is not None and reply.usage.prompt_tokens > 20
    )  # the image's rendering is in the prompt
    metrics = httpx.get(f"{edge_run.url}/metrics").text
    assert "ctxfuse_edge_images_total 0.0" in metrics.splitlines()


def test_the_agent_never_imported_the_cloud_side(edge_run: EdgeRun) -> None:
    """After the requests above (tests run in file order): what serving them imported counts too."""
    log = edge_run.output.read_text()
    modules = {m.split(".")[0] for m in imported_modules(log)}
    assert {"litestar", "ctxfuse", "edge", "httpx"} <= modules  # importtime's lines were read
    assert not modules & set(CLOUD_SIDE), sorted(modules & set(CLOUD_SIDE))
    assert "image_features_off" in log
