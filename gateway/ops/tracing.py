"""Traces: OpenTelemetry spans of a request's trip through a gateway (or router), the fleet and a
worker's engine, exported as the standard `OTEL_*` variables say (OTLP over HTTP). Every span name
and attribute is made here; the rest of the gateway calls the hooks below.

One trace per client request, joined across processes by the W3C `traceparent` header (accepted
from clients, sent to workers and to other OpenAI servers on every proxied call):

    gateway request   server  each HTTP request of `serve` or a router (method, route, status, tenant)
      route           client  one attempt of the fleet: the backend chosen, why, and until it answered
        worker request  server  the same request on the worker (/internal/v1/generate, /v1/*)
          queue  prefill  decode  the engine's phases of each choice, from its `PhaseTimes`

The engine (another process) knows nothing of tracing: its finished output carries how long each
phase took (shared/engine_types.py `PhaseTimes`), and the process serving the request lays the
phases out back to back, ending when that output arrived (so they sit a pipe hop late, never
outside their parent). Prompt text is never an attribute.

Off unless the variables ask for an exporter (`wanted`); off costs nothing: no OpenTelemetry module
is imported, the middleware and the backend wrapper are not installed (the app and the backend are
returned as they were), and the two hooks on the fleet's path (`route_attempt`, `inject`) test one
module variable. On, the SDK reads its own variables (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_TRACES_SAMPLER[_ARG], OTEL_PROPAGATORS, OTEL_BSP_*, OTEL_EXPORTER_OTLP_*); spans go through a
BatchSpanProcessor, flushed when the process exits (the provider's exit hook).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.access.auth import Principal
from gateway.ops.observe import annotate, request_id
from gateway.seam import Backend, Generation
from shared.engine_types import ChatPrompt, EngineStats, ImageSpan, Pooling, RequestOutput, SamplingParams
from shared.errors import CtxfuseError

if TYPE_CHECKING:  # imported at run time only once tracing is on
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

EXPORTERS = ("otlp", "console")  # OTEL_TRACES_EXPORTER values we run ("none": none)
OTLP_PROTOCOL = "http/protobuf"  # the one OTLP protocol installed (opentelemetry-exporter-otlp-proto-http)
# probes, scrapes and the router's polls: a span a second per backend would bury the requests
UNTRACED_PATHS = frozenset(
    {"/health", "/ready", "/metrics", "/internal/v1/state", "/internal/v1/blocks", "/internal/v1/text-side"}
)


def exporters(env: Mapping[str, str]) -> tuple[str, ...]:
    """The trace exporters `env` asks for; () means tracing is off.

    As the specification says, OTEL_SDK_DISABLED=true (any case) turns everything off and
    OTEL_TRACES_EXPORTER names the exporters (comma-separated, "none" for none). Unlike its default
    (otlp), a server whose variables name no exporter and no OTLP endpoint traces nothing: one that
    nobody configured must neither pay for spans nor send them to localhost:4318."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    named = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if named:
        return () if "none" in named else tuple(dict.fromkeys(named))
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return ("otlp",) if endpoint and endpoint.strip() else ()


enabled: bool = bool(exporters(os.environ))  # decided once, when the gateway is imported
_tracer: Tracer | None = None  # made by the first app's middleware (`start`), when enabled
_OFF: AbstractContextManager[None] = nullcontext()  # the one "span" every hook returns when off


def start(service: str) -> Tracer:
    """The process's tracer, made once: the SDK's provider with a batch processor per exporter.
    `service`: service.name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one.
    Raises CtxfuseError for an exporter or OTLP protocol this install cannot run."""
    global _tracer
    if _tracer is not None:
        return _tracer
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    processors = [BatchSpanProcessor(_exporter(name, os.environ)) for name in exporters(os.environ)]
    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, then OTEL_SERVICE_NAME over it
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    # the sampler from OTEL_TRACES_SAMPLER(_ARG); shut down, so flushed, when the process exits
    provider = TracerProvider(resource=resource, shutdown_on_exit=True)
    for processor in processors:
        provider.add_span_processor(processor)
    _tracer = provider.get_tracer("ctxfuse")
    return _tracer


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name not in EXPORTERS:
        runs = ", ".join(EXPORTERS)
        raise CtxfuseError(f"OTEL_TRACES_EXPORTER names {name!r}; ctxfuse runs {runs} (or none)")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol.strip() != OTLP_PROTOCOL:
        raise CtxfuseError(f"OTLP protocol {protocol!r} is not installed; ctxfuse exports {OTLP_PROTOCOL}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: OTEL_EXPORTER_OTLP_*


# -- the request spans ---------------------------------------------------------------------------


def middleware(app: ASGIApp, *, worker: bool) -> ASGIApp:
    """`app` with a server span around each HTTP request (`worker request` on a worker, else
    `gateway request`), or `app` itself when tracing is off."""
    if not enabled:
        return app
    tracer = start("ctxfuse-worker" if worker else "ctxfuse-gateway")
    return _TraceRequests(app, "worker request" if worker else "gateway request", tracer)


class _TraceRequests:
    """Inside the request observer (gateway/ops/observe.py), which supplies the request id and logs
    the trace id; outside authentication, so refusals are spans too."""

    def __init__(self, app: ASGIApp, name: str, tracer: Tracer) -> None:
        self.app = app
        self.name = name
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, StatusCode

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        attributes: dict[str, str] = {
            "http.request.method": str(scope.get("method", "")),
            "url.path": scope["path"],
            "ctxfuse.request_id": request_id(),
        }
        with self.tracer.start_as_current_span(
            self.name, context=propagate.extract(carrier), kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            annotate(trace_id=f"{span.get_span_context().trace_id:032x}")
            try:
                await self.app(scope, receive, send_status)
            finally:
                # status 0: the client went away before any response (499, as the request log says)
                span.set_attribute("http.response.status_code", status or 499)
                span.set_attribute("http.route", scope.get("path_template") or "unmatched")
                principal = scope.get("state", {}).get("principal")
                if isinstance(principal, Principal):
                    span.set_attribute("ctxfuse.tenant", principal.tenant)
                if status >= 500:
                    span.set_status(StatusCode.ERROR)


# -- the fleet -------------------------------------------------------------------------------------


def route_attempt(
    backend: str,
    version: str,
    policy: str,
    attempt: int,
    decision: str,
    matched_keys: int,
    block_size: int | None,
) -> AbstractContextManager[Span | None]:
    """The current span for one attempt of the fleet's route loop (gateway/backends/fleet/proxy.py),
    from the choice of `backend` until it answered; `block_size`: the backend's, when its prefix keys
    are token blocks (a ctxfuse worker), None for text chunks."""
    if _tracer is None:
        return _OFF
    from opentelemetry.trace import SpanKind

    attributes: dict[str, str | int] = {
        "ctxfuse.backend": backend,
        "ctxfuse.backend.version": version,
        "ctxfuse.route.policy": policy,
        "ctxfuse.route.attempt": attempt,
        "ctxfuse.route.decision": decision,
        "ctxfuse.route.prefix_keys_matched": matched_keys,
    }
    if block_size:
        attributes["ctxfuse.route.prefix_tokens_matched"] = matched_keys * block_size
    return _tracer.start_as_current_span("route", kind=SpanKind.CLIENT, attributes=attributes)


def failed(span: Span | None, why: str) -> None:
    """Mark `span` (None: tracing is off) as failed, e.g. an attempt another backend will retry."""
    if span is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, why))


