"""`ctxfuse serve` as a user runs it: a subprocess that prints its base_url, answers the official
client, and on SIGTERM lets a running stream finish before it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ctxfuse.cli import build_parser

from .conftest import MODEL

REPO = Path(__file__).resolve().parents[2]


def test_serve_help_documents_every_option() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "ctxfuse", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    for option in [
        "--host",
        "--port",
        "--model",
        "--served-model-name",
        "--max-model-len",
        "--max-num-seqs",
        "--max-queue",
        "--kv-cache-memory",
        "--log-content",
        "--api-key",
        "--max-running-batches",
    ]:
        assert option in help_text, option


def test_serve_defaults_to_loopback_port_8000() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.log_content) == ("127.0.0.1", 8000, False)


@pytest.fixture()
def serve_process(gguf_path: Path, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    cmd = [
        sys.executable,
        "-m",
        "ctxfuse",
        "serve",
        "--port",
        "0",
        "--model",
        str(gguf_path),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--weight-quant",
        "none",
        "--kv-cache-memory",
        "0.25",
        "--max-model-len",
        "1024",
        "--shutdown-timeout",
        "20",
        "--data-dir",
        str(tmp_path),  # one gateway per data dir: never the user's
    ]
    env = {k: v for k, v in os.environ.items() if k != "CTXFUSE_API_KEY"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_lets_a_running_stream_finish_then_exits(serve_process: subprocess.Popen[str]) -> None:
    assert serve_process.stdout is not None
    line = serve_process.stdout.readline()  # blocks until the server listens (or dies)
    assert "base_url=" in line, line
    base_url = line.split("base_url=")[1].strip()
    models = httpx.get(f"{base_url}/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 24}
    result: dict[str, str] = {}
    started = threading.Event()

    def stream() -> None:
        with httpx.stream(
            "POST", f"{base_url}/chat/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            text = ""
            for chunk in r.iter_text():
                text += chunk
                started.set()
            result["text"] = text

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    serve_process.send_signal(signal.SIGTERM)
    t.join(60)
    assert result["text"].rstrip().endswith("data: [DONE]")
    assert serve_process.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base_url}/models", timeout=5)
