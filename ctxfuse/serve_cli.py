"""`ctxfuse serve`: the gateway, with an in-process engine or (`--backend`, `--fleet`) as a router
over other servers; and the HTTP options it shares with `ctxfuse worker`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ctxfuse.cli_values import SecretOption, positive_float, positive_int
from ctxfuse.engine_cli import add_engine_options, engine_config, engine_configs
from ctxfuse.shared_state_cli import REDIS_URL

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

API_KEY = SecretOption("--api-key", env="CTXFUSE_API_KEY")  # the gateway's (or a worker's) own key


def http_config(args: argparse.Namespace) -> GatewayConfig:
    """The gateway's HTTP side from add_gateway_options' flags."""
    from gateway.config import GatewayConfig
    from shared.conn_limits import ConnLimits

    limits = ConnLimits(
        header_timeout_s=args.header_timeout,
        max_header_bytes=int(args.max_header_kib * 1024),
        max_connections=args.max_connections,
        max_connection_requests=args.max_connection_requests,
        max_connection_age_s=args.max_connection_age,
    )
    return GatewayConfig(
        host=args.host,
        port=args.port,
        api_key=API_KEY.read(args),
        log_content=args.log_content,
        share_prefix_cache=args.share_prefix_cache,
        embedding_token_ids=not args.no_embedding_token_ids,
        max_body_bytes=int(args.max_body_mib * 2**20),
        shutdown_timeout_s=args.shutdown_timeout,
        log_level=args.log_level,
        conn_limits=limits,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )


def check_tls_options(args: argparse.Namespace) -> str | None:
    """A problem with --ssl-certfile/--ssl-keyfile, or None."""
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        return "--ssl-certfile and --ssl-keyfile go together"
    for path in (args.ssl_certfile, args.ssl_keyfile):
        if path is not None and not path.is_file():
            return f"{path} does not exist (make one with `ctxfuse certs server DIR --host NAME`)"
    return None


def check_redis_options(args: argparse.Namespace) -> str | None:
    """A problem with --redis-url and the local stores it replaces, or None."""
    if args.chunk_store is not None and REDIS_URL.read(args) is not None:
        return "--chunk-store names a local file, but with --redis-url the edge link's chunks live in Redis"
    return None


def _cmd_serve(args: argparse.Namespace) -> int:
    from ctxfuse.edge_cli import check_edge_listener
    from ctxfuse.fleet_cli import fleet_config
    from ctxfuse.vision_cli import ensure_vision_files, vision_options

    problem = check_edge_listener(args) or check_tls_options(args) or check_redis_options(args)
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
        max_running_batches=args.max_running_batches,
        batch_lease_s=args.batch_lease,
        file_ttl_days=args.file_ttl_days,
        min_free_mib=args.min_free_mib,
        vision=vision_options(args),
        engine_process=not args.engine_in_process,
        redis_url=REDIS_URL.read(args),
        bench_results=args.bench_results,
    )
    from gateway.ops.preflight import check_data_dir

    check_data_dir(gateway)  # a read-only or damaged data dir: one line, before the model loads
    try:
        fleet = fleet_config(args)
    except ValueError as exc:
        print(f"ctxfuse: {exc}", file=sys.stderr)
        return 2
    if fleet is not None:  # a router: no engine here, only the model's tokenizer
        from gateway.backends.fleet.serve import serve_fleet

        # the router names prompt blocks with one model's tokenizer and template
        return serve_fleet(fleet, gateway, engine_config(args).model, args.chat_template)
    from ctxfuse.engine_serve import serve  # the engine: torch and the model code, never for a router

    ensure_vision_files()
    return serve(engine_configs(args), gateway, aliases=dict(args.alias or []))


def add_engine_process_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine on a thread of the gateway's process instead of in a process of its own "
        "(the default: the HTTP side and the engine then never wait on one GIL)",
    )


def add_gateway_options(p: argparse.ArgumentParser) -> None:
    from gateway.config import GatewayConfig

    d = GatewayConfig()
    g = p.add_argument_group("gateway")
    g.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    g.add_argument(
        "--port", type=int, default=d.port, help=f"port to listen on; 0 picks a free one (default {d.port})"
    )
    API_KEY.add(
        g,
        help=f"require `Authorization: Bearer KEY` on API routes (default: ${API_KEY.env}, else none)",
        file_help="read the --api-key from this file's first line (keeps it out of the process list); "
        "tenants' own keys come from `ctxfuse keys create`",
    )
    g.add_argument(
        "--share-prefix-cache",
        action="store_true",
        help="let tenants reuse one another's cached prompt prefixes (default: each tenant's cache is "
        "its own, so cached_tokens and TTFT never reveal what another tenant sent)",
    )
    g.add_argument(
        "--no-embedding-token-ids",
        action="store_true",
        help="refuse token ids as /v1/embeddings input (default: taken, as OpenAI takes them; ids from "
        "another model's vocabulary, as LangChain's OpenAIEmbeddings sends by default, embed as nonsense)",
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
    g.add_argument(
        "--ssl-certfile",
        type=Path,
        default=None,
        help="serve the OpenAI port over TLS with this certificate (PEM), e.g. the server.pem of "
        "`ctxfuse certs server DIR --host NAME` (default: plain HTTP)",
    )
    g.add_argument("--ssl-keyfile", type=Path, default=None, help="the key of --ssl-certfile (PEM)")
    add_connection_options(p)


def add_connection_options(p: argparse.ArgumentParser) -> None:
    from shared.conn_limits import ConnLimits

    d = ConnLimits()
    g = p.add_argument_group("connections (each listener: the OpenAI port and the edge listener)")
    g.add_argument(
        "--header-timeout",
        type=positive_float,
        default=d.header_timeout_s,
        help=f"seconds a client has to send a request's head; then the connection closes "
        f"(default {d.header_timeout_s:g})",
    )
    g.add_argument(
        "--max-header-kib",
        type=positive_float,
        default=d.max_header_bytes / 1024,
        help=f"largest request head in KiB; larger gets a 431 (default {d.max_header_bytes / 1024:g})",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=d.max_connections,
        help=f"open connections per listener; more get a 503 and are closed (default {d.max_connections})",
    )
    g.add_argument(
        "--max-connection-requests",
        type=positive_int,
        default=d.max_connection_requests,
        help="requests on one kept-alive connection before it is closed "
        f"(default {d.max_connection_requests})",
    )
    g.add_argument(
        "--max-connection-age",
        type=positive_float,
        default=d.max_connection_age_s,
        help=f"seconds a kept-alive connection is reused; the next response closes it "
        f"(default {d.max_connection_age_s:g})",
    )


def add_console_options(p: argparse.ArgumentParser) -> None:
    from gateway.config import GatewayConfig

    p.add_argument(
        "--bench-results",
        type=Path,
        default=GatewayConfig().bench_results,
        metavar="DIR",
        help="where `ctxfuse bench` wrote its results: the console (/console) shows the long-context "
        "benchmark's heatmaps from DIR/longctx (default %(default)s, in the working directory)",
    )


def add_serve_parser(sv: argparse.ArgumentParser) -> None:
    from ctxfuse.batch_cli import add_batch_options
    from ctxfuse.edge_cli import add_edge_listener_options
    from ctxfuse.fleet_cli import add_fleet_options
    from ctxfuse.shared_state_cli import add_redis_option
    from ctxfuse.vision_cli import add_image_options

    add_gateway_options(sv)
    add_console_options(sv)
    add_engine_process_option(sv)
    add_edge_listener_options(sv)
    add_batch_options(sv)
    add_redis_option(sv)
    add_image_options(sv)
    add_fleet_options(sv)
    add_engine_options(sv)
    sv.add_argument(
        "--alias",
        action="append",
        type=alias_spec,
        default=None,
        metavar="ALIAS=NAME",
        help="another name clients may use for the served model NAME (repeatable)",
    )
    sv.set_defaults(func=_cmd_serve)


def alias_spec(text: str) -> tuple[str, str]:
    alias, sep, name = text.partition("=")
    if not (sep and alias.strip() and name.strip()):
        raise argparse.ArgumentTypeError(f"expected ALIAS=NAME, got {text!r}")
    return alias.strip(), name.strip()
