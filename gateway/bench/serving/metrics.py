"""A run's records reduced to the figures `vllm bench serve` users expect.

Throughputs count completed requests only, over the run's wall clock (from its first send to its
last answer). TTFT, TPOT and E2E take one value per completed request, ITL one per gap between
content chunks, pooled over the run's requests. Percentiles interpolate linearly between order
statistics (numpy's default), so p50 of [1, 2, 3, 4] is 2.5.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import msgspec

from gateway.bench.serving.stream import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Stats(msgspec.Struct, frozen=True):
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int


def stats_ms(values_s: Sequence[float]) -> Stats | None:
    """Stats in milliseconds of values in seconds; None for no values."""
    if not values_s:
        return None
    ms = [v * 1e3 for v in values_s]
    return Stats(
        mean=round(statistics.fmean(ms), 3),
        p50=round(percentile(ms, 50), 3),
        p90=round(percentile(ms, 90), 3),
        p99=round(percentile(ms, 99), 3),
        count=len(ms),
    )


class RunFigures(msgspec.Struct, frozen=True):
    server: str
    model: str
    concurrency: int | None  # None: no cap
    request_rate: float | None  # None: all requests at once
    completed: int
    failed: int
    errors: list[str]  # the first few distinct ones
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second, all requests together
    total_token_throughput: float  # prompt and output tokens per second
    total_input_tokens: int
    total_output_tokens: int
    usage_reported: int  # completed requests whose token counts the server reported
    ttft_ms: Stats | None
    itl_ms: Stats | None
    tpot_ms: Stats | None
    e2e_ms: Stats | None


def summarise(
    server: str,
    model: str,
    concurrency: int | None,
    request_rate: float | None,
    records: Sequence[RequestRecord],
    duration_s: float,
) -> RunFigures:
    ok = [r for r in records if r.ok]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    return RunFigures(
        server=server,
        model=model,
        concurrency=concurrency,
        request_rate=request_rate,
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=list(dict.fromkeys(r.error for r in records if r.error is not None))[:5],
        duration_s=round(duration_s, 3),
        request_throughput=round(len(ok) * per_s, 3),
        output_throughput=round(outputs * per_s, 2),
        total_token_throughput=round((inputs + outputs) * per_s, 2),
        total_input_tokens=inputs,
        total_output_tokens=outputs,
        usage_reported=sum(1 for r in ok if r.usage_reported),
        ttft_ms=stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_ms=stats_ms([gap for r in ok for gap in r.itl_s]),
        tpot_ms=stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        e2e_ms=stats_ms([r.e2e_s for r in ok]),
    )
