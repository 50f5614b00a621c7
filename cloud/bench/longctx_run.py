"""The parent side of `ctxfuse bench longctx`: it plans the cases, runs one worker process per
configuration in turn (`python -m cloud.bench.longctx --worker SPEC`; so each configuration's peak
RSS is its own and only one of them uses the CPU at a time), follows the workers' lines on a
progress bar, then writes results.json and a heatmap PNG per configuration.

The reference configuration runs first; agreement and ratios are taken against it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from tqdm import tqdm

from cloud.engine.config import DType, EngineConfig
from cloud.model.formats import WeightQuant

from .heatmap import HeatmapPanel, render_heatmap
from .longctx_configs import CONFIGS, REFERENCE, Grid, plan
from .longctx_probe import probe_report
from .longctx_results import CaseResult, EngineInfo, GroupFailed, WorkerLine, WorkerSpec
from .longctx_summary import ConfigSummary, mark_agreement, summarise

LOG_TAIL_LINES = 20  # of a failed worker's log, into the report


@dataclass(frozen=True, slots=True)
class LongCtxOptions:
    configs: tuple[str, ...]  # the reference first
    grid: Grid
    seed: int = 0
    max_tokens: int = 12  # the answer is a number: a dozen greedy tokens hold it
    out: Path = Path("bench-results/longctx")
    model: str | None = None
    dtype: DType = "auto"
    device: str = "auto"
    # none: the exact float32 weights. auto times kernels at every engine start and, on a busy
    # machine, picks differently per configuration: that would mix the weight path into the comparison
    weight_quant: WeightQuant = "none"
    quick: bool = False
    probe: bool = False  # follow the needle through sparse selection (timings leave the probe out)
    heads: Path | None = None  # the retrieval-head calibration (made where missing, by a worker)


class ConfigRun(msgspec.Struct, kw_only=True):
    name: str
    attention: str
    sparse_budget: int | None
    kv_dtype: str
    yarn: bool
    status: str  # "ok", "partial" (some cases or engines failed), "failed", or "skipped" (no case)
    planned_cases: int
    engines: list[EngineInfo] = msgspec.field(default_factory=list)
    failures: list[str] = msgspec.field(default_factory=list)
    peak_rss_mib: float | None = None
    wall_s: float = 0.0
    # the machine's 1-minute load average as the worker started and ended: timings taken while
    # something else kept the cores busy compare poorly with the rest
    load_average: tuple[float, float] | None = None
    log: str | None = None
    heatmap: str | None = None
    probe: str | None = None  # the needle-through-selection table (--probe, sparse configurations)


class RunMeta(msgspec.Struct, kw_only=True):
    model: str | None
    model_native_context: int | None  # as the model file states it
    grid: Grid
    seed: int
    max_tokens: int
    dtype: str
    weight_quant: str
    reference: str
    quick: bool
    torch_threads: int | None
    started_at: str
    wall_s: float = 0.0
    warnings: list[str] = msgspec.field(default_factory=list)


class Report(msgspec.Struct, kw_only=True):
    meta: RunMeta
    configs: dict[str, ConfigRun]
    summary: dict[str, ConfigSummary]
    cases: list[CaseResult]


def _worker_env() -> dict[str, str]:
    """The parent's environment, with this checkout first on the path: workers run this code."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _spec(opts: LongCtxOptions, name: str) -> WorkerSpec:
    g = opts.grid
    return WorkerSpec(
        config=name,
        tasks=g.tasks,
        lengths=g.lengths,
        depths=g.depths,
        samples=g.samples,
        native_context=g.native_context,
        yarn_factor=g.yarn_factor,
        seed=opts.seed,
        max_tokens=opts.max_tokens,
        model=opts.model,
        dtype=opts.dtype,
        weight_quant=opts.weight_quant,
        device=opts.device,
        probe=opts.probe,
        heads=None if opts.heads is None else str(opts.heads),
    )


def _log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    return "\n".join(lines)


def _run_config(opts: LongCtxOptions, run: ConfigRun, bar: tqdm, meta: RunMeta) -> list[CaseResult]:
    """Run one configuration's worker to its end; fills `run` and returns the worker's cases."""
    log = opts.out / "logs" / f"{run.name}.log"
    spec = msgspec.json.encode(_spec(opts, run.name)).decode()
    cmd = [sys.executable, "-m", "cloud.bench.longctx", "--worker", spec]
    decoder = msgspec.json.Decoder(WorkerLine)
    cases: list[CaseResult] = []
    accounted = 0  # cases run or skipped, for the bar
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with (
        log.open("w") as err,
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=_worker_env(),
        ) as proc,
    ):
        try:
            for line in proc.stdout or ():
                msg = decoder.decode(line)
                if isinstance(msg, CaseResult):
                    cases.append(msg)
                    accounted += 1
                    bar.update(1)
                    verdict = "error" if msg.error else "hit" if msg.correct else "miss"
                    bar.set_postfix_str(f"{run.name} {msg.task} {msg.length} @{msg.depth}%: {verdict}")
                elif isinstance(msg, GroupFailed):
                    run.failures.append(f"engine for {msg.max_model_len} tokens: {msg.error}")
                    accounted += msg.cases
                    bar.update(msg.cases)
                else:
                    run.engines, run.peak_rss_mib = msg.engines, msg.peak_rss_mib
                    meta.model, meta.model_native_context = msg.model, msg.native_context
                    meta.torch_threads = msg.torch_threads
        except BaseException:  # interrupted, or a line we cannot read: do not leave the worker running
            proc.kill()
            raise
        rc = proc.wait()
    bar.update(run.planned_cases - accounted)
    run.wall_s = round(time.perf_counter() - t0, 2)
    run.load_average = (round(load0, 2), round(os.getloadavg()[0], 2))
    run.log = str(log)
    if rc != 0 or run.peak_rss_mib is None:
        run.failures.append(f"worker exited with status {rc}; the end of its log:\n{_log_tail(log)}")
    errors = sum(c.error is not None for c in cases)
    if not cases or errors == len(cases):
        run.status = "failed"
    elif run.failures or errors:
        run.status = "partial"
    return cases


