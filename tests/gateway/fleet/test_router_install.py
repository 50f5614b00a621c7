"""The router installs as a router: a virtual environment with only `ctxfuse[router]`, from its lock,
runs `ctxfuse serve --backend URL` without torch, transformers, xgrammar, triton or gguf. Started
before its worker, it says it is not ready; once a real worker answers, it takes the worker's
tokenizer and chat template (it holds no model file) and serves chat, streaming, the Responses API,
embeddings and a batch through it. Neither `-X importtime` nor its memory map shows an engine
module or libtorch, after all of that."""

from __future__ import annotations

import io
import json
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

from gateway.bench.serve import free_port
from gateway.bench.worker_proc import WorkerProcess

from ...install_env import imported_modules, installed_env
from .test_fleet_workers import ENGINE_ARGS, MODEL

ENGINE_SIDE = ("torch", "transformers", "xgrammar", "triton", "gguf", "accelerate", "safetensors")
ENGINE_CODE = ("cloud.engine.core", "cloud.serving", "cloud.model.llama", "cloud.model.loading", "kernels")
WORKER_KEY = "router-install-worker-key"


@dataclass
class Router:
    url: str
    proc: subprocess.Popen[bytes]
    output: Path  # its log and `-X importtime`'s lines (a file: a pipe could fill and stall it)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def status(self, path: str) -> int:
        return httpx.get(f"{self.url}{path}", timeout=5).status_code


def wait_for(check: object, what: str, proc: subprocess.Popen[bytes], output: Path) -> None:
    deadline = time.monotonic() + 180  # a hang guard only
    while True:
        assert proc.poll() is None, output.read_text()[-3000:]
        try:
            if check():  # type: ignore[operator]
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what}: {output.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def router(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    env_root = installed_env(tmp_path_factory, "router.lock")
    tmp = tmp_path_factory.mktemp("router-run")
    worker_port, port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CTXFUSE"))}
    env["CTXFUSE_HOME"] = str(tmp / "home")  # no model file and no cache: the worker sends what it needs
    env["CTXFUSE_BACKEND_KEY"] = WORKER_KEY
    output = tmp / "router.log"
    with output.open("w") as log:
        cmd = [env_root / "bin" / "python", "-X", "importtime", "-m", "ctxfuse", "serve"]
        cmd += ["--backend", f"http://127.0.0.1:{worker_port}", "--port", str(port), "--data-dir", tmp / "gw"]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=tmp)
    router = Router(f"http://127.0.0.1:{port}", proc, output)
    worker = None
    try:
        wait_for(lambda: router.status("/health") == 200, "the router did not start", proc, output)
        # up before its worker: alive, not ready, and nothing it could answer with yet
        assert router.status("/ready") == 503
        worker = WorkerProcess(gguf_path, MODEL, *ENGINE_ARGS, api_key=WORKER_KEY, port=worker_port)
        worker.wait_ready()
        wait_for(lambda: router.status("/ready") == 200, "the router never took its worker", proc, output)
        yield router
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        if worker is not None:
            worker.stop()
    assert code == 0


def test_the_router_environment_holds_no_engine(router: Router) -> None:
    python = Path(router.proc.args[0])  # type: ignore[index]
    code = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))"
    found = subprocess.run([python, "-c", code, *ENGINE_SIDE], capture_output=True, text=True, check=True)
    assert found.stdout.split() == []


def test_chat_and_a_stream_through_the_router(router: Router) -> None:
    client = router.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage is not None
    assert reply.usage.completion_tokens == 3
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_the_responses_api_through_the_router(router: Router) -> None:
    response = router.client().responses.create(model=MODEL, input="Say hi.", max_output_tokens=3)
    assert response.status in ("completed", "incomplete") and response.output_text


def test_embeddings_through_the_router(router: Router) -> None:
    out = router.client().embeddings.create(model=MODEL, input=["one sentence", "another"])
    assert len(out.data) == 2 and len(out.data[0].embedding) == len(out.data[1].embedding) > 0


def test_a_batch_through_the_router(router: Router) -> None:
    client = router.client()
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 2},
        }
        for i in range(2)
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    upload = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 180  # a hang guard only
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id is not None
    results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["r0", "r1"]
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_no_engine_module_or_libtorch_was_loaded(router: Router) -> None:
    """After the requests above (tests run in file order): what serving them imported counts too."""
    modules = imported_modules(router.output.read_text())
    assert {"litestar", "tokenizers", "gateway.backends.fleet.upstream"} <= modules  # the lines were read
    assert not {m for m in modules if m.split(".")[0] in ENGINE_SIDE}
    assert not {m for m in modules if m.startswith(ENGINE_CODE)}
    maps = Path(f"/proc/{router.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps
    rss_kib = next(
        int(x.split()[1])
        for x in Path(f"/proc/{router.proc.pid}/status").read_text().splitlines()
        if x.startswith("VmRSS:")
    )
    print(f"router RSS after chat, stream, Responses, embeddings and a batch: {rss_kib / 1024:.0f} MiB")
