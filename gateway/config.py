"""Gateway configuration: one home for the HTTP-side options of `ctxfuse serve`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cloud.model.registry import cache_dir
from edge.vision.features import VisionOptions
from shared.conn_limits import ConnLimits

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
    # serve's engine core in a process of its own (engine_process.py), else on a thread of this one
    engine_process: bool = True
    # the edge listener (mutual TLS, edge routes only); off unless a port is given
    edge_host: str = "0.0.0.0"
    edge_port: int | None = None
    tls_dir: Path | None = None  # CA, server certificate and key, revocation list (ctxfuse certs)
    chunk_store: Path | None = None  # the edge link's chunks (SQLite); default under CTXFUSE_HOME
    chunk_store_mib: float = 1024.0  # bound on stored chunk bytes; least recently used go first
    device_max_in_flight: int = 32  # requests one device may have running on the edge listener
    data_dir: Path | None = None  # the Batch API's files and batches (SQLite); default CTXFUSE_HOME/gateway
    # tenants reuse one another's cached prompt prefixes (off: each tenant's are its own, so
    # cached_tokens and TTFT never tell one tenant what another sent)
    share_prefix_cache: bool = False
    # /v1/embeddings takes token ids as input (OpenAI does); off: refused, since ids from another
    # model's vocabulary (LangChain sends tiktoken's by default) embed as nonsense
    embedding_token_ids: bool = True
    # with --redis-url: a batch whose replica stopped renewing its lease (died) is taken over after this
    batch_lease_s: float = 10.0
    max_running_batches: int = 4  # batches run side by side; one that keeps failing holds one slot, not all
    # lifetime of a Batch API file made without `expires_after` (0: until deleted, as OpenAI keeps them)
    file_ttl_days: int = 0
    # an upload is refused (507) when it would leave less than this free on the data dir's disk: the
    # room kept lets batches write their results, keys be made and responses stored (0: no floor)
    min_free_mib: float = 64.0
    vision: VisionOptions = field(
        default_factory=VisionOptions
    )  # image caps and the hosts image URLs may be fetched from
    # header timeout and size, connection cap and reuse, on the OpenAI port and the edge listener
    conn_limits: ConnLimits = field(default_factory=ConnLimits)
    # TLS on the OpenAI port (e.g. `ctxfuse certs server`'s server.pem and server.key); off when None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    # the state several replicas share (limits, keys, batches, chunks); None: this process and its
    # local SQLite files (gateway/shared_state/redis_link.py)
    redis_url: str | None = field(default=None, repr=False)
    # where `ctxfuse bench` wrote its results (its default, relative to the working directory): the
    # console shows the long-context benchmark's heatmaps found under longctx/
    bench_results: Path = Path("bench-results")

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")

    @property
    def data(self) -> Path:
        return self.data_dir or cache_dir() / "gateway"

    @property
    def file_ttl_s(self) -> int | None:
        return self.file_ttl_days * 86400 or None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.ssl_certfile is not None else "http"
        return f"{scheme}://{host}:{self.port}/v1"
