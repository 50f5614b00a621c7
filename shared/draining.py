"""A uvicorn server that every tier runs the same way: SIGINT / SIGTERM is a graceful stop and a clean
exit (status 0), for the gateway, the router and the edge agent alike."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGINT / SIGTERM is a graceful stop and a clean exit (status 0), stopping its
    companions (an edge listener) with it."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.companions: list[uvicorn.Server] = []  # the edge listener: stopped with this server

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after its graceful shutdown, so the process dies of SIGTERM;
        # a completed drain is a clean exit here (status 0), and the caller gets to clean up.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        for companion in self.companions:
            companion.handle_exit(sig, frame)
        super().handle_exit(sig, frame)
