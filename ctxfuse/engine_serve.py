"""`ctxfuse serve` and `ctxfuse worker` over a local engine: load each model's engine (in a child
process, or in this one), put the gateway in front of it and serve until a signal. This is the one
place that joins the gateway (which imports no engine) to the engine (cloud/serving/).

On a signal the gateway drains (gateway/server.py); if the engine dies, `serve` stops the same way and
exits non-zero, so a supervisor (systemd, Kubernetes) restarts it: a process whose engine is gone can
only refuse work.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from cloud.engine.config import EngineConfig
from cloud.model.text_side import describe_text_side
from cloud.serving.in_process import InProcessBackend
from cloud.serving.process import ProcessBackend
from gateway.app import require_worker_key
from gateway.backends.local import EngineUpstream
from gateway.backends.models import ModelsUpstream
from gateway.backends.worker import WorkerEngine
from gateway.config import GatewayConfig
from gateway.edge.stores import AnyChunkStore, open_chunk_store
from gateway.ops.logs import configure_logging
from gateway.server import run_servers, server_for
from gateway.state import Gateway
from gateway.upstream import Upstream
from shared.errors import CtxfuseError


def worker_engine(backend: InProcessBackend | ProcessBackend) -> WorkerEngine:
    """What a worker's internal routes read from its engine: the block events of its prefix cache
    (the core's own, or the mirror the engine process's batches keep), and its text side."""
    text = describe_text_side(
        backend.model_name,
        backend.tokenizer,
        backend.chat_template,
        max_model_len=backend.max_model_len,
        hidden_size=backend.hidden_size,
        context_overflow=backend.context_overflow,
    )
    return WorkerEngine(backend.block_size, backend.max_num_seqs, backend.block_events, text)


def serve(
    engine_config: EngineConfig | Sequence[EngineConfig],
    config: GatewayConfig,
    worker: bool = False,
    aliases: Mapping[str, str] | None = None,
) -> int:
    """Serve until a signal; several engine configs: one engine per model (`--model NAME=PATH`
    repeated), each request run by the one it names; `worker`: as `ctxfuse worker` (one model, the
    internal routes, no Batch API)."""
    configs = [engine_config] if isinstance(engine_config, EngineConfig) else list(engine_config)
    if worker and (len(configs) > 1 or aliases):
        raise CtxfuseError("a worker serves one model under one name; run a worker per model")
    if worker:
        require_worker_key(config)  # before minutes of model loading, not after
    configure_logging(config.log_level)
    if not config.is_loopback and not config.api_key:
        print(
            f"ctxfuse: warning: serving on {config.host} without an API key; anyone who can reach this "
            "address can use the model (set --api-key or CTXFUSE_API_KEY)",
            file=sys.stderr,
        )
    backends: list[InProcessBackend | ProcessBackend] = []
    engine = None
    store: AnyChunkStore | None = None
    try:
        for c in configs:
            print(f"ctxfuse: loading the model {c.model or ''} ...", file=sys.stderr, flush=True)
            backend = ProcessBackend(c) if config.engine_process else InProcessBackend.from_config(c)
            engine = worker_engine(backend) if worker else None
            backends.append(backend)
            for line in backend.describe:
                print(f"ctxfuse: {line}", file=sys.stderr, flush=True)
        engines = [EngineUpstream(b, config, engine) for b in backends]
        upstream: Upstream = engines[0]
        if len(engines) > 1 or aliases:
            upstream = ModelsUpstream(engines, dict(aliases or {}))
        gateway = Gateway(upstream, config)
        if config.edge_port is not None:  # in the shared Redis with --redis-url, else a local file
            gateway.chunk_store = store = open_chunk_store(config, gateway.redis)
        server = server_for(gateway, worker=worker, exit_on_engine_death=True)
        run_servers(server)
    finally:
        for b in backends:
            b.shutdown()
        if store is not None:
            store.close()
    if server.engine_died:
        print("ctxfuse: the engine has stopped; exiting for a supervisor to restart", file=sys.stderr)
        return 1
    return 0 if server.started else 1
