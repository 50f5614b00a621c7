"""`ctxfuse worker` as a user (or a test of a fleet) runs it: serve's engine options in its help, its own
default port, and a subprocess that prints its base_url, answers its internal state and the official
client, and exits cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec

from ctxfuse.cli import build_parser
from ctxfuse.engine_cli import add_engine_options
from ctxfuse.serve_cli import API_KEY
from gateway.bench.worker_proc import WorkerProcess
from shared.fleet_protocol import HASH_SCHEME, WorkerState

from .conftest import MODEL

REPO = Path(__file__).resolve().parents[2]


def engine_option_strings() -> list[str]:
    """Every engine option (serve's, generate's, bench's), as argparse holds them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_options(parser)
    return [s for action in parser._actions for s in action.option_strings]


def test_worker_help_lists_every_engine_option_of_serve() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "ctxfuse", "worker", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    options = engine_option_strings()
    assert "--kv-cache-memory" in options and "--no-prefix-caching" in options
    for option in [*options, "--host", "--port", "--api-key", "--shutdown-timeout", "--log-level"]:
        assert option in help_text, option


def test_worker_defaults_to_loopback_port_8001() -> None:
    args = build_parser().parse_args(["worker"])
    assert (args.host, args.port, API_KEY.read(args)) == (
        "127.0.0.1",
        8001,
        os.environ.get("CTXFUSE_API_KEY") or None,
    )
    args = build_parser().parse_args(["worker", "--port", "9100", "--max-num-seqs", "3"])
    assert (args.port, args.max_num_seqs) == (9100, 3)


def test_worker_process_prints_its_base_url_reports_state_and_exits_on_sigterm(gguf_path: Path) -> None:
    engine = ["--dtype", "float32", "--weight-quant", "none", "--kv-cache-memory", "0.25"]
    worker = WorkerProcess(gguf_path, MODEL, *engine, "--max-model-len", "1024", "--max-num-seqs", "4")
    try:
        root = worker.wait_ready()  # the base_url line, printed once it listens
        state = msgspec.json.decode(
            httpx.get(f"{root}/internal/v1/state", headers=worker.auth, timeout=10).content, type=WorkerState
        )
        assert (state.model, state.hash_scheme, state.block_size) == (MODEL, HASH_SCHEME, 16)
        assert (state.load.max_num_seqs, state.load.running, state.next_event) == (4, 0, 0)
        reply = httpx.post(
            f"{root}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            headers=worker.auth,
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == 0
    finally:
        worker.kill()


def test_a_worker_without_a_key_refuses_before_it_loads_the_model(tmp_path: Path) -> None:
    """The model named does not exist: a worker that loaded first would say so; it must name the key."""
    env = {k: v for k, v in os.environ.items() if k != "CTXFUSE_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "ctxfuse", "worker", "--model", str(tmp_path / "absent.gguf"), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "a worker needs a credential" in proc.stderr
    assert "loading the model" not in proc.stderr and "not found" not in proc.stderr
