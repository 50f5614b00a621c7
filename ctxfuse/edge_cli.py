"""The edge options of `ctxfuse serve` (the gateway's mutual-TLS listener) and `ctxfuse edge` (the
agent on a device)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ctxfuse.cli_values import SecretOption, non_negative_float

# what apps on the device must send the agent; ctxfuse/cli_values.py imports no cloud side
AGENT_KEY = SecretOption("--api-key", env="CTXFUSE_EDGE_API_KEY")


def add_edge_listener_options(p: argparse.ArgumentParser) -> None:
    from gateway.config import GatewayConfig

    d = GatewayConfig()
    g = p.add_argument_group("edge listener (mutual TLS, for `ctxfuse edge` agents)")
    g.add_argument(
        "--edge-port", type=int, default=None, help="serve the edge link on this port (default off)"
    )
    g.add_argument(
        "--edge-host", default=d.edge_host, help=f"address of the edge listener (default {d.edge_host})"
    )
    g.add_argument(
        "--tls-dir", type=Path, default=None, help="the directory `ctxfuse certs` made (CA, server cert, CRL)"
    )
    g.add_argument(
        "--chunk-store",
        type=Path,
        default=None,
        help="SQLite file of edge chunks (default CTXFUSE_HOME/chunks.sqlite)",
    )
    g.add_argument(
        "--device-max-in-flight",
        type=int,
        default=d.device_max_in_flight,
        help=f"requests one device may have running; more get a 429 (default {d.device_max_in_flight})",
    )
    g.add_argument(
        "--chunk-store-mib",
        type=float,
        default=d.chunk_store_mib,
        help=f"bound on stored chunk bytes; least recently used go first (default {d.chunk_store_mib:g})",
    )


def check_edge_listener(args: argparse.Namespace) -> str | None:
    """Why the edge options do not fit together, or None."""
    if args.edge_port is not None and args.tls_dir is None:
        return "--edge-port needs --tls-dir (make one with `ctxfuse certs init`)"
    return None


def _cmd_edge(args: argparse.Namespace) -> int:
    from ctxfuse.vision_cli import vision_options
    from edge.config import EdgeConfig
    from edge.server import agent_server

    config = EdgeConfig(
        gateway_url=args.gateway,
        tls_dir=args.tls_dir,
        name=args.name,
        host=args.host,
        port=args.port,
        state_dir=args.state_dir,
        chunk_threshold=args.chunk_threshold,
        outbox_max_bytes=int(args.outbox_max_mib * 2**20),
        outbox_full_policy=args.outbox_full_policy,
        outbox_min_free_bytes=int(args.outbox_min_free_mib * 2**20),
        retry_cap_s=args.retry_cap_s,
        vision=vision_options(args),
        api_key=AGENT_KEY.read(args),
        allowed_hosts=tuple(args.allowed_host),
        allowed_origins=tuple(args.allowed_origin),
    )
    server = agent_server(config, args.log_level)
    print(
        f"ctxfuse edge: {config.name} -> {config.gateway_url}; apps use base_url=http://{config.host}:{config.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    return 0


def add_edge_parser(p: argparse.ArgumentParser) -> None:
    from ctxfuse.vision_cli import add_image_options
    from edge.config import EdgeConfig

    d = EdgeConfig(gateway_url="", tls_dir=Path(), name="")
    p.add_argument("--gateway", required=True, help="the gateway's edge listener, e.g. https://gateway:8443")
    p.add_argument(
        "--tls-dir", type=Path, required=True, help="CA certificate and this device's certificate and key"
    )
    p.add_argument("--name", required=True, help="this device's name, as its certificate was issued")
    p.add_argument(
        "--host",
        default=d.host,
        help=f"address apps connect to (default {d.host}; any address off loopback is warned about)",
    )
    p.add_argument("--port", type=int, default=d.port, help=f"port apps connect to (default {d.port})")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="acknowledged chunks and the batch outbox (default CTXFUSE_HOME/edge)",
    )
    p.add_argument(
        "--outbox-max-mib",
        type=float,
        default=d.outbox_max_bytes / 2**20,
        help=f"bound on batch files held for the gateway (default {d.outbox_max_bytes / 2**20:g})",
    )
    p.add_argument(
        "--outbox-full-policy",
        choices=["refuse", "drop_oldest"],
        default=d.outbox_full_policy,
        help=f"when the outbox is full: refuse new files (429) or drop the oldest batches"
        f" (default {d.outbox_full_policy})",
    )
    p.add_argument(
        "--outbox-min-free-mib",
        type=non_negative_float,
        default=d.outbox_min_free_bytes / 2**20,
        help="free space an app's upload may not take from the state dir's disk: an upload that would"
        " leave less gets a 507 (insufficient_storage), so batches already accepted can still be"
        f" forwarded and their results stored (default {d.outbox_min_free_bytes / 2**20:g})",
    )
    p.add_argument(
        "--retry-cap-s",
        type=float,
        default=d.retry_cap_s,
        help=f"longest wait between attempts to reach the gateway (default {d.retry_cap_s:g})",
    )
    p.add_argument(
        "--chunk-threshold",
        type=int,
        default=d.chunk_threshold,
        help=f"strings of at least this many bytes travel as chunks (default {d.chunk_threshold})",
    )
    g = p.add_argument_group("who may use the agent's port (the device's identity stands behind it)")
    AGENT_KEY.add(
        g, help=f"require `Authorization: Bearer KEY` from apps (default: ${AGENT_KEY.env}, else none)"
    )
    g.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name apps may use besides localhost, 127.0.0.1 and [::1] (repeat for more;"
        " ports are ignored)",
    )
    g.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web page origin (e.g. http://localhost:3000) that may call the agent; requests from"
        " any other page get a 403 (default: none)",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    add_image_options(p)
    p.set_defaults(func=_cmd_edge)
