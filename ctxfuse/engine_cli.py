"""The engine's options, shared by `serve`, `worker`, `generate` and the engine benches: the engine's
configuration (cloud/engine/config.py) as flags. Imported only by commands that run an engine, so the
edge's commands never import the cloud side."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from cloud.engine.config import (
    ATTENTION_KERNELS,
    CONTEXT_OVERFLOWS,
    CPU_KV_CACHE_GIB,
    DTYPES,
    KV_DTYPES,
    SPECULATIVE,
    EngineConfig,
)
from cloud.engine.kv.prune_plan import OBSERVATION_WINDOW, POOL_KERNEL, SINK_TOKENS
from cloud.model.formats import WEIGHT_QUANTS
from ctxfuse.cli_values import non_negative_int, positive_int
from ctxfuse.sparse_cli import add_sparse_options, sparse_config
from shared.errors import CtxfuseError


def add_engine_options(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        action="append",
        type=model_spec,
        default=None,
        metavar="[NAME=]PATH",
        help="a .gguf file, a Hugging Face directory or a registered model (smollm2-135m-instruct, "
        "gemma-3-270m; fetched if missing) (default: SmolLM2-135M-Instruct), served as NAME when "
        "given; `ctxfuse serve` takes several (repeat the option)",
    )
    g.add_argument(
        "--chat-template",
        type=template_file,
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's (as vLLM's --chat-template); a "
        "routing gateway renders with it too, to match its workers' prompts",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: smollm2-135m-instruct or the file's stem)",
    )
    g.add_argument(
        "--device",
        default=d.device,
        help="auto (default: the first CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="the share of the GPU the engine takes: weights, the profiled activation peak of the largest "
        f"step, and the KV cache in the rest (default {d.gpu_memory_utilization})",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    g.add_argument(
        "--attention-kernels",
        choices=ATTENTION_KERNELS,
        default=d.attention_kernels,
        help="auto (default: Triton kernels on a GPU, compiled C++ decode kernels on a CPU), torch (the "
        "PyTorch references), triton, or cpu",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default=d.dtype,
        help="activations, KV cache and dense weights (default auto: bfloat16 on a GPU, float32 on a CPU)",
    )
    g.add_argument(
        "--weight-quant",
        choices=WEIGHT_QUANTS,
        default=d.weight_quant,
        help=(
            "weight format: none (dense in --dtype), int8, int4, or auto (default): the fastest kernels on "
            "this CPU among those whose greedy output agrees with float32, timed at start"
        ),
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size in tokens (default 16; 32 for a quantized KV cache: key scales are per block)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help=f"KV cache budget in GiB (default {CPU_KV_CACHE_GIB} on CPU; on a GPU what "
        "--gpu-memory-utilization leaves after the weights and a profiled step)",
    )
    g.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default=d.kv_dtype,
        help="KV cache storage: auto (the run dtype), int8 / int4 group-wise quantized (keys per channel "
        "within a block, values per token, fp16 scales and zero points), or fp8 (e4m3, per-head scales)",
    )
    g.add_argument(
        "--kv-prune-budget",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="a prompt longer than this keeps at most this many tokens' KV after its prefill, per layer "
        f"and KV head: the first {SINK_TOKENS} (sinks), the last {OBSERVATION_WINDOW} (the observation "
        "window, whose queries score the rest) and the best-scored between (SnapKV, scores max-pooled "
        f"over {POOL_KERNEL} tokens); needs --kv-dtype auto and --attention dense (default: off)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt plus output (default: the model's context, scaled by RoPE scaling, capped by "
        "the KV budget)",
    )
    g.add_argument(
        "--rope-scaling",
        type=_json_object,
        default=None,
        help='RoPE scaling overriding the model\'s, as JSON, e.g. \'{"type": "yarn", "factor": 4}\' '
        "(types: linear, dynamic, yarn, llama3)",
    )
    g.add_argument(
        "--context-overflow",
        choices=CONTEXT_OVERFLOWS,
        default=d.context_overflow,
        help="a prompt longer than the context: error (default, context_length_exceeded); truncate_middle "
        "(drop the middle of the prompt, reported in usage.prompt_tokens_details.truncated_tokens); "
        "sliding_window (run past the context on attention sinks plus recent blocks); drop_old_turns "
        "(chat: drop whole old turns, lowest time-decay score first, keeping system messages and the "
        "latest turn; reported in truncated_tokens and truncated_messages)",
    )
    g.add_argument(
        "--kv-host-memory",
        type=float,
        default=d.kv_host_memory_gib,
        metavar="GIB",
        help="host-RAM tier for prefix blocks evicted from the KV cache, in GiB (default 0: none); a hit "
        "copies them back instead of prefilling again",
    )
    g.add_argument(
        "--kv-offload-dir",
        default=d.kv_offload_dir,
        metavar="DIR",
        help="disk tier for prefix blocks: every cached block is written there too and survives restarts "
        "(keyed by model, dtypes and layout); default: none",
    )
    g.add_argument(
        "--kv-offload-disk",
        type=float,
        default=d.kv_offload_disk_gib,
        metavar="GIB",
        help=f"bound of the disk tier in GiB, least recently used blocks deleted first (default "
        f"{d.kv_offload_disk_gib:g})",
    )
    g.add_argument(
        "--kv-offload-dtype",
        choices=["auto", "int8", "int4"],
        default=d.kv_offload_dtype,
        help="what the disk tier stores of a full-precision cache's blocks: auto (their own bytes) or int8 / "
        "int4 codes (the quantized KV cache's scheme: 1/4 or 1/8 of fp32's bytes, hot tiers stay exact)",
    )
    add_sparse_options(g)
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help=f"requests running at once (default {d.max_num_seqs})",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help=f"tokens per step; bounds prefill chunks (default {d.max_num_batched_tokens})",
    )
    g.add_argument(
        "--long-prefill-tokens",
        type=non_negative_int,
        default=d.long_prefill_tokens,
        help="while other requests wait or run, a prompt computes at most this many tokens per step, "
        "so short prompts start and others decode alongside a long one "
        f"(default {d.long_prefill_tokens}; 0: no cap)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=d.max_waiting,
        help=f"waiting requests before new ones are refused (default {d.max_waiting})",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="keep every layer's KV for every token; by default a model with sliding-window layers "
        "(Gemma 3) keeps only their window (as vLLM's flag of this name)",
    )
    g.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        default=d.speculative,
        help="speculative decoding: ngram drafts the next tokens from the request's own context (prompt "
        "lookup: quoting, extracting, editing a document) and checks them in one forward; greedy "
        f"output stays the same (default {d.speculative})",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=d.num_speculative_tokens,
        help=f"tokens drafted per step at most (default {d.num_speculative_tokens})",
    )
    g.add_argument(
        "--prompt-lookup-max",
        type=positive_int,
        default=d.prompt_lookup_max,
        help="the longest n-gram of the output's end looked up in the context "
        f"(default {d.prompt_lookup_max})",
    )
    g.add_argument(
        "--prompt-lookup-min",
        type=positive_int,
        default=d.prompt_lookup_min,
        help=f"the shortest n-gram looked up (default {d.prompt_lookup_min})",
    )
    g.add_argument(
        "--speculative-max-running",
        type=non_negative_int,
        default=d.speculative_max_running,
        help="draft only while at most this many requests run: a full batch keeps the machine busy "
        f"without drafts (default {d.speculative_max_running})",
    )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    path: str
    name: str | None = None  # None: --served-model-name, or the model's own


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def model_spec(text: str) -> ModelSpec:
    """`PATH` or `NAME=PATH` (a name is letters, digits and `._:-`, so a path with `=` in it still
    reads as a path when what precedes the `=` is no name)."""
    name, sep, path = text.partition("=")
    if sep and _NAME.fullmatch(name):
        if not path:
            raise argparse.ArgumentTypeError(f"{text!r}: give the model's path after {name}=")
        return ModelSpec(path, name)
    return ModelSpec(text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The one model this command runs."""
    specs: list[ModelSpec] = args.model or []
    if len(specs) > 1:
        raise CtxfuseError("this command runs one model: give --model once (`ctxfuse serve` serves several)")
    return _engine_config(args, specs[0] if specs else None)


