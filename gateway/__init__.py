"""The OpenAI-compatible front door (Litestar + msgspec): one app (app.py) over a pluggable upstream.

- access/   who calls and how much: tenants' keys, authentication, per-key limits
- openai/   the OpenAI routes, and chat, completions, streaming and structured outputs over an engine
- batch/    the Files and Batch API: stores, routes, runner
- edge/     the mutual-TLS edge listener: routes, chunk store, expansion bounds
- backends/ what answers: the engine (local.py, process.py, worker.py) or the fleet router (fleet/)
- ops/      health, readiness, metrics, request logs, the OpenAPI document
- bench/    the gateway's benchmarks (`ctxfuse bench ...`)
"""
