"""The Responses API over the fleet router (one real `ctxfuse worker` process, the real model, on
loopback): the same routes as over the in-process engine, answered through the router's chat
completions, stored by the router."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.serve import build_fleet_server
from gateway.bench.worker_proc import WorkerProcess
from gateway.config import GatewayConfig

MODEL = "smollm2-135m-instruct"
ENGINE_ARGS = (
    "--dtype", "float32", "--weight-quant", "none", "--kv-cache-memory", "0.25", "--max-model-len", "2048",
)  # fmt: skip
WORKER_KEY = "fleet-responses-worker-key"


@pytest.fixture(scope="module")
def router(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    worker = WorkerProcess(gguf_path, MODEL, *ENGINE_ARGS, api_key=WORKER_KEY)
    try:
        spec = BackendSpec(name="w0", url=worker.wait_ready(), kind="ctxfuse")
        config = FleetConfig(backends=(spec,), health_interval_s=0.2, backend_key=WORKER_KEY)
        gateway = GatewayConfig(port=0, data_dir=tmp_path_factory.mktemp("fleet-responses"))
        server, _ = build_fleet_server(config, gateway, gguf_path, random.Random(0))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        port = int(server.servers[0].sockets[0].getsockname()[1])
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        server.should_exit = True
        thread.join(timeout=30)
    finally:
        worker.kill()


def test_create_stream_and_continue_through_the_router(router: openai.OpenAI) -> None:
    first = router.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0)
    chat = router.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_completion_tokens=4, temperature=0
    )
    assert first.output_text == chat.choices[0].message.content
    assert first.usage is not None and chat.usage is not None
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    with router.responses.stream(
        model=MODEL, input="And again?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == final.output_text and final.usage is not None
    items = router.responses.input_items.list(final.id, order="asc").data
    assert len(items) == 3 and items[1].id == first.output[0].id  # the first turn's answer, then this turn
    assert router.responses.retrieve(final.id).output_text == deltas
