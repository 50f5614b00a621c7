"""Engine benchmark: prefill and decode throughput, time to first token (TTFT) on a long document
cold and with a prefix-cache hit, and memory; measured on our EngineCore and, in the same run, on
Hugging Face transformers loading the same model file, with the ratios ours / transformers.

Our engine is driven through its synchronous step loop (no threads), so wall times are exact. Both
sides see the same token ids. Every prompt opens with its own seeded random words, so it shares no
KV block with another prompt (block hashes chain from the first block): the prefix cache helps only
where it is meant to, on the second question about the same document.
"""

from __future__ import annotations

import gc
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from cloud.bench.report import say
from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.model.loading import load_model
from shared.engine_types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from transformers import GenerationMixin

# Public domain prose (Dickens, A Tale of Two Cities), so prompts tokenize like real text.
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. There were a king with a large jaw and a queen with a plain face, on the throne "
    "of England; there were a king with a large jaw and a queen with a fair face, on the throne of France.\n"
)
QUESTIONS = ("What is the document above about?", "Summarise the document above in one sentence.")
LEAD_TOKENS = 8  # seeded random words opening each prompt: they make it unique
DOC_MARGIN = 192  # context left beside the document for the chat template, the question and the answer
DOC_ANSWER_TOKENS = 4


@dataclass(frozen=True, slots=True)
class BenchOptions:
    quick: bool = False  # small sizes: a smoke run of a minute or two
    reference: bool = True  # also measure Hugging Face transformers


@dataclass(frozen=True, slots=True)
class Sizes:
    prefill: tuple[int, ...]  # prompt tokens (capped at the model's context less one)
    concurrency: tuple[int, ...]  # requests decoding at once
    decode_prompt: int  # prompt tokens of each decoding request
    new_tokens: int  # tokens each decoding request generates
    doc: int  # document tokens for the TTFT figures (capped to fit the context)


FULL = Sizes((512, 2048, 8192), (1, 8, 32), 32, 128, 8192)
QUICK = Sizes((128, 256), (1, 4), 32, 16, 512)


@dataclass(slots=True)
class Workload:
    """The token ids both sides see."""

    warmup: list[int]
    prefill: list[list[int]]
    decode: dict[int, list[list[int]]]  # concurrency -> one prompt per request
    doc_cold: list[int]  # chat prompt: a fresh document and a question
    doc_hit: list[int]  # the same document, another question


@dataclass(slots=True)
class Figures:
    prefill_tok_s: dict[str, float] = field(default_factory=dict)  # prompt tokens -> tokens/s
    decode_tok_s: dict[str, float] = field(default_factory=dict)  # concurrency -> tokens/s, all requests
    # ours, on a CPU: concurrency -> ms per decode step spent outside the model forward (scheduling,
    # the runner's inputs, sampling): the engine's own overhead, which machine noise in the forward hides
    decode_step_overhead_ms: dict[str, float] = field(default_factory=dict)
    ttft_cold_s: float = 0.0
    ttft_prefix_hit_s: float | None = None  # ours only
    ttft_cold_over_hit: float | None = None
    doc_prompt_tokens: int = 0
    prefix_hit_cached_tokens: int | None = None
    peak_rss_mib: float = 0.0  # the process's high-water mark so far (ru_maxrss)
    rss_mib: float = 0.0  # current RSS with the model loaded


def _prompt(rng: random.Random, base: list[int], n: int) -> list[int]:
    body = base * (n // len(base) + 1)
    return (rng.choices(base, k=LEAD_TOKENS) + body)[:n]


def _workload(core: EngineCore, sizes: Sizes, seed: int) -> Workload:
    rng = random.Random(seed)
    base = core.tokenizer.encode(TEXT)
    limit = core.max_model_len
    prefill = [_prompt(rng, base, min(n, limit - 1)) for n in sizes.prefill]  # room for the one output token
    decode = {c: [_prompt(rng, base, sizes.decode_prompt) for _ in range(c)] for c in sizes.concurrency}
    # decoding then re-encoding may shift a few tokens at the seams: DOC_MARGIN absorbs that
    doc = core.tokenizer.decode(_prompt(rng, base, min(sizes.doc, limit - DOC_MARGIN)))
    cold, hit = (core.encode_chat([{"role": "user", "content": f"{doc}\n\n{q}"}]) for q in QUESTIONS)
    return Workload(_prompt(rng, base, 64), prefill, decode, cold, hit)


def _step(core: EngineCore) -> list[RequestOutput]:
    outs = core.step()
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"request {o.request_id} failed: {o.error}")
    return outs


