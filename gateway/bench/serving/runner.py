"""A bench from start to end: the prompts, each server's model, its warm-up requests, then one run per
--concurrency value, the servers one after another with the same prompts and the same arrival times.

Within a run, a semaphore holds the requests in flight to the concurrency cap. Without a request rate
all requests are issued at once and the cap alone sets the load (a closed loop: a request starts when
one ends); with one, they arrive as a Poisson process, and an arrival finding the cap reached waits
for a slot. A request's clock starts when it is sent, after any such wait, as in `vllm bench serve`.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable, Sequence

import httpx
import msgspec

from gateway.bench.serving.client import Target, make_client, request_body, resolve_model, send
from gateway.bench.serving.dataset import Prompt, build_prompts
from gateway.bench.serving.metrics import RunFigures, summarise
from gateway.bench.serving.options import ServeBenchOptions
from gateway.bench.serving.stream import RequestRecord


class BenchResult(msgspec.Struct, frozen=True):
    options: ServeBenchOptions  # without the API key
    runs: list[RunFigures]  # per server, per concurrency value, in the order they ran


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


async def run_setting(
    client: httpx.AsyncClient,
    target: Target,
    requests: Sequence[tuple[bytes, int]],  # (body, prompt words)
    concurrency: int | None,
    request_rate: float | None,
    rng: random.Random,
) -> tuple[list[RequestRecord], float]:
    """Every request's record, and the run's wall clock in seconds."""
    slots = asyncio.Semaphore(concurrency or len(requests))

    async def one(body: bytes, words: int) -> RequestRecord:
        async with slots:
            return await send(client, target, body, words)

    start = time.perf_counter()
    tasks = []
    for i, (body, words) in enumerate(requests):
        if request_rate is not None and i > 0:
            await asyncio.sleep(rng.expovariate(request_rate))
        tasks.append(asyncio.create_task(one(body, words)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


def _bodies(target: Target, prompts: Sequence[Prompt], options: ServeBenchOptions) -> list[tuple[bytes, int]]:
    return [
        (request_body(target, p, options.temperature, options.ignore_eos), p.input_words) for p in prompts
    ]


def _progress(f: RunFigures) -> str:
    ttft = f"TTFT p50 {f.ttft_ms.p50:,.0f} ms" if f.ttft_ms else "no TTFT"
    cap = "no cap" if f.concurrency is None else f"concurrency {f.concurrency}"
    return (
        f"{f.server} {cap}: {f.completed} ok, {f.failed} failed, {f.request_throughput:.2f} req/s, "
        f"{f.output_throughput:.1f} output tok/s, {ttft}"
    )


async def _bench_server(
    client: httpx.AsyncClient,
    target: Target,
    prompts: Sequence[Prompt],
    options: ServeBenchOptions,
    report: Callable[[str], None],
) -> list[RunFigures]:
    warm, measured = prompts[: options.warmup], prompts[options.warmup :]
    if warm:
        records, _ = await run_setting(
            client, target, _bodies(target, warm, options), options.max_in_flight, None, random.Random(0)
        )
        failed = [r.error for r in records if r.error is not None]
        report(f"{target.base_url} ({target.model}): {len(warm)} warm-up requests, {len(failed)} failed")
        if failed:
            report(f"  first warm-up error: {failed[0]}")
    runs = []
    n = options.num_prompts
    for k, cap in enumerate(options.concurrency):
        bodies = _bodies(target, measured[k * n : (k + 1) * n], options)
        rng = random.Random(options.seed + k)  # the same arrival times on every server
        records, duration = await run_setting(client, target, bodies, cap, options.request_rate, rng)
        figures = summarise(target.base_url, target.model, cap, options.request_rate, records, duration)
        report(_progress(figures))
        runs.append(figures)
    return runs


async def run_async(options: ServeBenchOptions, report: Callable[[str], None] = say) -> BenchResult:
    """Raises CtxfuseError when a server does not answer, ValueError when the dataset yields nothing."""
    prompts = build_prompts(options, options.warmup + len(options.concurrency) * options.num_prompts)
    if len({p.text for p in prompts}) < len(prompts):
        report("the dataset holds fewer prompts than the runs need: some repeat, and may be found cached")
    async with make_client(options.max_in_flight, options.api_key) as client:
        targets = [
            Target(url, await resolve_model(client, url, options.model), options.endpoint)
            for url in options.base_urls
        ]  # every server checked before the first is measured
        runs = []
        for target in targets:
            runs += await _bench_server(client, target, prompts, options, report)
    return BenchResult(options.public(), runs)


def run(options: ServeBenchOptions, report: Callable[[str], None] = say) -> BenchResult:
    return asyncio.run(run_async(options, report))
