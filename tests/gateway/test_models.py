"""Several models in one gateway (`ctxfuse serve --model a=A --model b=B --alias c=b`): each request
runs on the engine of the model it names, `/v1/models` lists them all, anything else is 404."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from ctxfuse.cli import build_parser
from ctxfuse.engine_cli import ModelSpec, engine_config, engine_configs
from ctxfuse.engine_serve import serve
from gateway.backends.local import EngineUpstream
from gateway.backends.models import ModelsConfigError, ModelsUpstream
from gateway.config import GatewayConfig
from gateway.server import GatewayServer, server_for
from gateway.state import Gateway
from shared.errors import CtxfuseError

from .batches import chat_line, lines_of, start, wait
from .conftest import ENGINE

HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def engines(loaded_model: LoadedModel) -> Iterator[list[InProcessBackend]]:
    made = [
        InProcessBackend(AsyncEngine(EngineCore(replace(ENGINE, served_model_name=name), loaded_model)))
        for name in ("alpha", "beta")
    ]
    yield made
    for b in made:
        b.shutdown()


@pytest.fixture(scope="module")
def served(engines: list[InProcessBackend]) -> Iterator[str]:
    config = GatewayConfig(port=0, data_dir=Path(tempfile.mkdtemp(prefix="ctxfuse-test-models-")))
    upstream = ModelsUpstream([EngineUpstream(b, config) for b in engines], {"gamma": "beta"})
    server: GatewayServer = server_for(Gateway(upstream, config), announce=False)
    thread = threading.Thread(target=server.run, daemon=True, name="models-gateway")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the gateway did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.bound_port}"
    server.should_exit = True
    thread.join(timeout=30)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_model_list_names_every_model_and_alias_with_its_context(served: str) -> None:
    listed = {m.id: m for m in _client(served).models.list().data}
    assert set(listed) == {"alpha", "beta", "gamma"}
    assert all(
        m.model_extra and m.model_extra["max_model_len"] == ENGINE.max_model_len for m in listed.values()
    )
    assert _client(served).models.retrieve("gamma").id == "gamma"


def test_each_request_runs_on_the_model_it_names(served: str) -> None:
    client = _client(served)
    for asked, answered in (("alpha", "alpha"), ("beta", "beta"), ("gamma", "beta")):
        r = client.chat.completions.create(model=asked, messages=HI, max_tokens=2)  # type: ignore[arg-type]
        assert r.model == answered  # the engine that ran it names itself
    stream = client.completions.create(model="beta", prompt="One, two,", max_tokens=2, stream=True)
    assert {chunk.model for chunk in stream} == {"beta"}


def test_a_model_that_is_not_served_is_404_model_not_found(served: str) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        _client(served).chat.completions.create(model="delta", messages=HI, max_tokens=2)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found" and "alpha, beta, gamma" in missing.value.message
    r = httpx.post(f"{served}/tokenize", json={"model": "delta", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{served}/tokenize", json={"model": "gamma", "prompt": "hi"}).status_code == 200


def test_a_batch_runs_each_line_on_its_model(served: str) -> None:
    client = _client(served)
    lines = [chat_line("a", model="alpha"), chat_line("b", model="gamma"), chat_line("x", model="delta")]
    batch = wait(client, start(client, lines).id)
    assert batch.status == "completed"
    done = {line["custom_id"]: line for line in lines_of(client, batch.output_file_id)}
    assert {k: v["response"]["body"]["model"] for k, v in done.items()} == {"a": "alpha", "b": "beta"}
    (failed,) = lines_of(client, batch.error_file_id)
    assert failed["custom_id"] == "x" and failed["response"]["status_code"] == 404


def test_names_and_aliases_must_be_unambiguous(engines: list[InProcessBackend]) -> None:
    config = GatewayConfig(port=0)
    alpha, beta = (EngineUpstream(b, config) for b in engines)
    with pytest.raises(ModelsConfigError, match="two models are served as 'alpha'"):
        ModelsUpstream([alpha, EngineUpstream(engines[0], config)])
    with pytest.raises(ModelsConfigError, match="not served"):
        ModelsUpstream([alpha, beta], {"gamma": "delta"})
    with pytest.raises(ModelsConfigError, match="already a served model"):
        ModelsUpstream([alpha, beta], {"beta": "alpha"})


def test_the_command_line_takes_several_models_for_serve_only(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "a=/m/a.gguf", "--model", "/m/b=x.gguf", "--alias", "c=a"]
    )
    assert args.model == [ModelSpec("/m/a.gguf", "a"), ModelSpec("/m/b=x.gguf")]
    assert [(c.model, c.served_model_name) for c in engine_configs(args)] == [
        ("/m/a.gguf", "a"),
        ("/m/b=x.gguf", None),
    ]
    assert args.alias == [("c", "a")]
    with pytest.raises(CtxfuseError, match="runs one model"):
        engine_config(args)  # generate, bench, worker
    named = build_parser().parse_args(["serve", "--model", "a=/m/a.gguf", "--served-model-name", "b"])
    with pytest.raises(CtxfuseError, match="named twice"):
        engine_configs(named)
    with pytest.raises(CtxfuseError, match="a worker serves one model"):
        serve(engine_configs(args), GatewayConfig(port=0, data_dir=tmp_path), worker=True)
