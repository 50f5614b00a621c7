"""wrk as the load generator: a closed loop of N kept-alive connections sending one POST body.

Debian's wrk has no constant-rate mode (that is wrk2), so load is set by the connection count: each
connection sends its next request when the previous response has fully arrived (for a stream: after
`[DONE]`). The measured rate at N connections is what the server sustains with N requests in flight.
A Lua `done` hook prints wrk's own latency percentiles in microseconds, so nothing is parsed from
its human-readable units.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared.errors import CtxfuseError

_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
{headers}wrk.body = [==[{body}]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("CTXFUSE_RESULT %d %d %d %d %d %d\\n",
    latency:percentile(50), latency:percentile(99), summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


@dataclass(frozen=True, slots=True)
class LoadResult:
    connections: int
    p50_ms: float
    p99_ms: float
    requests_per_s: float
    errors: int  # socket errors and timeouts, plus non-2xx responses

    def as_dict(self) -> dict[str, float | int]:
        return {
            "connections": self.connections,
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "requests_per_s": round(self.requests_per_s, 1),
            "errors": self.errors,
        }


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise CtxfuseError(
            "`ctxfuse bench gateway` needs the wrk load generator: `apt-get install wrk` "
            "(Debian/Ubuntu) or build it from https://github.com/wg/wrk"
        )
    return path


def run_wrk(
    url: str, body: str, connections: int, duration_s: float, headers: dict[str, str] | None = None
) -> LoadResult:
    extra = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in (headers or {}).items())
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(_SCRIPT.format(body=body, headers=extra))
        # one wrk thread: on a small machine the other core belongs to the server under test
        cmd = [wrk_path(), "-t1", f"-c{connections}", f"-d{duration_s:g}s", "-s", str(script), url]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CTXFUSE_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise CtxfuseError(f"wrk failed (status {proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    p50_us, p99_us, requests, duration_us, sock_errors, status_errors = (int(x) for x in line.split()[1:])
    return LoadResult(
        connections=connections,
        p50_ms=p50_us / 1000,
        p99_ms=p99_us / 1000,
        requests_per_s=requests * 1e6 / duration_us,
        errors=sock_errors + status_errors,
    )
