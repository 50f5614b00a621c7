"""Gateway configuration: one home for the HTTP-side options of `ctxfuse serve`."""

from __future__ import annotations

from dataclasses import dataclass

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, API routes need `Authorization: Bearer <key>`
    log_content: bool = False  # prompts and completions in the request log (off: they may be private)
    max_body_bytes: int = 16 * 2**20  # larger bodies get a 413 before they are read
    shutdown_timeout_s: float = 30.0  # on SIGTERM: how long running requests may take to finish
    log_level: str = "info"

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"