def _length_label(n: int, grid: Grid, yarn: bool) -> str:
    text = f"{n // 1024}K" if n % 1024 == 0 else str(n)
    return f"{text}\nYaRN x{grid.yarn_factor:g}" if yarn and n > grid.native_context else text


def _heatmap(opts: LongCtxOptions, run: ConfigRun, summary: ConfigSummary, model: str | None) -> Path:
    config = CONFIGS[run.name]
    panels = []
    for task in opts.grid.tasks:
        by_length = summary.grid.get(task, {})
        lengths = sorted(by_length)
        rows = tuple(tuple(by_length[n].get(d) for n in lengths) for d in opts.grid.depths)
        cols = tuple(_length_label(n, opts.grid, config.yarn) for n in lengths)
        panels.append(HeatmapPanel(task, cols, tuple(f"{d}%" for d in opts.grid.depths), rows))
    attention = "dense attention"
    if config.sparse_budget is not None:
        attention = f"sparse attention, budget {config.sparse_budget}"
    elif config.budget_share is not None:
        attention = f"sparse attention, budget 1/{round(1 / config.budget_share)} of the context"
    kv = EngineConfig(dtype=opts.dtype).run_dtype if config.kv_dtype == "auto" else config.kv_dtype
    acc = summary.figures.accuracy
    title = "\n".join(  # short lines: a one-panel figure is 5 inches wide
        (
            f"{run.name}: accuracy {'n/a' if acc is None else f'{acc:.0%}'}",
            f"{attention}, KV {kv}{'' if config.yarn else ', no RoPE scaling'}",
            f"{model or 'default model'}, greedy, {opts.max_tokens}+ new tokens",
        )
    )
    path = opts.out / f"heatmap-{run.name}.png"
    render_heatmap(path, title, [p for p in panels if p.columns])
    return path


def _weight_mismatches(runs: dict[str, ConfigRun]) -> list[str]:
    ref = {e.weights for e in runs[REFERENCE].engines}
    return [
        f"{name} ran weights {sorted(w)}, {REFERENCE} {sorted(ref)}: its ratios and agreement include that"
        for name, r in runs.items()
        if ref and (w := {e.weights for e in r.engines}) and w != ref
    ]


def run(opts: LongCtxOptions) -> Report:
    (opts.out / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    g = opts.grid
    meta = RunMeta(
        model=opts.model,
        model_native_context=None,
        grid=opts.grid,
        seed=opts.seed,
        max_tokens=opts.max_tokens,
        dtype=opts.dtype,
        weight_quant=opts.weight_quant,
        reference=REFERENCE,
        quick=opts.quick,
        torch_threads=None,
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    runs = {}
    for name in opts.configs:
        c = CONFIGS[name]
        planned = sum(len(grp.specs) for grp in plan(c, g))
        runs[name] = ConfigRun(
            name=name,
            attention=c.attention,
            sparse_budget=c.sparse_budget,
            kv_dtype=c.kv_dtype,
            yarn=c.yarn,
            status="ok" if planned else "skipped",
            planned_cases=planned,
        )
    cases: list[CaseResult] = []
    total = sum(r.planned_cases for r in runs.values())
    with tqdm(total=total, unit="case", desc="longctx", dynamic_ncols=True) as bar:
        for r in runs.values():
            if r.planned_cases:
                cases += _run_config(opts, r, bar, meta)
    meta.warnings += _weight_mismatches(runs)
    mark_agreement(cases, REFERENCE)
    ran = {n: r.peak_rss_mib for n, r in runs.items() if r.status != "skipped"}
    summary = summarise(cases, ran, REFERENCE)
    for name, s in summary.items():
        if s.figures.cases:
            runs[name].heatmap = str(_heatmap(opts, runs[name], s, meta.model))
        if (table := probe_report(name, cases)) is not None:
            path = opts.out / f"probe-{name}.md"
            path.write_text(table)
            runs[name].probe = str(path)
    meta.wall_s = round(time.perf_counter() - t0, 1)
    report = Report(meta=meta, configs=runs, summary=summary, cases=cases)
    (opts.out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2))
    return report
