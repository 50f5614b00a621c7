"""`ctxfuse serve`: the gateway, with an in-process engine or (`--backend`, `--fleet`) as a router
over other servers; and the HTTP options it shares with `ctxfuse worker`."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from ctxfuse.engine_cli import add_engine_options, engine_config

if TYPE_CHECKING:
    from gateway.config import GatewayConfig


def http_config(args: argparse.Namespace) -> GatewayConfig:
    """The gateway's HTTP side from add_gateway_options' flags."""
    from gateway.config import GatewayConfig

    return GatewayConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        log_content=args.log_content,
        max_body_bytes=int(args.max_body_mib * 2**20),
        shutdown_timeout_s=args.shutdown_timeout,
        log_level=args.log_level,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from ctxfuse.edge_cli import check_edge_listener
    from ctxfuse.fleet_cli import fleet_config
    from ctxfuse.vision_cli import ensure_vision_files, vision_options
    from gateway.server import serve

    problem = check_edge_listener(args)
    if problem:
        print(f"ctxfuse: {problem}", file=sys.stderr)
        return 2
    gateway = replace(
        http_config(args),
        edge_host=args.edge_host,
        edge_port=args.edge_port,
        tls_dir=args.tls_dir,
        chunk_store=args.chunk_store,
        chunk_store_mib=args.chunk_store_mib,
        device_max_in_flight=args.device_max_in_flight,
        data_dir=args.data_dir,
        vision=vision_options(args),
        engine_process=not args.engine_in_process,
    )
    try:
        fleet = fleet_config(args)
    except ValueError as exc:
        print(f"ctxfuse: {exc}", file=sys.stderr)
        return 2
    if fleet is not None:  # a router: no engine here, only the model's tokenizer
        from gateway.fleet.serve import serve_fleet

        return serve_fleet(fleet, gateway, args.model)
    ensure_vision_files()
    return serve(engine_config(args), gateway)


def add_gateway_options(p: argparse.ArgumentParser) -> None:
    from gateway.config import GatewayConfig

    d = GatewayConfig()
    g = p.add_argument_group("gateway")
    g.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    g.add_argument(
        "--port", type=int, default=d.port, help=f"port to listen on; 0 picks a free one (default {d.port})"
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("CTXFUSE_API_KEY"),
        help="require `Authorization: Bearer KEY` on API routes (default: $CTXFUSE_API_KEY, else none)",
    )
    g.add_argument(
        "--log-content", action="store_true", help="write prompts and completions into the request log"
    )
    g.add_argument(
        "--max-body-mib",
        type=float,
        default=d.max_body_bytes / 2**20,
        help=f"largest request body in MiB; larger gets a 413 (default {d.max_body_bytes / 2**20:g})",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout_s,
        help=f"on SIGTERM, seconds running requests get to finish (default {d.shutdown_timeout_s:g})",
    )
    g.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=d.log_level,
        help=f"log level (default {d.log_level})",
    )


def add_serve_parser(sv: argparse.ArgumentParser) -> None:
    from ctxfuse.batch_cli import add_batch_options
    from ctxfuse.edge_cli import add_edge_listener_options
    from ctxfuse.fleet_cli import add_fleet_options
    from ctxfuse.vision_cli import add_image_options

    add_gateway_options(sv)
    sv.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine on a thread of the gateway's process instead of in a process of its own "
        "(the default: the HTTP side and the engine then never wait on one GIL)",
    )
    add_edge_listener_options(sv)
    add_batch_options(sv)
    add_image_options(sv)
    add_fleet_options(sv)
    add_engine_options(sv)
    sv.set_defaults(func=_cmd_serve)
