"""`ctxfuse worker`: one engine behind the OpenAI API and the internal routes a routing gateway reads
(gateway/worker_routes.py). The engine options are serve's; so are the HTTP ones, but a worker listens
on 8001 by default, beside a gateway on 8000."""

from __future__ import annotations

import argparse

WORKER_PORT = 8001


def add_worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ctxfuse.cli import add_engine_options, add_gateway_options

    # "resolve": the --port below replaces the gateway's, keeping its other HTTP options
    w = sub.add_parser(
        "worker",
        help=f"an engine for a routing gateway: the OpenAI API and internal state (127.0.0.1:{WORKER_PORT})",
        conflict_handler="resolve",
    )
    add_gateway_options(w)
    w.add_argument_group("worker").add_argument(
        "--port",
        type=int,
        default=WORKER_PORT,
        help=f"port to listen on; 0 picks a free one (default {WORKER_PORT})",
    )
    add_engine_options(w)
    w.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace) -> int:
    from ctxfuse.cli import engine_config
    from gateway.config import GatewayConfig
    from gateway.server import serve

    gateway = GatewayConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        log_content=args.log_content,
        max_body_bytes=int(args.max_body_mib * 2**20),
        shutdown_timeout_s=args.shutdown_timeout,
        log_level=args.log_level,
    )
    return serve(engine_config(args), gateway, worker=True)
