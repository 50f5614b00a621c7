"""The fleet: which backends the gateway routes to, and how (`ctxfuse serve --backend URL ...` or
`--fleet fleet.toml`). One home for every fleet option.

```toml
[routing]
policy = "prefix"          # prefix | least-load | random
max_attempts = 3           # backends tried before the first byte reaches the client

[canary]
error_rate = 0.05          # a canary whose error rate passes this over the window is rolled back
latency_ratio = 3.0        # ... or whose p99 passes this multiple of the stable version's
window_s = 60
min_requests = 20

[[backend]]
name = "a"
url = "http://10.0.0.1:8001"
kind = "auto"              # ctxfuse (reports its blocks) | openai (any other server) | auto (ask it)
version = "v1"
weight = 90
max_concurrency = 32       # requests in flight before it counts as busy (OpenAI servers report no load)

[discovery]                # and/or: workers found by a DNS name (a Kubernetes headless Service)
dns = "ctxfuse-worker.ctxfuse.svc.cluster.local"
port = 8001
refresh_s = 10             # resolved again this often; addresses that come are added, those gone dropped
kind = "ctxfuse"
version = "v1"
weight = 100               # the traffic weight of `version` these workers add, however many they are
```
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from gateway.backends.fleet.canary import CanaryPolicy

Policy = Literal["prefix", "least-load", "random"]
Kind = Literal["auto", "ctxfuse", "openai"]
Scheme = Literal["http", "https"]


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str
    url: str  # base URL, without /v1
    kind: Kind = "auto"
    version: str = "default"
    weight: float = 1.0
    max_concurrency: int = 32
    # the credential sent to this backend (`Authorization: Bearer`); default: the fleet's backend_key
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"backend {self.name}: url must start with http:// or https://, not {self.url!r}"
            )
        if self.kind not in get_args(Kind):
            raise ValueError(f"backend {self.name}: kind must be one of {', '.join(get_args(Kind))}")
        if self.weight < 0 or self.max_concurrency < 1:
            raise ValueError(f"backend {self.name}: weight must be >= 0 and max_concurrency >= 1")


@dataclass(frozen=True, slots=True)
class DiscoverySpec:
    """Backends found by resolving a DNS name: each address it resolves to is one backend at `port`
    (a Kubernetes headless Service resolves to its ready pods). Backends named in the file stay."""

    dns: str
    port: int = 8001
    refresh_s: float = 10.0
    kind: Kind = "auto"
    version: str = "default"
    weight: float = 1.0  # added to `version`'s traffic weight once, however many addresses resolve
    scheme: Scheme = "http"
    max_concurrency: int = 32

    def __post_init__(self) -> None:
        if not self.dns or "/" in self.dns or ":" in self.dns:
            raise ValueError(f"discovery: dns must be a host name, not {self.dns!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"discovery: port must be in 1..65535, got {self.port}")
        if not self.refresh_s > 0:
            raise ValueError(f"discovery: refresh_s must be positive, got {self.refresh_s}")
        if self.kind not in get_args(Kind):
            raise ValueError(f"discovery: kind must be one of {', '.join(get_args(Kind))}")
        if self.scheme not in get_args(Scheme):
            raise ValueError(f"discovery: scheme must be one of {', '.join(get_args(Scheme))}")
        if self.weight < 0 or self.max_concurrency < 1:
            raise ValueError("discovery: weight must be >= 0 and max_concurrency >= 1")

    def backend(self, address: str) -> BackendSpec:
        """The backend at one resolved address, named after it (names are unique per address)."""
        host = f"[{address}]" if ":" in address else address
        return BackendSpec(
            name=f"{host}:{self.port}",
            url=f"{self.scheme}://{host}:{self.port}",
            kind=self.kind,
            version=self.version,
            weight=0.0,  # the version's weight is the discovery's own (version_weights)
            max_concurrency=self.max_concurrency,
        )


@dataclass(frozen=True, slots=True)
class FleetConfig:
    backends: tuple[BackendSpec, ...]
    policy: Policy = "prefix"
    max_attempts: int = 3
    canary: CanaryPolicy = field(default_factory=CanaryPolicy)
    health_interval_s: float = 1.0  # active checks and block-event polls
    failures_to_open: int = 3  # consecutive failures that open a backend's circuit
    cooldown_s: float = 5.0  # an open circuit lets a probe through after this
    index_blocks: int = 1_000_000  # prefix entries the gateway remembers (LRU), all backends together
    connect_timeout_s: float = 2.0
    stable_version: str | None = None  # default: the version with the most weight
    # what the router presents to backends that name no key of their own: workers require one
    backend_key: str | None = field(default=None, repr=False)
    # tenants reuse one another's cached prefixes on the workers (serve's --share-prefix-cache)
    share_prefix_cache: bool = False
    discovery: DiscoverySpec | None = None  # more backends, found by DNS (discovery.py)

    def cache_salt(self, salt: str | None) -> str | None:
        """The salt a request whose tenant's own partition is `salt` runs under on the workers."""
        return None if self.share_prefix_cache else salt

    def __post_init__(self) -> None:
        if not self.backends and self.discovery is None:
            raise ValueError("a fleet needs at least one backend, or a [discovery] section")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique: {names}")
        if self.policy not in get_args(Policy):
            raise ValueError(f"routing policy must be one of {', '.join(get_args(Policy))}")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")

    @property
    def version_weights(self) -> dict[str, float]:
        weights: dict[str, float] = {}
        for b in self.backends:
            weights[b.version] = weights.get(b.version, 0.0) + b.weight
        if self.discovery is not None:
            d = self.discovery
            weights[d.version] = weights.get(d.version, 0.0) + d.weight
        return weights

    @property
    def all_openai(self) -> bool:
        """Whether every backend, found or named, is known to be a plain OpenAI-compatible server (no
        ctxfuse worker will send the router its tokenizer)."""
        kinds = [b.kind for b in self.backends] + ([self.discovery.kind] if self.discovery else [])
        return all(k == "openai" for k in kinds)


def from_urls(urls: list[str], policy: Policy = "prefix") -> FleetConfig:
    """`--backend URL` (repeated): one version, equal weights, kinds found by asking."""
    specs = tuple(
        BackendSpec(name=f"b{i}", url=u.rstrip("/").removesuffix("/v1")) for i, u in enumerate(urls)
    )
    return FleetConfig(backends=specs, policy=policy)


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"[{key}] must be a table")
    return value


def load(path: Path) -> FleetConfig:
    """The fleet file; ValueError names what is wrong."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read the fleet file {path}: {exc}") from exc
    raw = data.get("backend", [])
    found = _section(data, "discovery")
    if not isinstance(raw, list) or not (raw or found):
        raise ValueError(f"{path}: list the backends as [[backend]] tables, or find them by [discovery]")
    try:
        backends = tuple(
            BackendSpec(**{**b, "url": str(b.get("url", "")).rstrip("/").removesuffix("/v1")}) for b in raw
        )
        routing = _section(data, "routing")
        return FleetConfig(
            backends=backends,
            canary=CanaryPolicy(**_section(data, "canary")),
            discovery=DiscoverySpec(**found) if found else None,
            **routing,
        )
    except TypeError as exc:  # an unknown or missing key
        raise ValueError(f"{path}: {exc}") from exc
