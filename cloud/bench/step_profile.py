"""`ctxfuse bench step-profile`: where the time of one c=1 decode step goes, on this machine (issue 30).

In process, on EngineCore: one greedy request decodes while timers wrap the real objects' methods
(the scheduler, the runner's input building, each projection's GEMV, the KV write, the attention
kernel, the fused norm / RoPE / SiLU kernels, lm_head, the sampler, output building, detokenizing);
they are put back afterwards. The timers keep exclusive time: a part entered from another pauses
it, so nothing is counted twice and what no named part covers is the step's own Python ("other").
The parts plus other equal the step's span by construction. A timer costs one to two microseconds
a call and a step makes ~300 calls, so the same request also decodes untimed: its step time is the
one the serving figures are compared with.

Then the same prompt, per way `ctxfuse serve` runs its engine (in a process of its own, the
default, or on a thread of the gateway's process, `--engine-in-process`), timed per token where it
arrives: at the gateway's Backend (cloud/serving: the engine loop and, by default, the pipe, without
the gateway) and at an HTTP client of `ctxfuse serve` on loopback. Each difference is what that layer
adds to a token: Backend - untimed step = the engine loop and the process hand-off; HTTP client -
Backend = the gateway's per-chunk work and the HTTP stream. On a small CPU a layer can also take
time away (a second process runs beside the engine's kernels or not at all), so a row may be negative.

Every way is started before the first round and each round measures all of them once, in process
first: a slow spell of the machine (another job) falls on all of them alike.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cloud.bench.report import publish, say
from cloud.bench.step_serving import MODES, ModeFigures, Stream, Targets
from cloud.bench.step_timers import (
    GEMV_PARTS,
    PARTS,
    InProcess,
    ProfileOptions,
    StepProfiler,
    decode,
    prompt_text,
)
from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.model.loading import LoadedModel, load_model

NOTABLE_FLAGS = (
    "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip

if TYPE_CHECKING:  # the serving backends load only where the seam is measured
    from cloud.serving.in_process import InProcessBackend
    from cloud.serving.process import ProcessBackend

    Backend = InProcessBackend | ProcessBackend


def read_bandwidth_gbs(mib: int = 512, reps: int = 5) -> float:
    """This machine's streaming read bandwidth as torch's threads sum a tensor far larger than the
    caches (best of `reps`): the ceiling a GEMV's weight reads can approach."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def machine() -> dict[str, object]:
    """The CPU as lscpu names it, its notable instruction-set flags, and the load while measuring."""
    info: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = set(info.get("Flags", "").split())
    from kernels.cpu import gguf_matmul

    return {
        "model_name": info.get("Model name", "unknown"),
        "cpus": os.cpu_count(),
        "threads_per_core": info.get("Thread(s) per core", "?"),
        "flags": [f for f in NOTABLE_FLAGS if f in flags],
        "gemv_isa": gguf_matmul.isa() if gguf_matmul.available() else "none",
        "torch_threads": torch.get_num_threads(),
        "read_gbs": read_bandwidth_gbs(),
        "load_average": os.getloadavg()[0],
    }


