"""The fleet options of `ctxfuse serve`: route to other servers instead of running an engine."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import get_args

from ctxfuse.cli_values import SecretOption
from gateway.backends.fleet.config import FleetConfig, Policy, from_urls, load

BACKEND_KEY = SecretOption("--backend-key", env="CTXFUSE_BACKEND_KEY")  # what the router sends workers


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
    BACKEND_KEY.add(
        g,
        help="the key the router sends backends (`Authorization: Bearer`); ctxfuse workers require "
        f"one: their --api-key (default: ${BACKEND_KEY.env}; a fleet file's backend may name its own "
        "api_key)",
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
    return replace(config, backend_key=BACKEND_KEY.read(args))