def engine_configs(args: argparse.Namespace) -> list[EngineConfig]:
    """One engine per --model (`ctxfuse serve` with several models)."""
    specs: list[ModelSpec] = args.model or []
    if len(specs) > 1 and args.served_model_name is not None:
        raise CtxfuseError(
            "--served-model-name names one model: with several, give each as --model NAME=PATH"
        )
    return [_engine_config(args, s) for s in specs] or [_engine_config(args, None)]


def _engine_config(args: argparse.Namespace, spec: ModelSpec | None) -> EngineConfig:
    if spec is not None and spec.name is not None and args.served_model_name is not None:
        raise CtxfuseError(f"the model is named twice: --model {spec.name}=... and --served-model-name")
    return EngineConfig(
        model=None if spec is None else spec.path,
        served_model_name=args.served_model_name if spec is None or spec.name is None else spec.name,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        attention_kernels=args.attention_kernels,
        dtype=args.dtype,
        weight_quant=args.weight_quant,
        block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_tokens=args.long_prefill_tokens,
        max_waiting=args.max_queue,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        attention=args.attention,
        sparse=sparse_config(args),
        kv_dtype=args.kv_dtype,
        kv_prune_budget=args.kv_prune_budget,
        rope_scaling=args.rope_scaling,
        context_overflow=args.context_overflow,
        kv_host_memory_gib=args.kv_host_memory,
        kv_offload_dir=args.kv_offload_dir,
        kv_offload_disk_gib=args.kv_offload_disk,
        kv_offload_dtype=args.kv_offload_dtype,
        chat_template=args.chat_template,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
        speculative_max_running=args.speculative_max_running,
    )


def template_file(text: str) -> str:
    """The text of a chat template file; refused at parse when it cannot be read or is empty."""
    path = Path(text)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise argparse.ArgumentTypeError(f"{text}: cannot be read ({why})") from None
    if not source.strip():
        raise argparse.ArgumentTypeError(f"{text} is empty")
    return source


def _json_object(text: str) -> dict[str, float | str]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value
