"""Running the agent: uvicorn on the device's loopback, one Agent (uplink, acknowledged chunks,
counters) for its whole life."""

from __future__ import annotations

import uvicorn

from shared import conn_limits
from shared.conn_limits import ConnLimits
from shared.draining import DrainingServer
from shared.keep_alive import SERVER_KEEP_ALIVE_S

from .agent import Agent, create_agent_app
from .config import EdgeConfig
from .local_guard import warn_if_exposed


def agent_server(config: EdgeConfig, log_level: str = "info") -> uvicorn.Server:
    """SIGTERM (systemd's stop) closes the outbox and stores cleanly and exits 0."""
    warn_if_exposed(config.host, config.api_key)
    return DrainingServer(agent_uvicorn_config(Agent(config), config.host, config.port, log_level))


def agent_uvicorn_config(
    agent: Agent, host: str, port: int, log_level: str = "info", limits: ConnLimits | None = None
) -> uvicorn.Config:
    """The agent app under uvicorn; lifespan on: startup starts the outbox forwarder and loads the
    image pipeline, shutdown closes the uplink and the stores. Connections under `limits` (default
    ConnLimits()): local callers get the same header timeout and caps as the gateway's ports."""
    return uvicorn.Config(
        create_agent_app(agent),
        host=host,
        port=port,
        log_config=None,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        **conn_limits.uvicorn_options(limits or ConnLimits()),
    )
