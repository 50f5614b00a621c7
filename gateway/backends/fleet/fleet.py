"""The fleet's state in one gateway process: its backends, the prefix index, the canary controller,
the HTTP client they are reached with, and the metrics. Routes and the health task share it."""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass

import httpx
import structlog

from cloud.model.chat_template import ChatTemplate
from cloud.model.tokenizer import Tokenizer
from gateway.backends.fleet.backend import FleetBackend
from gateway.backends.fleet.backend_auth import BackendAuth, credential
from gateway.backends.fleet.canary import CanaryController, Rollback
from gateway.backends.fleet.circuit import CircuitBreaker, CircuitState, OnChange
from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.discovery import Resolver
from gateway.backends.fleet.index import PrefixIndex
from gateway.backends.fleet.keys import KeyMaker, RequestKeys, chat_text_keys, prompt_text
from gateway.backends.fleet.metrics import CANARY_VALUE, CIRCUIT_VALUE, FleetMetrics
from gateway.backends.fleet.shared import FleetSync
from gateway.backends.fleet.text_memo import TextMemo
from gateway.backends.fleet.wire import WireClient
from gateway.errors import ServiceUnavailableError
from shared.fleet_protocol import TextSide
from shared.keep_alive import ROUTER_KEEP_ALIVE_S
from shared.protocol import ChatCompletionRequest, CompletionRequest

log = structlog.get_logger("ctxfuse.fleet")

READ_TIMEOUT_S = 600.0  # a long generation may take minutes before its whole (non-streamed) answer


@dataclass(frozen=True, slots=True)
class WorkerText:
    side: TextSide
    tokenizer: Tokenizer
    template: ChatTemplate