def torch_profiler_table(core: EngineCore, prompt: list[int], new_tokens: int) -> str:
    """PyTorch's own view of untimed decode steps (its per-op overhead inflates sub-ms ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(core, prompt, new_tokens, "torch-profiler")
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return table


def chain(result: InProcess, figures: ModeFigures | None) -> list[tuple[str, float]]:
    """(label, ms per token) rows that add up, from the step's parts to the API's per-token time:
    each row past the parts is what the next measurement adds to the one before it."""
    out = [(p.label, result.parts_ms[p.key]) for p in PARTS]
    out.append(("timer overhead taken off (untimed step - timed step)", result.untimed_ms - result.timed_ms))
    if figures is None or not figures.seam:
        return out
    seam = ModeFigures.median(figures.seam)
    out.append(("engine loop + process hand-off (at the Backend - untimed step)", seam - result.untimed_ms))
    if figures.api:
        api = ModeFigures.median(figures.api)
        out.append(("gateway + HTTP stream (at the HTTP client - at the Backend)", api - seam))
    return out


def table(data: dict[str, Any]) -> str:
    result = InProcess(**data["in_process"])
    modes = [
        ModeFigures(m["mode"], [Stream(**s) for s in m["seam"]], [Stream(**s) for s in m["api"]])
        for m in data["modes"]
    ]
    default = modes[0] if modes else None
    rows = chain(result, default)
    base = sum(ms for _, ms in rows)
    base_name = "API's per-token time" if default and default.api else "untimed engine step"
    lines = [f"| part | ms per token | share of the {base_name} |", "|---|---:|---:|"]
    lines += [f"| {label} | {ms:.3f} | {100 * ms / base:.1f}% |" for label, ms in rows]
    lines.append(f"| **total** | **{base:.3f}** | 100% |")
    if modes:
        lines += [
            "",
            "| `ctxfuse serve` mode | engine step (untimed) | at the Backend | at the HTTP client |",
            "|---|---:|---:|---:|",
        ]
        for f in modes:
            seam, api = ModeFigures.median(f.seam), ModeFigures.median(f.api)
            lines.append(f"| {f.mode} | {result.untimed_ms:.3f} | {seam:.3f} | {api:.3f} |")
    m = data["machine"]
    lines += [
        "",
        f"machine: {m['model_name']}, {m['cpus']} CPUs, flags {' '.join(m['flags']) or 'none'}, GEMV kernels "
        f"{m['gemv_isa']}, {m['torch_threads']} torch threads, streaming reads {m['read_gbs']:.1f} GB/s; "
        f"load average {m['load_average']:.2f} at the start, {data['load_average_end']:.2f} at the end",
        f"prompt {data['prompt_tokens']} tokens, {result.steps} timed decode steps (median untimed step "
        f"{result.untimed_median_ms:.3f} ms, timed {result.timed_ms:.3f} ms); the timed decodes "
        f"{'gave' if result.same_tokens else 'did NOT give'} the untimed decodes' tokens",
    ]
    mib, gbs = result.gemv_mib, result.gemv_gbs
    by_part = ", ".join(
        f"{p.key.removeprefix('gemv_')} {mib[p.key]:.1f} at {gbs[p.key]:.1f}" for p in GEMV_PARTS
    )
    lines.append(
        f"GEMV weights a token, MiB at GB/s (timed): all {mib['all']:.1f} at {gbs['all']:.1f}; {by_part}"
    )
    return "\n".join(lines)


def run(opts: ProfileOptions, loaded: LoadedModel | None = None) -> dict[str, Any]:
    """The whole profile as the JSON it writes. Each round runs every measurement once, in process
    first, so a slow spell of the machine falls on all of them alike."""
    host = machine()
    core = EngineCore(EngineConfig(model=opts.model), loaded or load_model(opts.model))
    text, prompt = prompt_text(core, opts.prompt_tokens)
    say(f"{core.describe_device()}; prompt {len(prompt)} tokens, {opts.new_tokens} new")
    profiler = StepProfiler(core, prompt, opts.new_tokens)
    modes = [ModeFigures(m.name) for m in MODES] if opts.api else []
    with tempfile.TemporaryDirectory(prefix="ctxfuse-step-profile-") as tmp:
        targets = None
        if opts.api:
            say("starting an engine process and `ctxfuse serve` in both modes")
            targets = Targets(core, prompt, text, opts, Path(tmp))
        try:
            if targets is not None:
                for mode in MODES:  # warm-ups: the first requests' one-time costs
                    targets.seam(mode, 16, f"seam-warmup-{mode.in_process}")
                    targets.api(mode, 16)
            for i in range(opts.rounds):
                profiler.round(i)
                for mode, figures in zip(MODES, modes, strict=False):
                    if targets is not None:
                        figures.seam.append(
                            targets.seam(mode, opts.new_tokens, f"seam-{i}-{mode.in_process}")
                        )
                        figures.api.append(targets.api(mode, opts.new_tokens))
                say(f"round {i + 1} of {opts.rounds} done")
        finally:
            if targets is not None:
                targets.close()
    result = profiler.result()
    profiler_table = (
        torch_profiler_table(core, prompt, min(opts.new_tokens, 32)) if opts.torch_profiler else None
    )
    core.close()
    return {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "machine": host,
        "load_average_end": os.getloadavg()[0],
        "prompt_tokens": len(prompt),
        "in_process": asdict(result),
        "modes": [asdict(m) for m in modes],
        "torch_profiler": profiler_table,
    }


def cmd_step_profile(args: argparse.Namespace) -> int:
    opts = ProfileOptions(
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        api=not args.no_api,
        torch_profiler=args.torch_profiler,
        model=args.model,
        out=args.out,
    )
    data = run(opts)
    text = table(data)
    if data["torch_profiler"]:
        text += "\n\ntorch.profiler, untimed decode steps (self CPU time):\n" + data["torch_profiler"]
    publish(opts.out, data, text)
    return 0


def add_step_profile_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = ProfileOptions()
    p = bench.add_parser(
        "step-profile",
        help="where a c=1 decode step's time goes: the engine's parts in process, then the gateway, "
        "HTTP and engine-process hand-off through `ctxfuse serve`",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=d.prompt_tokens, help="chat prompt length (default %(default)s)"
    )
    p.add_argument(
        "--new-tokens", type=int, default=d.new_tokens, help="greedy, per request (default %(default)s)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=d.rounds,
        help="each an untimed and a timed decode and a stream per way (default %(default)s)",
    )
    p.add_argument("--no-api", action="store_true", help="in process only (no `ctxfuse serve`)")
    p.add_argument(
        "--torch-profiler", action="store_true", help="also print torch.profiler's table of untimed steps"
    )
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the default model)")
    p.add_argument("--out", type=Path, default=d.out, help="JSON results file (default %(default)s)")
    p.set_defaults(func=cmd_step_profile)
