"""The fleet options of `ctxfuse serve`: route to other servers instead of running an engine."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import get_args

from gateway.backends.fleet.config import FleetConfig, Policy, from_urls, load


def add_fleet_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "fleet (route to ctxfuse workers or other OpenAI-compatible servers instead of running an engine)"
    )
    g.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="a backend's base URL, e.g. http://10.0.0.1:8001 (repeatable); its kind is found by asking it",
    )
    g.add_argument(
        "--fleet",
        type=Path,
        default=None,
        metavar="FILE",
        help="a fleet file (TOML): backends with names, versions and weights, routing and canary settings",
    )
    g.add_argument(
        "--backend-key",
        default=os.environ.get("CTXFUSE_BACKEND_KEY"),
        help="the key the router sends backends (`Authorization: Bearer`); ctxfuse workers require "
        "one: their --api-key (default: $CTXFUSE_BACKEND_KEY; a fleet file's backend may name its own "
        "api_key)",
    )
    g.add_argument(
        "--backend-key-file", type=Path, default=None, help="read --backend-key from this file's first line"
    )
    g.add_argument(
        "--routing",
        choices=get_args(Policy),
        default=None,
        help="routing policy (default: the fleet file's, else prefix)",
    )


def fleet_config(args: argparse.Namespace) -> FleetConfig | None:
    """The fleet asked for on the command line, or None (serve with an in-process engine)."""
    if args.fleet is not None and args.backend:
        raise ValueError("give --fleet or --backend, not both")
    config = None
    if args.fleet is not None:
        config = load(args.fleet)
        if args.routing is not None:
            config = replace(config, policy=args.routing)
    elif args.backend:
        config = from_urls(args.backend, args.routing or "prefix")
    if config is None:
        return None
    key = args.backend_key
    if args.backend_key_file is not None and not key:
        lines = args.backend_key_file.read_text().strip().splitlines()
        key = lines[0].strip() if lines else None
    return replace(config, backend_key=key or None)