class Fleet:
    def __init__(
        self,
        config: FleetConfig,
        tokenizer: Tokenizer | None,
        template: ChatTemplate | None,
        metrics: FleetMetrics,
        rng: random.Random | None = None,
        resolver: Resolver = socket.getaddrinfo,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.resolver = resolver  # how [discovery] resolves its name (discovery.py)
        # the model's text side, to name prompt blocks: given (--model), or None until the first
        # ctxfuse worker's health check sends its own (health.py); until then prompts key by text
        self.keys = KeyMaker(tokenizer, template) if tokenizer is not None and template is not None else None
        self.text_memo = TextMemo()  # chats' text-chunk keys, a next turn from its earlier turn's
        self.text_side: WorkerText | None = None  # a worker's: the model behind the seam (engine.py)
        self.index = PrefixIndex(config.index_blocks)
        self.canary = CanaryController(config.version_weights, config.canary, stable=config.stable_version)
        # what the other router replicas are told, and hear (`--redis-url`; fleet/shared.py); None: alone
        self.sync: FleetSync | None = None
        # replaced whole, never changed in place, when discovery adds or drops one: a loop over the
        # list it read goes on over that list (the client's BackendAuth reads it at each request)
        self.backends = [self._backend(spec) for spec in config.backends]
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=config.connect_timeout_s)
        # trust_env off: backends are addressed as configured, never through a proxy from the environment
        self.client = httpx.AsyncClient(
            timeout=timeout,
            trust_env=False,
            auth=BackendAuth(lambda: [b.spec for b in self.backends], config.backend_key),
            limits=httpx.Limits(max_connections=None, keepalive_expiry=ROUTER_KEEP_ALIVE_S),
        )
        # the work itself (relayed bodies, the seam's generate and embed) goes on a leaner client
        self.wire = WireClient(config.connect_timeout_s, READ_TIMEOUT_S, ROUTER_KEEP_ALIVE_S)
        for version in self.canary.versions:
            self._export_version(version)

    def _backend(self, spec: BackendSpec) -> FleetBackend:
        breaker = CircuitBreaker(
            self.config.failures_to_open, self.config.cooldown_s, on_change=self._circuit_logger(spec.name)
        )
        return FleetBackend(spec, breaker, kind=None if spec.kind == "auto" else spec.kind)

    def add_backend(self, spec: BackendSpec) -> FleetBackend:
        """A backend found at run time (discovery.py). It takes no request before a health check
        has reached it; the router presents it the fleet's backend key."""
        if spec.version not in self.canary.versions:
            raise ValueError(f"backend {spec.name}: version {spec.version!r} is not one the fleet routes")
        if any(b.name == spec.name or b.url == spec.url for b in self.backends):
            raise ValueError(f"backend {spec.name} ({spec.url}) is already in the fleet")
        backend = self._backend(spec)
        backend.reachable = False
        self.backends = [*self.backends, backend]
        return backend

    def drop_backend(self, name: str) -> FleetBackend | None:
        """Route nothing more to `name` and forget what it held; requests already there finish.
        None: no such backend."""
        gone = next((b for b in self.backends if b.name == name), None)
        if gone is None:
            return None
        self.backends = [b for b in self.backends if b is not gone]
        self.index.forget(name)
        self.metrics.index_keys.set(len(self.index))
        self.metrics.circuit.remove(name)  # a gone backend's last state is no alert
        return gone

    def _circuit_logger(self, name: str) -> OnChange:
        def changed(old: CircuitState, new: CircuitState) -> None:
            log.warning("circuit", backend=name, old=old, new=new)
            self.metrics.circuit.labels(backend=name).set(CIRCUIT_VALUE[new])

        return changed

    def _export_version(self, version: str) -> None:
        self.metrics.canary_state.labels(version=version).set(CANARY_VALUE[self.canary.state(version)])
        self.metrics.canary_weight.labels(version=version).set(self.canary.weights.get(version, 0.0))

    def record_outcome(self, backend: FleetBackend, ok: bool, latency_s: float) -> None:
        """A request's fate, for the circuit (passive health) and the canary."""
        if ok:
            backend.circuit.record_success()
        else:
            backend.circuit.record_failure()
        rollback = self.canary.record(backend.spec.version, ok, latency_s)
        if rollback is not None:
            self._rolled_back(rollback)

    def _rolled_back(self, rollback: Rollback) -> None:
        log.error(
            "canary_rolled_back", version=rollback.version, reason=rollback.describe(self.canary.policy)
        )
        self.metrics.rollbacks.labels(version=rollback.version).inc()
        self._export_version(rollback.version)
        if self.sync is not None:
            self.sync.rolled_back(rollback)

    def adopted_rollback(self, rollback: Rollback) -> None:
        """Another replica rolled a canary back (or did before this one started): so does this one."""
        log.error("canary_rolled_back", version=rollback.version, by="another replica")
        self._export_version(rollback.version)

    def adopt_text_side(
        self, tokenizer: Tokenizer, template: ChatTemplate, side: TextSide | None = None
    ) -> None:
        """`side`: as a worker described it, with the tokenizer and template it loads to (None: a
        tokenizer the router was given or loaded). Prefix keys keep what the router was given."""
        if self.keys is None:
            self.keys = KeyMaker(tokenizer, template)
        if side is not None:
            self.text_side = WorkerText(side, tokenizer, template)

    def request_keys(
        self, req: ChatCompletionRequest | CompletionRequest, count: bool, extra_key: bytes = b""
    ) -> tuple[RequestKeys, int]:
        """(its prefix keys, its prompt tokens when `count` asks for them, else 0) of a decoded
        chat or completion request; `extra_key`: the tenant's (salt_key), which keeps the prompts the
        router remembers apart per tenant. It tokenizes when `tokenizes(count)`: call it off the loop
        then."""
        if self.keys is None:
            if count:  # a limit in tokens cannot be kept without the tokenizer: refused, not guessed
                raise ServiceUnavailableError(
                    "the router has no tokenizer yet: no ctxfuse worker has answered its health check"
                )
            if isinstance(req, ChatCompletionRequest):
                return chat_text_keys(req, extra_key, self.text_memo), 0
            return RequestKeys([], prompt_text(req), extra_key), 0
        tokenize = self.tokenizes(count)
        if isinstance(req, ChatCompletionRequest):
            keys = self.keys.chat(req, tokenize, extra_key, self.text_memo)
        else:
            keys = self.keys.completion(req, tokenize, extra_key)
        return keys, self.keys.prompt_tokens(req, keys) if count else 0

    def tokenizes(self, count: bool) -> bool:
        """Whether keying a request tokenizes it: only when tokens are counted or some backend
        matches token blocks (else its keys are hashes of its text, cheap enough for the loop)."""
        return self.keys is not None and (count or any(b.reports_blocks for b in self.backends))

    def max_model_len(self) -> int | None:
        """The largest context a backend reports (None: none reports one)."""
        known = [b.max_model_len for b in self.backends if b.max_model_len]
        return max(known) if known else None

    def in_version(self, version: str | None) -> list[FleetBackend]:
        return [b for b in self.backends if version is None or b.spec.version == version]

    def match(self, keys: RequestKeys, backends: list[FleetBackend]) -> tuple[dict[str, int], dict[str, int]]:
        """(leading keys each backend holds, the request's key count in that backend's scheme)."""
        matched: dict[str, int] = {}
        total: dict[str, int] = {}
        by_scheme: dict[int | None, list[FleetBackend]] = {}
        for b in backends:
            by_scheme.setdefault(b.block_size if b.reports_blocks else None, []).append(b)
        for block_size, group in by_scheme.items():
            chain = keys.text_chunks() if block_size is None else keys.blocks(block_size)
            counts = self.index.matched(chain, [b.name for b in group])
            for b in group:
                matched[b.name], total[b.name] = counts[b.name], len(chain)
        return matched, total

    def remember(self, backend: FleetBackend, keys: RequestKeys, matched: int = 0) -> None:
        """What was just sent there will be held there: a worker's events confirm or correct it.
        `matched`: the leading keys `backend` was just matched on (and so touched); a chain it holds
        whole needs nothing added."""
        chain = (
            keys.blocks(backend.block_size)
            if backend.reports_blocks and backend.block_size
            else keys.text_chunks()
        )
        if matched < len(chain):
            self.index.add(backend.name, chain)
        self.metrics.index_keys.set(len(self.index))
        if self.sync is not None:
            self.sync.remembered(backend.name, chain)

    def credential(self, backend: FleetBackend) -> str | None:
        """The Authorization header the router presents to `backend` (as BackendAuth does)."""
        return credential(backend.spec, self.config.backend_key)

    async def close(self) -> None:
        self.wire.close()
        await self.client.aclose()
