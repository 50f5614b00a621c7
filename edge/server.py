"""Running the agent: uvicorn on the device's loopback, one Agent (uplink, acknowledged chunks,
counters) for its whole life."""

from __future__ import annotations

import uvicorn

from .agent import Agent, create_agent_app
from .config import EdgeConfig


def agent_server(config: EdgeConfig, log_level: str = "info") -> uvicorn.Server:
    app = create_agent_app(Agent(config))
    return uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_config=None, log_level=log_level, lifespan="on"
        )
    )
