"""`redis-server` (Debian's package) as a child process on a loopback port, with no persistence: the
shared state of `ctxfuse bench shared-state` and of the tests' replicas."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from gateway.bench.serve import HOST, free_port
from shared.errors import CtxfuseError


class RedisProcess:
    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise CtxfuseError("redis-server is not installed: apt-get install redis-server")
        self.port = free_port()
        self.url = f"redis://{HOST}:{self.port}/0"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        with redis.Redis.from_url(self.url) as client:
            for _ in range(200):  # up within a few seconds, or an error saying why
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.proc.poll() is not None:
                        raise CtxfuseError(f"redis-server exited with {self.proc.returncode}") from None
                    time.sleep(0.05)
        self.stop()
        raise CtxfuseError("redis-server did not answer")

    def flush(self) -> None:
        with redis.Redis.from_url(self.url) as client:
            client.flushall()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