def _first_token(core: EngineCore, rid: str, ids: list[int], max_tokens: int = 1) -> tuple[float, int]:
    """Seconds from submission to the first token, and the prompt tokens the prefix cache served."""
    t0 = time.perf_counter()
    core.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    first: RequestOutput | None = None
    while first is None:
        first = next((o for o in _step(core) if o.request_id == rid), None)
    ttft = time.perf_counter() - t0
    while core.has_work():
        _step(core)
    return ttft, first.num_cached_tokens


class _ForwardClock:
    """Host seconds spent in the model's forward, counted from `on` (installed on the instance for
    the benchmark only; on a GPU the forward is asynchronous, so this is a CPU figure)."""

    def __init__(self, core: EngineCore) -> None:
        self.model = core.model
        self._forward = core.model.forward
        self.seconds = 0.0
        self.on = False

    def __enter__(self) -> _ForwardClock:
        self.model.forward = self._timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.forward

    def _timed(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = self._forward(*args, **kwargs)
        if self.on:
            self.seconds += time.perf_counter() - t
        return out


def _decode_rate(
    core: EngineCore, prompts: list[list[int]], new_tokens: int, tag: str
) -> tuple[float, float]:
    """Generated tokens/s from the moment every request has its first token (prefill excluded), and
    the milliseconds per step spent outside the model forward over the same steps."""
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        core.add_request(f"{tag}-{i}", ids, params)
    started: set[str] = set()
    t_start, counted, steps = 0.0, 0, 0
    with _ForwardClock(core) as clock:
        while core.has_work():
            outs = _step(core)
            if len(started) == len(prompts):
                counted += sum(len(o.token_ids) for o in outs)
                steps += 1
            else:
                started.update(o.request_id for o in outs if o.token_ids)
                t_start = time.perf_counter()
                clock.on = True
    wall = time.perf_counter() - t_start
    return counted / wall, 1000 * (wall - clock.seconds) / max(steps, 1)


def _measure_ours(core: EngineCore, w: Workload, sizes: Sizes) -> Figures:
    f = Figures(doc_prompt_tokens=len(w.doc_cold))
    _first_token(core, "warmup", w.warmup, max_tokens=4)
    for ids in w.prefill:
        t, _ = _first_token(core, f"prefill-{len(ids)}", ids)
        f.prefill_tok_s[str(len(ids))] = len(ids) / t
        say(f"ours prefill {len(ids)} tokens: {len(ids) / t:.0f} tok/s ({t:.3f} s)")
    for c, prompts in w.decode.items():
        rate, overhead = _decode_rate(core, prompts, sizes.new_tokens, f"decode-{c}")
        f.decode_tok_s[str(c)] = rate
        if core.device.type == "cpu":
            f.decode_step_overhead_ms[str(c)] = overhead
        say(
            f"ours decode at concurrency {c}: {rate:.1f} tok/s "
            f"({overhead:.2f} ms per step outside the forward)"
        )
    f.ttft_cold_s, _ = _first_token(core, "doc-cold", w.doc_cold, DOC_ANSWER_TOKENS)
    hit, f.prefix_hit_cached_tokens = _first_token(core, "doc-hit", w.doc_hit, DOC_ANSWER_TOKENS)
    f.ttft_prefix_hit_s, f.ttft_cold_over_hit = hit, f.ttft_cold_s / hit
    say(f"ours TTFT on {len(w.doc_cold)} tokens: cold {f.ttft_cold_s:.3f} s, prefix hit {hit:.3f} s")
    return f


def _load_reference(path: Path) -> GenerationMixin:
    from transformers import AutoModelForCausalLM

    say(f"loading transformers from {path}")
    where, kw = (path, {}) if path.is_dir() else (path.parent, {"gguf_file": path.name})
    return AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32, **kw).eval()


