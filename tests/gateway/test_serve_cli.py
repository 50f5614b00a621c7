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
from ctxfuse.cli_values import SecretRefused
from ctxfuse.serve_cli import API_KEY, http_config

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


def test_the_gateway_key_comes_from_the_flag_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = build_parser(["serve"])
    (tmp_path / "key").write_text("from-file\n")
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("CTXFUSE_API_KEY", "from-env")
    assert API_KEY.read(parser.parse_args(["serve"])) == "from-env"
    # a file given on the command line wins over the environment (it lost to it before)
    assert API_KEY.read(parser.parse_args(["serve", "--api-key-file", str(tmp_path / "key")])) == "from-file"
    for argv, says in [
        (["--api-key", "k", "--api-key-file", str(tmp_path / "key")], "not both"),
        (["--api-key-file", str(tmp_path / "empty")], "is empty"),  # served with no key before
        (["--api-key", ""], "is empty"),
    ]:
        with pytest.raises(SecretRefused, match=says):
            http_config(parser.parse_args(["serve", *argv]))


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--max-connections", "0", "must be at least 1, got 0"),
        ("--header-timeout", "-1", "must be more than 0, got -1"),
        ("--max-connection-age", "nan", "expected a number"),
        ("--max-running-batches", "0", "must be at least 1, got 0"),
        ("--file-ttl-days", "-1", "must be 0 or more, got -1"),
        ("--long-prefill-tokens", "x", "expected a whole number, got 'x'"),
    ],
)
def test_serve_refuses_a_number_out_of_range_naming_the_option(
    capsys: pytest.CaptureFixture[str], option: str, value: str, says: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser(["serve"]).parse_args(["serve", option, value])
    assert exited.value.code == 2
    assert f"argument {option}: {says}" in capsys.readouterr().err


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


def test_serve_refuses_a_local_chunk_store_beside_redis(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from ctxfuse.cli import main

    args = ["serve", "--redis-url", "redis://127.0.0.1:1/0", "--chunk-store", str(tmp_path / "c.sqlite")]
    assert main(args) == 2
    assert "with --redis-url the edge link's chunks live in Redis" in capsys.readouterr().err
