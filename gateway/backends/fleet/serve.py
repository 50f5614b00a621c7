"""`ctxfuse serve --backend URL ...` / `--fleet fleet.toml`: the gateway with no engine of its own,
routing to the fleet. It loads only the model's tokenizer and chat template (to name the prompt
blocks a request needs), never its weights. With `--edge-port` and `--tls-dir` it also runs the
edge listener (edge.py) on the same event loop, stopped with the plain server."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import uvicorn

from cloud.model.loading import load_text_side
from gateway.access.keys import KeyStore
from gateway.backends.fleet.app import create_fleet_app
from gateway.backends.fleet.batch import routed_executor
from gateway.backends.fleet.config import FleetConfig
from gateway.backends.fleet.edge import build_fleet_edge_server
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.metrics import FleetMetrics
from gateway.batch.runner import BatchRunner
from gateway.config import GatewayConfig
from gateway.ops.logs import configure_logging
from gateway.ops.metrics import Metrics
from gateway.server import DrainingServer, open_chunk_store, serve_together, uvicorn_config


class FleetServer(DrainingServer):
    """Also: what the edge listener shares with the plain port."""

    def __init__(self, config: uvicorn.Config, metrics: Metrics, batches: BatchRunner) -> None:
        super().__init__(config)
        self.metrics = metrics
        self.batches = batches  # one runner per process, started by the plain app's lifespan


def build_fleet_server(
    fleet_config: FleetConfig,
    config: GatewayConfig,
    model: str | Path | None = None,
    rng: random.Random | None = None,
) -> tuple[FleetServer, Fleet]:
    tokenizer, template = load_text_side(model)
    fleet_config = replace(fleet_config, share_prefix_cache=config.share_prefix_cache)
    metrics = Metrics(lambda: None)
    fleet = Fleet(fleet_config, tokenizer, template, FleetMetrics(metrics.registry), rng)
    batches = BatchRunner(
        routed_executor(fleet),
        config.data / "batches.sqlite",
        max_running=config.max_running_batches,
        file_ttl_s=config.file_ttl_s,
    )
    keys = KeyStore(config.data / "keys.sqlite")
    app = create_fleet_app(fleet, metrics, config.api_key, config.max_body_bytes, batches, keys)
    server = FleetServer(uvicorn_config(app, config), metrics, batches)
    return server, fleet


def serve_fleet(fleet_config: FleetConfig, config: GatewayConfig, model: str | Path | None) -> int:
    configure_logging(config.log_level)
    names = ", ".join(f"{b.name}={b.url} ({b.version})" for b in fleet_config.backends)
    print(f"ctxfuse: routing ({fleet_config.policy}) to {names}", file=sys.stderr, flush=True)
    server, fleet = build_fleet_server(fleet_config, config, model)
    print(f"ctxfuse: serving on {config.base_url}", file=sys.stderr, flush=True)
    if config.edge_port is None:
        server.run()
        return 0 if server.started else 1
    store = open_chunk_store(config)
    try:
        edge = build_fleet_edge_server(fleet, store, server.batches, server.metrics, config)
        server.companions.append(edge)
        serve_together(server, edge)
    finally:
        store.close()
    return 0 if server.started else 1
