"""`ctxfuse serve --backend URL ...` / `--fleet fleet.toml`: the gateway with no engine of its own,
routing to the fleet. It loads only the model's tokenizer and chat template (to name the prompt
blocks a request needs and count its tokens), never its weights. The app, the edge listener
(`--edge-port` and `--tls-dir`) and the Batch API are the gateway's own, as over an engine; only
the upstream differs (upstream.py)."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

from cloud.model.chat_template import ChatTemplate
from cloud.model.text_side import load_text_side
from cloud.model.tokenizer import Tokenizer
from gateway.backends.fleet.config import FleetConfig
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.metrics import FleetMetrics
from gateway.backends.fleet.shared import FleetSync
from gateway.backends.fleet.upstream import FleetUpstream
from gateway.config import GatewayConfig
from gateway.edge.stores import open_chunk_store
from gateway.ops.logs import configure_logging
from gateway.ops.metrics import Metrics
from gateway.server import GatewayServer, run_servers, server_for
from gateway.state import Gateway


def fleet_gateway(
    fleet_config: FleetConfig,
    config: GatewayConfig,
    model: str | Path | None = None,
    rng: random.Random | None = None,
    with_chunk_store: bool = False,
    chat_template: str | None = None,
) -> tuple[Gateway, Fleet]:
    """The gateway's state over the fleet (`with_chunk_store`: the edge link's, for an edge listener;
    `chat_template`: the template its workers were started with, so prompts key the same blocks).
    With no `model`, a fleet that may hold ctxfuse workers takes the tokenizer and template from the
    first to answer (no model file, no GGUF reader here); one of other servers only reads the default
    model's."""
    tokenizer: Tokenizer | None = None
    template: ChatTemplate | None = None
    if model is not None or fleet_config.all_openai:
        tokenizer, template = load_text_side(model)
        if chat_template is not None:
            template = template.replaced(chat_template, "--chat-template")
    fleet_config = replace(fleet_config, share_prefix_cache=config.share_prefix_cache)
    metrics = Metrics(lambda: None)
    fleet = Fleet(fleet_config, tokenizer, template, FleetMetrics(metrics.registry), rng)
    gateway = Gateway(FleetUpstream(fleet, config), config, metrics=metrics)
    if with_chunk_store:  # in the shared Redis with --redis-url, else a local file
        gateway.chunk_store = open_chunk_store(config, gateway.redis)
    if gateway.redis is not None:  # replicas tell one another what they route and roll back
        fleet.sync = FleetSync(fleet, gateway.redis)
    return gateway, fleet


def build_fleet_server(
    fleet_config: FleetConfig,
    config: GatewayConfig,
    model: str | Path | None = None,
    rng: random.Random | None = None,
    announce: bool = False,
    chat_template: str | None = None,
) -> tuple[GatewayServer, Fleet]:
    """The OpenAI port's server over the fleet; with --edge-port, its state keeps a chunk store for
    the edge listener (edge/server.py build_edge_server(server.gateway))."""
    edge = config.edge_port is not None
    gateway, fleet = fleet_gateway(fleet_config, config, model, rng, edge, chat_template)
    return server_for(gateway, announce=announce), fleet


def serve_fleet(
    fleet_config: FleetConfig,
    config: GatewayConfig,
    model: str | Path | None,
    chat_template: str | None = None,
) -> int:
    configure_logging(config.log_level)
    names = ", ".join(f"{b.name}={b.url} ({b.version})" for b in fleet_config.backends)
    if fleet_config.discovery is not None:
        d = fleet_config.discovery
        names = ", ".join(x for x in (names, f"workers found at {d.dns}:{d.port}") if x)
    print(f"ctxfuse: routing ({fleet_config.policy}) to {names}", file=sys.stderr, flush=True)
    server, _ = build_fleet_server(fleet_config, config, model, announce=True, chat_template=chat_template)
    try:
        run_servers(server)
    finally:
        if server.gateway.chunk_store is not None:
            server.gateway.chunk_store.close()
    return 0 if server.started else 1
