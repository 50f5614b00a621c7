"""`ctxfuse serve --backend URL ...` / `--fleet fleet.toml`: the gateway with no engine of its own,
routing to the fleet. It loads only the model's tokenizer and chat template (to name the prompt
blocks a request needs), never its weights."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import uvicorn

from cloud.model.loading import load_text_side

from ..config import GatewayConfig
from ..logs import configure_logging
from ..metrics import Metrics
from .app import create_fleet_app
from .config import FleetConfig
from .fleet import Fleet
from .metrics import FleetMetrics


def build_fleet_server(
    fleet_config: FleetConfig,
    config: GatewayConfig,
    model: str | Path | None = None,
    rng: random.Random | None = None,
) -> tuple[uvicorn.Server, Fleet]:
    tokenizer, template = load_text_side(model)
    metrics = Metrics(lambda: None)
    fleet = Fleet(fleet_config, tokenizer, template, FleetMetrics(metrics.registry), rng)
    app = create_fleet_app(
        fleet, metrics, config.api_key, config.max_body_bytes, config.data / "batches.sqlite"
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=int(config.shutdown_timeout_s),
        )
    )
    return server, fleet


def serve_fleet(fleet_config: FleetConfig, config: GatewayConfig, model: str | Path | None) -> int:
    configure_logging(config.log_level)
    names = ", ".join(f"{b.name}={b.url} ({b.version})" for b in fleet_config.backends)
    print(f"ctxfuse: routing ({fleet_config.policy}) to {names}", file=sys.stderr, flush=True)
    server, _ = build_fleet_server(fleet_config, config, model)
    print(f"ctxfuse: serving on {config.base_url}", file=sys.stderr, flush=True)
    server.run()
    return 0 if server.started else 1
