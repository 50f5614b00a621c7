"""`ctxfuse edge`: an OpenAI-compatible proxy on the device's loopback. Apps change only `base_url`;
the agent forwards chat and completions over the edge link (edge/uplink.py), streaming included, and
models as they are. When the gateway cannot be reached the app gets a 503 in OpenAI's error shape
with Retry-After, never a hang or a bare connection error.

Batches (Files and Batch API) are accepted even while the gateway is down: they wait in the outbox
(outbox.py) and the forwarder (forwarder.py) runs them on the gateway when the link is back.

Images become features on the device when the encoder's files are there (`ctxfuse models fetch`
builds them where the cloud extra is installed; a device may be given a copy). Without them the agent
still serves: image parts travel as sent and the gateway turns them into features.

Metrics at /metrics: ctxfuse_edge_request_bytes_total (request bytes received from apps) and
ctxfuse_edge_upload_bytes_total (bytes sent to the gateway, after dedup and compression), and
ctxfuse_storage_errors_total{store, kind} (writes and reads the state dir's disk refused: the outbox's
answer apps a 507 or 503; the acknowledged-chunk set's are ignored, as it is only a hint).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import structlog
from litestar import Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.datastructures import State
from litestar.types import ASGIApp
from prometheus_client import CollectorRegistry, Counter, generate_latest

from shared.disconnect import WatchedStream
from shared.errors import InvalidRequestError, ModelLoadError
from shared.forwarded_path import UnsafePathError, forwarded_path
from shared.storage_faults import FaultCollector, StorageFault, check_writable
from shared.tls import client_context

from . import batch_routes
from .acked import AckedChunks
from .config import EdgeConfig
from .encode import Endpoint
from .errors import JSON
from .errors import error_response as _error
from .forwarder import Forwarder
from .images import replace_images
from .local_guard import GuardPolicy, LocalGuard
from .outbox import Outbox
from .uplink import GatewayUnreachable, Uplink
from .vision.features import ImagePipeline

log = structlog.get_logger("ctxfuse.edge")
AnyRequest = Request[Any, Any, Any]
_PASSED_HEADERS = ("retry-after", "x-request-id")


class Agent:
    """The agent's state: its uplink, its batch outbox and forwarder, and its counters."""

    def __init__(self, config: EdgeConfig) -> None:
        """Raises a StorageFault (one line from `ctxfuse edge`) when the state dir cannot be written
        or the outbox is damaged; the outbox first, as it takes the state dir's lock."""
        self.config = config
        check_writable(config.state, "data_dir")  # before anything is opened there
        self.outbox = Outbox(
            config.state / "outbox.sqlite",
            config.outbox_max_bytes,
            config.outbox_full_policy,
            min_free_bytes=config.outbox_min_free_bytes,
        )
        try:
            self.acked = AckedChunks(config.state / "acked.sqlite", config.max_acked_chunks)
            tls = client_context(config.tls_dir, config.name)
        except BaseException:
            self.outbox.close()
            raise
        self.uplink = Uplink(
            config.gateway_url, tls, self.acked, config.chunk_threshold, config.connect_timeout_s
        )
        self.forwarder = Forwarder(self.outbox, self.uplink, config)
        self.images: ImagePipeline | None = None  # loaded at start (the encoder takes a moment)
        self.registry = CollectorRegistry()
        self.request_bytes = Counter(
            "ctxfuse_edge_request_bytes", "Request bytes received from apps", registry=self.registry
        )
        self.upload_bytes = Counter(
            "ctxfuse_edge_upload_bytes",
            "Request bytes sent to the gateway, after dedup and compression",
            registry=self.registry,
        )
        self.images_done = Counter(
            "ctxfuse_edge_images", "Images replaced by their features on the device", registry=self.registry
        )
        self.registry.register(FaultCollector())  # ctxfuse_storage_errors_total{store, kind}

    async def start(self) -> None:
        self.forwarder.start()  # batches accepted before a restart go on from their last state
        try:
            self.images = await asyncio.to_thread(ImagePipeline, self.config.vision)
        except ModelLoadError as exc:
            log.warning("image_features_off", reason=exc.message, images="sent to the gateway as they are")

    async def close(self) -> None:
        await self.forwarder.stop()
        if self.images is not None:
            await self.images.close()
        await self.uplink.close()
        self.outbox.close()
        self.acked.close()


