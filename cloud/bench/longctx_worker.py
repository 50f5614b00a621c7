"""One configuration of the long-context benchmark, run in its own process so that its peak RSS is
its own: it builds the engines the configuration's cases need, runs each case alone (one request,
greedy), and reports every finished case at once, as a line, to the parent.

Timings. Prefill: submission to first token. Decode: first token to last, per token after the
first. Attention: wall time inside the runner's attention backend, wrapped in place; on a GPU each
call is synchronised, so the figure is exact there too (and the step a little slower).
"""

from __future__ import annotations

import gc
import math
import resource
import sys
import time
import zlib
from array import array
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.attention.sparse_probe import SelectionProbe
from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.core import EngineCore
from cloud.engine.kv.layout import blocks_for_context
from cloud.model.loading import LoadedModel, load_model
from shared.engine_types import SamplingParams

from .longctx_calibrate import calibrate_heads, describe
from .longctx_configs import CONFIGS, EngineGroup, engine_config, plan
from .longctx_data import Case, CaseSpec, Encoder, answer_gist, is_correct, make_case, score
from .longctx_results import CaseResult, EngineInfo, GroupFailed, WorkerDone, WorkerLine, WorkerSpec

PROBE_KV_GIB = 1 / 16  # a probe engine's KV budget: room for a block of any layout
WARMUP = CaseSpec("passkey", 256, 50)  # first-call costs stay out of the first real case


def _say(msg: str) -> None:
    print(f"[longctx] {msg}", file=sys.stderr, flush=True)