def _hf_generate(model: GenerationMixin, batch: list[list[int]], new_tokens: int) -> float:
    """Seconds to generate exactly new_tokens per row, greedy."""
    x = torch.tensor(batch)  # [batch, prompt]: the prompts of a batch have one length, so no padding
    kw = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, "pad_token_id": 0}
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw
        )
    return time.perf_counter() - t0


def _measure_reference(model: GenerationMixin, w: Workload, sizes: Sizes) -> Figures:
    f = Figures(doc_prompt_tokens=len(w.doc_cold))
    _hf_generate(model, [w.warmup], 4)
    for ids in w.prefill:
        t = _hf_generate(model, [ids], 1)
        f.prefill_tok_s[str(len(ids))] = len(ids) / t
        say(f"transformers prefill {len(ids)} tokens: {len(ids) / t:.0f} tok/s ({t:.3f} s)")
    for c, prompts in w.decode.items():
        # count what ours counts: every token but each request's first, net of the prefill behind it
        t_n, t_1 = _hf_generate(model, prompts, sizes.new_tokens), _hf_generate(model, prompts, 1)
        f.decode_tok_s[str(c)] = c * (sizes.new_tokens - 1) / (t_n - t_1)
        say(f"transformers decode at concurrency {c}: {f.decode_tok_s[str(c)]:.1f} tok/s")
    f.ttft_cold_s = _hf_generate(model, [w.doc_cold], 1)
    say(f"transformers TTFT on {len(w.doc_cold)} tokens: cold {f.ttft_cold_s:.3f} s")
    return f


def _memory_mib() -> tuple[float, float]:
    """(the process's peak RSS so far, its current RSS) in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak_mib = peak / 2**20 if sys.platform == "darwin" else peak / 2**10
    return peak_mib, psutil.Process().memory_info().rss / 2**20


def _ratios(ours: Figures, ref: Figures) -> dict[str, object]:
    """ours / transformers: above 1 is better for tokens/s, below 1 for seconds and memory."""
    return {
        "prefill_tok_s": {k: v / ref.prefill_tok_s[k] for k, v in ours.prefill_tok_s.items()},
        "decode_tok_s": {k: v / ref.decode_tok_s[k] for k, v in ours.decode_tok_s.items()},
        "ttft_cold_s": ours.ttft_cold_s / ref.ttft_cold_s,
        "rss_mib": ours.rss_mib / ref.rss_mib,
    }


def _rounded(x: object) -> object:
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


def run(config: EngineConfig, opts: BenchOptions) -> dict[str, object]:
    sizes = QUICK if opts.quick else FULL
    loaded = load_model(config.model)
    path = loaded.path
    core = EngineCore(config, loaded)
    del loaded  # the core keeps what it needs; the reference below loads its own copy
    result: dict[str, object] = {
        "config": {
            "model": core.model_name,
            "dtype": config.dtype,
            "weight_quant": config.weight_quant,
            "weights": core.weight_plan.describe(),
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "kv_cache_memory_gib": config.kv_cache_memory_gib,  # preallocated: part of our RSS
            "max_model_len": core.max_model_len,
            "torch_threads": torch.get_num_threads(),
            "quick": opts.quick,
        },
        "sizes": asdict(sizes),
    }
    say(f"our engine: {core.model_name}, {config.dtype}, {torch.get_num_threads()} threads")
    w = _workload(core, sizes, config.seed)
    ours = _measure_ours(core, w, sizes)
    ours.peak_rss_mib, ours.rss_mib = _memory_mib()
    say(f"ours peak RSS {ours.peak_rss_mib:.0f} MiB, current {ours.rss_mib:.0f} MiB")
    result["ours"] = asdict(ours)
    if opts.reference:
        del core
        gc.collect()
        model = _load_reference(path)
        ref = _measure_reference(model, w, sizes)
        ref.peak_rss_mib, ref.rss_mib = _memory_mib()
        del model
        gc.collect()
        say(f"transformers peak RSS {ref.peak_rss_mib:.0f} MiB (process), current {ref.rss_mib:.0f} MiB")
        result["reference"] = asdict(ref)
        result["ours_over_reference"] = _ratios(ours, ref)
    return {k: _rounded(v) for k, v in result.items()}
