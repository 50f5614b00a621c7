"""`ctxfuse worker` as a child process, for the fleet bench and the fleet tests: started with engine
options, known by the base URL it prints once it listens, stopped with SIGTERM or killed."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ChildServer:
    """A `ctxfuse` server command as a child process: known by the base URL it prints once it
    listens, stopped with SIGTERM or killed (-9)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.command = args[0]
        cmd = [sys.executable, "-m", "ctxfuse", *args]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self.url = ""

    def wait_ready(self) -> str:
        """The base URL (without /v1), once it listens; RuntimeError if it died first."""
        out, line = self.proc.stdout, ""
        while out is not None and "base_url=" not in line:  # other lines may come first
            line = out.readline()
            if not line:
                break
        if "base_url=" not in line:
            self.kill()
            raise RuntimeError(f"ctxfuse {self.command} did not start (exit {self.proc.poll()}): {line!r}")
        self.url = line.split("base_url=")[1].strip().removesuffix("/v1")
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """kill -9: what a crashed server looks like to the others."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class WorkerProcess(ChildServer):
    def __init__(
        self, model: Path, served_name: str, *engine_args: str, api_key: str | None = None, port: int = 0
    ) -> None:
        args = ["worker", "--port", str(port), "--model", str(model), "--served-model-name", served_name]
        env = {k: v for k, v in os.environ.items() if k != "CTXFUSE_API_KEY"}
        # a worker requires a key (its router's); one of its own unless the caller names it
        self.api_key = api_key or secrets.token_urlsafe(18)
        env["CTXFUSE_API_KEY"] = self.api_key
        super().__init__([*args, *engine_args], env)

    @property
    def auth(self) -> dict[str, str]:
        """The header a caller of this worker sends (its router does the same: --backend-key)."""
        return {"Authorization": f"Bearer {self.api_key}"}
