"""The GPU check: one command that proves and measures the engine on a CUDA GPU in a few minutes.

    python3 -m cloud.bench.gpu_check --model .gpu/model.gguf --out DIR     (what the GPU machine runs)
    ctxfuse bench gpu-check --device cpu --tiny                              (the dry run, in the tests)

1. kernel tests: pytest over tests/kernels and the engine's Triton tests, on the device;
2. logits: the engine on the device (bf16, its default, and fp32) against the engine on the CPU in
   fp32 (the reference path, itself held against transformers by the tests): first-step logits and
   greedy continuations;
3. decode attention: time and achieved HBM bandwidth per kernel and KV format (gpu_attention.py);
4. end to end: decode tokens/s of the default model's shapes at batch 1, 32 and 128, eager against
   CUDA graphs.
Results go to DIR/gpu-check.json and, as markdown tables, to DIR/gpu-check.md. Prepare what the GPU
machine lacks (a model subset and a few wheels) with `make gpu-check-prep` (docs/gpu-check.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .gpu_attention import FORMATS, Shapes, bench_attention

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "Name the planets of the solar system in order.",
]


@dataclass(frozen=True, slots=True)
class CheckSizes:
    contexts: list[int] = field(default_factory=lambda: [4096, 32768, 131072])
    batches: list[int] = field(default_factory=lambda: [1, 16, 64])
    shapes: Shapes = field(default_factory=Shapes)
    formats: tuple[str, ...] = FORMATS
    e2e_batches: list[int] = field(default_factory=lambda: [1, 32, 128])
    e2e_tokens: int = 64
    prompts: int = len(PROMPTS)
    greedy_tokens: int = 32
    depth: int = 30  # the default model's layers (cycled from the carried subset for throughput)

    @classmethod
    def tiny(cls) -> CheckSizes:
        return cls(
            contexts=[64],
            batches=[1, 2],
            shapes=Shapes(num_heads=4, num_kv_heads=2, head_dim=64, sinks=16, window=16, budget=48),
            e2e_batches=[1, 2],
            e2e_tokens=3,
            prompts=1,
            greedy_tokens=3,
            depth=2,
        )


def kernel_tests(device: torch.device) -> dict[str, object]:
    """Run the kernel tests on the device in a child pytest (the interpreter stays off on a GPU)."""
    tests = [
        "tests/kernels",
        "tests/cloud/engine/attention/test_attention_kernels.py",
        "tests/cloud/model/test_fused_forward.py",
    ]
    env = dict(os.environ)
    if device.type == "cuda":
        env.pop("TRITON_INTERPRET", None)
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t, 1), "tail": tail}


def _engine(model, device: str, **overrides):
    from cloud.engine.config import EngineConfig
    from cloud.engine.core import EngineCore

    base = EngineConfig(device=device, weight_quant="none", max_model_len=2048)
    if device == "cpu":
        base = replace(base, dtype="float32", kv_cache_memory_gib=0.5)
    return EngineCore(replace(base, **overrides), model)


def _greedy(core, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuations and the first step's logits [prompts, vocab] (fp32, on the CPU)."""
    from cloud.engine.sampling.sampler import Sampler
    from shared.engine_types import SamplingParams

    first: dict[str, torch.Tensor] = {}

    class _First(Sampler):
        def __call__(self, logits, batch):
            for i, row in enumerate(batch.rows):
                first.setdefault(row.request_id, logits[i].float().cpu())
            return super().__call__(logits, batch)

    core.runner.sampler = _First()
    out: dict[str, list[int]] = {}
    for i, text in enumerate(prompts):
        ids = core.encode_chat([{"role": "user", "content": text}])
        core.add_request(f"p{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    names = [f"p{i}" for i in range(len(prompts))]
    return [out[n] for n in names], torch.stack([first[n] for n in names])


def logits_check(model, device: torch.device, sizes: CheckSizes) -> dict[str, object]:
    prompts = PROMPTS[: sizes.prompts]
    ref_tokens, ref_logits = _greedy(_engine(model, "cpu"), prompts, sizes.greedy_tokens)
    report: dict[str, object] = {}
    for dtype in ("bfloat16", "float32"):
        tokens, logits = _greedy(_engine(model, str(device), dtype=dtype), prompts, sizes.greedy_tokens)
        same = sum(t == r for t, r in zip(tokens, ref_tokens, strict=True))
        prefix = [_common_prefix(t, r) / len(r) for t, r in zip(tokens, ref_tokens, strict=True)]
        report[dtype] = {
            "max_abs_logit_diff": round(float((logits - ref_logits).abs().max()), 5),
            "first_token_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "identical_continuations": f"{same}/{len(prompts)}",
            "mean_matching_prefix": round(sum(prefix) / len(prefix), 3),
        }
    return report


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def decode_throughput(model, device: torch.device, batch: int, tokens: int, eager: bool) -> float:
    """Decode tokens per second of `batch` requests generating together (prefill steps excluded)."""
    from shared.engine_types import SamplingParams

    core = _engine(model, str(device), max_num_seqs=max(batch, 1), enforce_eager=eager)
    ids = core.encode_chat([{"role": "user", "content": "Tell me a long story about a lighthouse."}])
    for i in range(batch):
        core.add_request(f"r{i}", ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()  # prefills (and the first tokens)
    _sync(device)
    t = time.perf_counter()
    made = 0
    while core.has_work():
        made += len(core.step())
    _sync(device)
    return made / (time.perf_counter() - t)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def e2e(model, device: torch.device, sizes: CheckSizes) -> list[dict[str, object]]:
    from .gpu_model import full_depth

    deep = full_depth(model, sizes.depth)
    rows = []
    for b in sizes.e2e_batches:
        eager = decode_throughput(deep, device, b, sizes.e2e_tokens, eager=True)
        row: dict[str, object] = {"batch": b, "eager_tok_s": round(eager, 1)}
        if device.type == "cuda":
            graphs = decode_throughput(deep, device, b, sizes.e2e_tokens, eager=False)
            row |= {"graphs_tok_s": round(graphs, 1), "graphs_over_eager": round(graphs / eager, 2)}
        rows.append(row)
    return rows


def summarize(attention: list[dict[str, object]]) -> dict[str, float]:
    """The aims' ratios from the attention rows (where the sizes were measured)."""
    ms = {(r["format"], r["context"], r["batch"]): float(r["ms"]) for r in attention}  # type: ignore[arg-type]
    share = {(r["format"], r["context"], r["batch"]): float(r["hbm_share"]) for r in attention}  # type: ignore[arg-type]
    nbytes = {(r["format"], r["context"], r["batch"]): float(r["bytes_read"]) for r in attention}  # type: ignore[arg-type]
    out = {}
    for b in sorted({int(r["batch"]) for r in attention}):  # type: ignore[call-overload]
        if ("bf16", 32768, b) in ms:
            out[f"bf16_32k_b{b}_hbm_share"] = share[("bf16", 32768, b)]
        if ("int4", 32768, b) in ms and ("bf16", 32768, b) in ms:
            out[f"int4_32k_b{b}_speedup"] = ms[("bf16", 32768, b)] / ms[("int4", 32768, b)]
            out[f"int4_32k_b{b}_bytes_ratio"] = nbytes[("int4", 32768, b)] / nbytes[("bf16", 32768, b)]
        if ("sparse-2048", 131072, b) in ms and ("bf16", 131072, b) in ms:
            out[f"sparse_128k_b{b}_speedup"] = ms[("bf16", 131072, b)] / ms[("sparse-2048", 131072, b)]
    return {k: round(v, 3) for k, v in out.items()}


def run(
    model_path: str | None, device: torch.device, sizes: CheckSizes, out_dir: Path, skip_tests: bool = False
) -> dict[str, object]:
    from cloud.model.loading import load_model

    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {"device": _device_name(device), "torch": torch.__version__}
    model = load_model(model_path)
    phases = [
        ("kernel_tests", lambda: {"skipped": True} if skip_tests else kernel_tests(device)),
        ("logits", lambda: logits_check(model, device, sizes)),
        (
            "attention",
            lambda: [
                t.row()
                for t in bench_attention(sizes.contexts, sizes.batches, sizes.shapes, device, sizes.formats)
            ],
        ),
        ("e2e_decode", lambda: e2e(model, device, sizes)),
    ]
    for name, phase in phases:
        t = time.perf_counter()
        try:
            report[name] = phase()
        except Exception as exc:  # one phase failing must not lose the others' figures
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
        (out_dir / "gpu-check.json").write_text(json.dumps(report, indent=2))
    if isinstance(report["attention"], list):
        report["aims"] = summarize(report["attention"])
    (out_dir / "gpu-check.json").write_text(json.dumps(report, indent=2))
    (out_dir / "gpu-check.md").write_text(markdown(report))
    return report


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def markdown(report: dict[str, object]) -> str:
    lines = [f"# GPU check on {report['device']} (torch {report['torch']})", ""]
    attention = report.get("attention")
    if isinstance(attention, list):
        lines += ["| format | context | batch | ms | GB read | HBM share |", "|---|---|---|---|---|---|"]
        for r in attention:
            gb = float(r["bytes_read"]) / 1e9
            lines.append(
                f"| {r['format']} | {r['context']} | {r['batch']} | {float(r['ms']):.3f} | {gb:.3f} "
                f"| {float(r['hbm_share']):.0%} |"
            )
        lines.append("")
    for key in ("aims", "logits", "e2e_decode", "kernel_tests"):
        lines += [f"## {key}", "```", json.dumps(report.get(key), indent=2), "```", ""]
    return "\n".join(lines)


def add_gpu_check_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gpu-check", help="kernel tests, logits against the CPU and speed on a GPU (a few minutes)"
    )
    add_options(p)
    p.set_defaults(func=_main_args)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a dry run of every phase")
    p.add_argument("--skip-tests", action="store_true", help="skip the kernel tests phase")
    p.add_argument("--out", default="bench-results/gpu-check", help="where the JSON and markdown go")
    p.add_argument("--formats", default=",".join(FORMATS), help="KV formats for the attention benchmark")


def _main_args(args: argparse.Namespace) -> int:
    from cloud.engine.runner.device import resolve_device

    device = resolve_device(args.device)
    sizes = CheckSizes.tiny() if args.tiny else CheckSizes()
    sizes = replace(sizes, formats=tuple(f for f in args.formats.split(",") if f))
    report = run(args.model, device, sizes, Path(args.out), skip_tests=args.skip_tests)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m cloud.bench.gpu_check", description=__doc__)
    add_options(parser)
    sys.exit(_main_args(parser.parse_args()))