class TimedAttention:
    """The runner's attention backend, with the seconds spent inside it added up. It takes any
    arguments, so it wraps every backend signature; other attributes pass through to the backend."""

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = self.inner(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def take(self) -> float:
        """The seconds since the last take."""
        s, self.seconds = self.seconds, 0.0
        return s


def _engine(config: EngineConfig, loaded: LoadedModel) -> EngineCore:
    """The engine with a KV budget just big enough for config.max_model_len tokens.

    Bytes per token depend on the layout (dtype, quantization scales, sparse key summaries) and a
    quantized cache sets full-precision staging aside first, so a probe engine measures both: what
    its budget holds beyond whole blocks is the staging plus less than one block. A pruning engine
    holds a prompt's blocks and its kept tokens' at once while it prunes: room for both."""
    if config.max_model_len is None or config.block_size is None:
        raise ValueError("the benchmark's engine config pins max_model_len and block_size")
    probe_cfg = replace(config, kv_cache_memory_gib=PROBE_KV_GIB, max_model_len=None, weight_quant="none")
    probe = EngineCore(probe_cfg, loaded)
    stats, layout = probe.stats(), probe.kv_plan.layout
    del probe
    gc.collect()
    block_bytes = stats.kv_bytes_per_token * config.block_size
    set_aside = PROBE_KV_GIB * 2**30 - stats.num_blocks * block_bytes
    # (with sliding-window layers kept to their window: the global layers' pages and the windows')
    chunk = config.max_num_batched_tokens
    blocks = blocks_for_context(layout, config.max_model_len, chunk, config.block_size)
    if config.kv_prune_budget is not None:
        blocks += math.ceil(config.kv_prune_budget / config.block_size)
    gib = (set_aside + blocks * block_bytes + 2**10) / 2**30  # a KiB against rounding
    return EngineCore(replace(config, kv_cache_memory_gib=gib), loaded)


def _prompt_crc(ids: tuple[int, ...]) -> int:
    return zlib.crc32(array("q", ids).tobytes())


def _run_case(
    core: EngineCore,
    timed: TimedAttention,
    case: Case,
    rid: str,
    probe: SelectionProbe | None = None,
) -> CaseResult:
    s = case.spec
    r = CaseResult(
        config="",
        task=s.task,
        length=s.length,
        depth=s.depth,
        sample=s.sample,
        prompt_tokens=len(case.prompt_ids),
        prompt_crc=_prompt_crc(case.prompt_ids),
        needle_depth=round(case.needle_depth, 4),
        key=case.key,
        subject=case.subject,
        kv_bytes_per_token=core.stats().kv_bytes_per_token,
    )
    pool = core.pool
    pool.low_free = pool.num_free
    # ignore_eos: every case decodes its answer tokens, so decode figures compare like with like;
    # the answer is cut at the first end-of-sequence token below
    params = SamplingParams(max_tokens=case.answer_tokens, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    if probe is not None:  # (a case without a needle, cwe's list, is measured for its mass kept only)
        probe.begin(case.needle_span, len(case.prompt_ids))

    def probed() -> float:  # the probe's seconds since the last call: left out of every timing
        if probe is None:
            return 0.0
        s, probe.seconds = probe.seconds, 0.0
        return s

    timed.take()
    t0 = time.perf_counter()
    core.add_request(rid, list(case.prompt_ids), params)
    t_first: float | None = None
    while core.has_work():
        for o in core.step():
            if o.error is not None:
                raise RuntimeError(o.error)
            tokens.extend(o.token_ids)
        if tokens and t_first is None:
            t_first = time.perf_counter()
            spent = probed()
            r.prefill_s, r.prefill_attention_s = t_first - t0 - spent, timed.take() - spent
    if t_first is None:
        raise RuntimeError("the request finished without a token")
    spent = probed()
    decode_s, decode_attention_s = time.perf_counter() - t_first - spent, timed.take() - spent
    if probe is not None:
        r.trace = probe.finish()
    page_bytes = core.kv_plan.bytes_per_token * core.kv_plan.block_size
    r.kv_peak_mib = round((pool.num_blocks - pool.low_free) * page_bytes / 2**20, 2)
    r.decode_tokens = len(tokens) - 1
    if r.decode_tokens > 0:
        r.decode_ms_per_token = 1e3 * decode_s / r.decode_tokens
        r.decode_attention_ms_per_token = 1e3 * decode_attention_s / r.decode_tokens
    end = next((i for i, t in enumerate(tokens) if t in core.tokenizer.eos_ids), len(tokens))
    r.answer = core.tokenizer.decode(tokens[:end])
    r.number = answer_gist(case, r.answer)
    r.score, r.correct = score(case, r.answer), is_correct(case, r.answer)
    return r


def _to_disk(core: EngineCore) -> None:
    """Evict every cached block of the pool (to the disk tier) and wait for the disk writes."""
    ids = core.pool.allocate(core.pool.num_free)
    if ids:
        core.pool.free(ids)
    if core.tiers is not None and core.tiers.disk is not None:
        core.tiers.disk.flush(600)


def _run_group(
    core: EngineCore, group: EngineGroup, spec: WorkerSpec, emit: Callable[[WorkerLine], None]
) -> None:
    timed = TimedAttention(core.runner.attention)
    core.runner.attention = timed
    probe = _probe(core) if spec.probe else None
    enc = Encoder(core.encode_chat, core.tokenizer)
    _run_case(core, timed, make_case(WARMUP, enc, spec.max_tokens, spec.seed), "warmup")
    cold = CONFIGS[spec.config].cold is not None
    for i, cs in enumerate(group.specs):
        rid = f"case-{i}"
        try:
            case = make_case(cs, enc, spec.max_tokens, spec.seed)
            if cold:  # fill the disk tier, push the prompt's blocks out of the pool: the run below reads them
                _run_case(core, timed, case, f"{rid}-prime")
                _to_disk(core)
            r = _run_case(core, timed, case, rid, probe)
        except Exception as exc:  # one case failing is a result, not the end of the run
            core.abort(rid)
            r = CaseResult(config="", task=cs.task, length=cs.length, depth=cs.depth, sample=cs.sample)
            r.error = f"{type(exc).__name__}: {exc}"
            _say(f"{cs}: {r.error}")
        r.config, r.max_model_len, r.rope_scaling = spec.config, group.max_model_len, group.rope_scaling
        emit(r)


def _heads(spec: WorkerSpec, loaded: LoadedModel, base: EngineConfig) -> Path:
    """The retrieval-head calibration file, made here when it does not exist yet."""
    if spec.heads is None:
        raise ValueError(f"{spec.config} keeps retrieval heads dense: it needs a head calibration file")
    path = Path(spec.heads)
    if not path.exists():
        cal = calibrate_heads(loaded, base)
        cal.save(path)
        _say(f"head calibration written to {path}: {describe(cal, SparseConfig().retrieval_threshold)}")
    return path


def _probe(core: EngineCore) -> SelectionProbe | None:
    """A probe on the engine's sparse attention (None: dense, nothing to follow)."""
    attention = core.runner.attention
    sparse = SparseAttention.of(attention.inner if isinstance(attention, TimedAttention) else attention)
    if sparse is None:
        return None
    sparse.probe = SelectionProbe()
    return sparse.probe


def _peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def run_worker(spec: WorkerSpec, emit: Callable[[WorkerLine], None]) -> None:
    config = CONFIGS[spec.config]
    base = EngineConfig(
        model=spec.model, device=spec.device, dtype=spec.dtype, weight_quant=spec.weight_quant, seed=spec.seed
    )
    loaded = load_model(spec.model)
    native = loaded.weights.config.max_position
    if native != spec.native_context:
        _say(f"the model states a {native}-token context; the grid assumes {spec.native_context}")
    engines = []
    for group in plan(config, spec.grid()):
        cfg = engine_config(base, config, group)
        if config.retrieval:
            heads = replace(cfg.sparse, retrieval_heads=str(_heads(spec, loaded, base)))
            if config.retrieval_threshold is not None:
                heads = replace(heads, retrieval_threshold=config.retrieval_threshold)
            cfg = replace(cfg, sparse=heads)
        t0 = time.perf_counter()
        try:
            core = _engine(cfg, loaded)
        except Exception as exc:  # e.g. an option this engine does not support (yet)
            error = f"{type(exc).__name__}: {exc}"
            _say(f"{spec.config}: no engine for {group.max_model_len} tokens: {error}")
            failed = GroupFailed(
                config=spec.config,
                max_model_len=group.max_model_len,
                rope_scaling=group.rope_scaling,
                cases=len(group.specs),
                error=error,
            )
            emit(failed)
            continue
        stats = core.stats()
        info = EngineInfo(
            max_model_len=core.max_model_len,
            rope_scaling=group.rope_scaling,
            lengths=tuple(sorted({s.length for s in group.specs})),
            kv_cache_memory_gib=round(core.config.kv_cache_memory_gib or 0.0, 4),
            kv_bytes_per_token=stats.kv_bytes_per_token,
            block_size=cfg.block_size or 0,
            weights=core.weight_plan.describe(),
            init_s=round(time.perf_counter() - t0, 3),
        )
        engines.append(info)
        _say(f"{spec.config}: engine for {info.lengths}: {info}")
        _run_group(core, group, spec, emit)
        del core
        gc.collect()
    emit(
        WorkerDone(
            config=spec.config,
            model=loaded.name,
            native_context=native,
            torch_threads=torch.get_num_threads(),
            peak_rss_mib=round(_peak_rss_mib(), 1),
            engines=engines,
        )
    )
