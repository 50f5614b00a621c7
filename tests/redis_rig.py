"""A real redis-server on loopback for the tests of the shared state (Debian's `redis-server`, which
`make test` installs where it is missing): started once per session in a temporary directory, no
persistence, emptied before each test that asks for it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("the shared-state tests need redis-server: apt-get install redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        for _ in range(200):  # up within a few seconds, or the test fails here with the reason
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}") from None
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not answer")
        client.close()

    def flush(self) -> None:
        with redis.Redis.from_url(self.url) as client:
            client.flushall()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    try:
        yield server
    finally:
        server.stop()


def unreachable_url() -> str:
    """A Redis URL where nothing listens (a port just freed): every call is refused at once."""
    return f"redis://127.0.0.1:{free_port()}/0"