def inject(headers: dict[str, str]) -> None:
    """Add the current span's `traceparent` (and `tracestate`) to a proxied call's headers."""
    if _tracer is None:
        return
    from opentelemetry import propagate

    propagate.inject(headers)


# -- the engine's phases ---------------------------------------------------------------------------


def traced(backend: Backend) -> Backend:
    """`backend`, whose generations record their choices' engine phases as spans under the span
    that submitted them; `backend` itself when tracing is off."""
    return _PhasedBackend(backend) if enabled else backend


class _PhasedBackend:
    """A `Backend` that is `inner` but for the generations it returns."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.max_model_len = inner.max_model_len
        self.hidden_size = inner.hidden_size
        self.tokenizer = inner.tokenizer
        self.context_overflow = inner.context_overflow

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> Generation:
        gen = await self.inner.submit(
            prompt_token_ids, params, request_id, priority=priority, image_spans=image_spans
        )
        if _tracer is None:  # no app started tracing in this process
            return gen
        from opentelemetry import context

        return _PhasedGeneration(gen, _tracer, context.get_current())

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self.inner.default_max_tokens(num_prompt_tokens)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        return self.inner.encode_chat(messages, tools, tool_choice, template_kwargs)

    def check_text_size(self, num_chars: int) -> None:
        self.inner.check_text_size(num_chars)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.inner.check(prompt_token_ids, params)

    async def embed(self, inputs: list[list[int]], pooling: Pooling, request_id: str) -> np.ndarray:
        return await self.inner.embed(inputs, pooling, request_id)

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def is_alive(self) -> bool:
        return self.inner.is_alive()

    def shutdown(self) -> None:
        self.inner.shutdown()


class _PhasedGeneration:
    def __init__(self, inner: Generation, tracer: Tracer, parent: Context) -> None:
        self.request_id = inner.request_id
        self._inner = inner
        self._tracer = tracer
        self._parent = parent

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        async for out in self._inner:
            if out.phases is not None:
                record_phases(self._tracer, self._parent, out, time.time_ns())
            yield out

    def close(self) -> None:
        self._inner.close()


def record_phases(tracer: Tracer, parent: Context, out: RequestOutput, finished_ns: int) -> None:
    """`queue`, `prefill` and `decode` spans of a finished choice under `parent`, back to back and
    ending at `finished_ns` (wall clock, ns); a phase that never began has no span."""
    phases = out.phases
    if phases is None:
        return
    from opentelemetry.trace import StatusCode

    common: dict[str, str | int] = {"ctxfuse.request_id": out.request_id, "ctxfuse.choice": out.index}
    last: dict[str, str | int] = {"ctxfuse.finish_reason": out.finish_reason or ""}
    laid = [
        ("decode", phases.decode_s, {"ctxfuse.output_tokens": out.num_output_tokens}),
        ("prefill", phases.prefill_s, {"ctxfuse.prompt_tokens": out.num_prompt_tokens,
                                       "ctxfuse.cached_tokens": out.num_cached_tokens}),
        ("queue", phases.queue_s, {}),
    ]  # fmt: skip
    end = finished_ns
    for name, seconds, own in laid:
        if seconds is None:
            continue
        begin = end - round(seconds * 1e9)
        span = tracer.start_span(name, context=parent, start_time=begin, attributes={**common, **own, **last})
        if last and out.finish_reason == "error":
            span.set_status(StatusCode.ERROR, out.error or "error")
        span.end(end_time=end)
        end, last = begin, {}
