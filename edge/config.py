"""Configuration of `ctxfuse edge`: one home for the agent's options."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shared.home import ctxfuse_home

from .vision.features import VisionOptions

FullPolicy = Literal["refuse", "drop_oldest"]


def default_state_dir() -> Path:
    return ctxfuse_home() / "edge"


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    gateway_url: str  # the gateway's edge listener, e.g. https://gateway.example:8443
    tls_dir: Path  # the CA certificate and this device's certificate and key (ctxfuse certs)
    name: str  # this device's name, as its certificate was issued
    host: str = "127.0.0.1"  # the apps' side: loopback only by default
    port: int = 8100
    state_dir: Path | None = None  # acknowledged chunks and the batch outbox; default under CTXFUSE_HOME
    chunk_threshold: int = 2048  # strings of at least this many UTF-8 bytes travel as chunks
    max_acked_chunks: int = 200_000  # digests remembered as held by the gateway (LRU)
    connect_timeout_s: float = 5.0
    retry_after_s: int = 5  # told to apps when the gateway cannot be reached
    outbox_max_bytes: int = 1 << 30  # batch files held in the outbox (inputs and fetched results)
    outbox_full_policy: FullPolicy = "refuse"  # when full: refuse new files, or drop the oldest batches
    # free space an app's upload may not take from the state dir's filesystem (a 507 instead), kept for
    # what must still be written there: the forwarder's state changes and the results it fetches
    outbox_min_free_bytes: int = 64 << 20
    retry_base_s: float = 1.0  # first wait after a link failure; doubles per failure (full jitter)
    retry_cap_s: float = 300.0  # the longest wait between attempts to reach the gateway
    poll_s: float = 2.0  # first wait between looks at a forwarded batch; doubles up to poll_max_s
    poll_max_s: float = 60.0
    vision: VisionOptions = field(default_factory=VisionOptions)  # image caps, allowed image URL hosts
    max_body_bytes: int = 64 * 2**20  # an app's chat body, images in base64 included; larger: 413
    # who may use the local port (local_guard.py): the device's identity stands behind every answer
    api_key: str | None = field(default=None, repr=False)  # when set, apps send `Bearer <key>`
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides localhost, 127.0.0.1, [::1]
    allowed_origins: tuple[str, ...] = ()  # web pages that may call the agent (CORS); others: 403

    @property
    def state(self) -> Path:
        return self.state_dir or default_state_dir()
