"""A real redis-server on loopback for the tests of the shared state (Debian's `redis-server`, which
`make test` installs where it is missing): started once per session in a temporary directory, no
persistence, emptied before each test that asks for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gateway.bench.redis_proc import RedisProcess, free_port


@contextmanager
def redis_server(workdir: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(workdir)
    try:
        yield server
    finally:
        server.stop()


def unreachable_url() -> str:
    """A Redis URL where nothing listens (a port just freed): every call is refused at once."""
    return f"redis://127.0.0.1:{free_port()}/0"


__all__ = ["free_port", "redis_server", "unreachable_url"]
