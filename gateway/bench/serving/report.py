"""A bench's results as a markdown table (stdout) and as JSON (the --out file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from gateway.bench.serving.metrics import RunFigures, Stats
from gateway.bench.serving.runner import BenchResult

HEADER = (
    "| server | model | concurrency | rate (req/s) | ok / failed | duration (s) | req/s | output tok/s "
    "| total tok/s | TTFT ms mean / p50 / p90 / p99 | ITL ms mean / p50 / p90 / p99 "
    "| TPOT ms mean / p50 / p90 / p99 | E2E ms mean / p50 / p90 / p99 |"
)


def _stats(s: Stats | None) -> str:
    return "-" if s is None else f"{s.mean:,.1f} / {s.p50:,.1f} / {s.p90:,.1f} / {s.p99:,.1f}"


def _row(f: RunFigures) -> str:
    cells = [
        f.server,
        f.model,
        "no cap" if f.concurrency is None else str(f.concurrency),
        "all at once" if f.request_rate is None else f"{f.request_rate:g}",
        f"{f.completed} / {f.failed}",
        f"{f.duration_s:.2f}",
        f"{f.request_throughput:.2f}",
        f"{f.output_throughput:,.1f}",
        f"{f.total_token_throughput:,.1f}",
        *(_stats(s) for s in (f.ttft_ms, f.itl_ms, f.tpot_ms, f.e2e_ms)),
    ]
    return "| " + " | ".join(cells) + " |"


def table(runs: list[RunFigures]) -> str:
    return "\n".join(
        [HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + [_row(f) for f in runs]
    )


def notes(runs: list[RunFigures]) -> list[str]:
    """Lines for what the table cannot show: failures and token counts the server did not report."""
    lines = []
    for f in runs:
        where = f"{f.server} at concurrency {'no cap' if f.concurrency is None else f.concurrency}"
        if f.errors:
            lines.append(f"{where}: {f.failed} failed, e.g. {f.errors[0]}")
        if f.usage_reported < f.completed:
            lines.append(
                f"{where}: {f.completed - f.usage_reported} answers came without usage: their output "
                "tokens are content chunks counted, their prompt tokens words counted"
            )
    return lines


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def to_json(result: BenchResult) -> bytes:
    return msgspec.json.format(msgspec.json.encode(result, enc_hook=_enc_hook), indent=2) + b"\n"


def write(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(to_json(result))
