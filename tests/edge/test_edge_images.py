"""Images through the agent, end to end on loopback (real TLS, real encoder, real model): the agent
sends features instead of pixels, the model gets exactly the input it gets when the same image
reaches the gateway raw, and bad images are refused on the device."""

from __future__ import annotations

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
from gateway.backends.local import engine_gateway
from gateway.bench.edge.pictures import encoded, photo, traffic_light
from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from gateway.edge.server import build_edge_server

from ..gateway.conftest import Running, run_in_thread
from ..gateway.test_images_api import bomb_png, data_url, image_message
from .test_edge_e2e import ENGINE, MODEL, agent_for, pki, start

__all__ = ["pki"]  # the fixture, shared with the edge end-to-end tests


class Both:
    def __init__(self, agent_url: str, plain: Running, agent: object) -> None:
        self.agent_url, self.plain, self.agent = agent_url, plain, agent

    def via_agent(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.agent_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def via_gateway(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.plain.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def both(
    loaded_model: LoadedModel, pki: Path, vision_files: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Both]:
    state = tmp_path_factory.mktemp("state")
    backend = InProcessBackend(AsyncEngine(EngineCore(ENGINE, loaded_model)))
    config = GatewayConfig(
        port=0,
        edge_host="127.0.0.1",
        edge_port=0,
        tls_dir=pki,
        max_body_bytes=8 * 2**20,
        data_dir=state / "gw",
        # the device and the plain port are two tenants; the first test compares their prefix-cache
        # hashes, so they share the cache (the explicit opt-in; by default each has its own)
        share_prefix_cache=True,
    )
    gateway = engine_gateway(backend, config, ChunkStore(state / "chunks.sqlite", 64 * 2**20))
    edge = build_edge_server(gateway)
    gateway_url = f"https://127.0.0.1:{start(edge, 'edge-listener')}"
    agent, agent_server, agent_url = agent_for(pki, gateway_url, "dev1", state / "dev1")
    # the same engine behind the plain OpenAI port (its own gateway state and data dir)
    plain = run_in_thread(backend, replace(config, edge_port=None, data_dir=None))
    yield Both(agent_url, plain, agent)
    plain.stop()
    agent_server.should_exit = True
    edge.should_exit = True
    backend.shutdown()


def test_through_the_agent_the_model_gets_the_same_input_as_through_the_gateway(both: Both) -> None:
    preamble = "You are shown a picture. Name the main object in it, in one or two words. " * 4
    messages = [{"role": "system", "content": preamble}, *image_message(data_url(encoded(traffic_light())))]
    kw = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    a = both.via_agent().chat.completions.create(**kw)  # type: ignore[call-overload]
    g = both.via_gateway().chat.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].message.content == g.choices[0].message.content
    assert a.usage.prompt_tokens == g.usage.prompt_tokens
    # the second request found every full block of the first in the prefix cache: the same tokens,
    # and the same image hash mixed into the blocks that hold the image
    bs = 16
    assert g.usage.prompt_tokens_details.cached_tokens >= (g.usage.prompt_tokens - 1) // bs * bs


def test_a_megapixel_photo_crosses_the_link_at_least_50x_smaller(both: Both) -> None:
    jpeg = encoded(photo(1000, 1000), "JPEG", quality=90)
    before = both.agent.uplink.uploaded_bytes  # type: ignore[attr-defined]
    r = both.via_agent().chat.completions.create(
        model=MODEL,
        messages=image_message(data_url(jpeg, "image/jpeg")),
        max_tokens=1,
        temperature=0,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    on_link = both.agent.uplink.uploaded_bytes - before  # type: ignore[attr-defined]
    assert len(jpeg) > 150_000  # a camera-like frame, not a toy
    assert len(jpeg) / on_link >= 50, (len(jpeg), on_link)


def test_bad_images_are_refused_on_the_device(both: Both) -> None:
    before = both.agent.uplink.uploaded_bytes  # type: ignore[attr-defined]
    for url, code in (
        (data_url(bomb_png()), "image_too_many_pixels"),
        (data_url(encoded(traffic_light())[:300]), "invalid_image"),
        ("http://10.0.0.1/x.png", "image_urls_not_allowed"),
    ):
        body = {"model": MODEL, "messages": image_message(url), "max_tokens": 1}
        r = httpx.post(f"{both.agent_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["param"] == "messages[0].content[1].image_url.url"
    assert both.agent.uplink.uploaded_bytes == before  # nothing reached the gateway


def test_the_agent_counts_the_images_it_replaced(both: Both) -> None:
    metrics = httpx.get(f"{both.agent_url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("ctxfuse_edge_images_total"))
    assert float(line.split()[-1]) >= 1