def _agent(request: AnyRequest) -> Agent:
    agent: Agent = request.app.state.agent
    return agent


def _unreachable(agent: Agent, exc: GatewayUnreachable) -> Response[bytes]:
    return _error(
        503,
        f"the cloud gateway cannot be reached ({exc}); retry later",
        "gateway_unreachable",
        {"Retry-After": str(agent.config.retry_after_s)},
    )


async def _relay(resp: httpx.Response) -> Response[Any]:
    """The gateway's answer as the app's: streamed when it streams, else whole; status and body as sent."""
    headers = {k: v for k, v in resp.headers.items() if k.lower() in _PASSED_HEADERS}
    media = resp.headers.get("content-type", JSON)
    if media.startswith("text/event-stream"):

        async def body() -> AsyncIterator[bytes]:
            try:
                async for piece in resp.aiter_raw():
                    yield piece
            finally:  # the app went away: closing upstream makes the gateway abort the request
                await resp.aclose()

        return WatchedStream(
            body(),
            status_code=resp.status_code,
            media_type=media,
            headers=headers,
            background=BackgroundTask(resp.aclose),
        )
    try:
        content = await resp.aread()
    finally:
        await resp.aclose()
    return Response(content, status_code=resp.status_code, media_type=media, headers=headers)


async def _forward(request: AnyRequest, endpoint: Endpoint) -> Response[Any]:
    agent = _agent(request)
    raw = await request.body()
    agent.request_bytes.inc(len(raw))
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return _error(400, f"the request body is not valid JSON ({exc})", "invalid_json")
    if endpoint == "chat.completions" and agent.images is not None:
        try:
            agent.images_done.inc(await replace_images(agent.images, body))
        except InvalidRequestError as exc:
            return _error(400, exc.message, exc.code or "invalid_image", param=exc.param)
    before = agent.uplink.uploaded_bytes
    try:
        resp = await agent.uplink.forward(endpoint, body)
    except GatewayUnreachable as exc:
        return _unreachable(agent, exc)
    finally:
        agent.upload_bytes.inc(agent.uplink.uploaded_bytes - before)
    return await _relay(resp)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: AnyRequest) -> Response[Any]:
    return await _forward(request, "chat.completions")


@post("/v1/completions", status_code=200)
async def completions(request: AnyRequest) -> Response[Any]:
    return await _forward(request, "completions")


@get(["/v1/models", "/v1/models/{model_id:path}"])
async def models(request: AnyRequest) -> Response[Any]:
    agent = _agent(request)
    try:  # the path as the app sent it, checked (a decoded `../` would reach other gateway routes)
        path = forwarded_path(request.scope["raw_path"])
    except UnsafePathError as exc:
        return _error(400, exc.message, exc.code or "invalid_path")
    try:
        resp = await agent.uplink.get(path)
    except GatewayUnreachable as exc:
        return _unreachable(agent, exc)
    return Response(
        resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type", JSON)
    )


@get("/metrics")
async def metrics(request: AnyRequest) -> Response[bytes]:
    return Response(generate_latest(_agent(request).registry), media_type="text/plain; version=0.0.4")


@get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def create_agent_app(agent: Agent) -> ASGIApp:
    """The agent's routes behind the local guard (who may use the port: local_guard.py)."""
    cfg = agent.config
    app = Litestar(
        route_handlers=[chat_completions, completions, models, metrics, health, *batch_routes.ROUTES],
        state=State({"agent": agent}),
        exception_handlers={StorageFault: batch_routes.storage_refused},  # 507 or 503, never a 500
        on_startup=[agent.start],
        on_shutdown=[agent.close],
        request_max_body_size=agent.config.max_body_bytes,
        openapi_config=None,
        logging_config=None,
    )
    return LocalGuard(app, GuardPolicy.of(cfg.api_key, cfg.allowed_hosts, cfg.allowed_origins))
