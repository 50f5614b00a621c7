"""`ctxfuse worker`: one engine behind the OpenAI API and the internal routes a routing gateway reads
(gateway/backends/worker.py). The engine options are serve's; so are the HTTP ones, but a worker listens
on 8001 by default, beside a gateway on 8000. Like serve's, its engine steps in a process of its own
(the prefix cache's events cross the pipe to the internal routes), so its event loop never waits on a
step."""

from __future__ import annotations

import argparse
from dataclasses import replace

WORKER_PORT = 8001


def add_worker_parser(w: argparse.ArgumentParser) -> None:
    from ctxfuse.engine_cli import add_engine_options
    from ctxfuse.serve_cli import add_engine_process_option, add_gateway_options

    w.conflict_handler = "resolve"  # the --port below replaces the gateway's, keeping its other HTTP options
    add_gateway_options(w)
    w.add_argument_group("worker").add_argument(
        "--port",
        type=int,
        default=WORKER_PORT,
        help=f"port to listen on; 0 picks a free one (default {WORKER_PORT})",
    )
    add_engine_process_option(w)
    add_engine_options(w)
    w.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace) -> int:
    from ctxfuse.engine_cli import engine_config
    from ctxfuse.engine_serve import serve
    from ctxfuse.serve_cli import http_config

    config = replace(http_config(args), engine_process=not args.engine_in_process)
    return serve(engine_config(args), config, worker=True)
