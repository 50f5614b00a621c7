"""`ctxfuse bench kv-tiers`: the time to first token of one long document when its KV blocks come
from each place they can be (cloud/engine/kv/tiers), measured in-process on the engine core, in one
run: cold (prefilled), from the device pool, from the host-RAM tier, from the disk tier, and from the
disk tier in a new engine over the same directory (a restart: the tier's index rebuilt from the files).

Between phases the document is pushed down a level as eviction would: the pool's free blocks are all
taken and given back (every cached block of the document is demoted to host RAM); the host tier is
emptied for the disk phase; the disk files are dropped from the OS page cache (posix_fadvise) before
the disk phases, so they are read from the device, not from memory. TTFT is from submission to the
first token. Each phase generates --check-tokens greedy tokens; how many lead tokens equal the cold
run's shows the fidelity of the KV it read (all of them with the cache's own bytes;
`--offload-dtype int8|int4` measures the cold precision's cost). Peak RSS is the process's at the end
of each phase.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cloud.bench.report import publish, say
from cloud.engine.config import EngineConfig, OffloadDType
from cloud.engine.core import EngineCore
from cloud.model.loading import LoadedModel, load_model
from shared.engine_types import SamplingParams


@dataclass(frozen=True, slots=True)
class TierBenchOptions:
    tokens: int = 16384
    yarn_factor: float = 2.0  # RoPE scaling for a document past the model's own context (0: none)
    offload_dtype: OffloadDType = "auto"  # what the disk tier stores (auto: the cache's own bytes)
    dir: Path | None = None  # the disk tier (default: a temporary directory)
    check_tokens: int = 32  # greedy tokens compared with the cold run's (the KV's fidelity)
    seed: int = 0
    out: Path = Path("bench-results/kv-tiers.json")
    device: str = "auto"


@dataclass(slots=True)
class Phase:
    name: str
    ttft_s: float
    cached_tokens: int
    peak_rss_mib: float
    same_tokens: int  # of the greedy continuation, how many lead tokens equal the cold run's


def _generate(core: EngineCore, rid: str, ids: list[int], n: int) -> tuple[float, int, list[int]]:
    """TTFT, cached_tokens and the n greedy tokens of one request run alone."""
    t0 = time.perf_counter()
    core.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    ttft, cached, tokens = -1.0, -1, []
    while core.has_work():
        for o in core.step():
            if ttft < 0 and o.token_ids:
                ttft = time.perf_counter() - t0
            tokens += o.token_ids
            if o.finished:
                cached = o.num_cached_tokens
    return ttft, cached, tokens


def _demote_all(core: EngineCore) -> None:
    """Evict every free cached block of the pool (the tiers below take them), as a busy pool would."""
    ids = core.pool.allocate(core.pool.num_free)
    if ids:
        core.pool.free(ids)


def _drop_page_cache(root: Path) -> None:
    for f in root.rglob("*.kvb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(opts: TierBenchOptions, loaded: LoadedModel | None = None) -> list[Phase]:
    loaded = loaded or load_model()
    disk_dir = opts.dir or Path(tempfile.mkdtemp(prefix="ctxfuse-kv-tiers-"))
    rope: dict[str, float | str] | None = None
    if opts.yarn_factor > 0:
        rope = {"type": "yarn", "factor": opts.yarn_factor}
    config = EngineConfig(
        device=opts.device,
        rope_scaling=rope,
        max_model_len=opts.tokens + 64,
        kv_host_memory_gib=2.0,  # the document whole, as the pool holds it (its CPU default: 2 GiB)
        kv_offload_dir=str(disk_dir),
        kv_offload_disk_gib=8.0,
        kv_offload_dtype=opts.offload_dtype,
    )
    core = EngineCore(config, loaded)
    say(core.kv_plan.describe())
    rng = random.Random(opts.seed)
    vocab = core.tokenizer.vocab_size
    doc = [rng.randrange(100, vocab) for _ in range(opts.tokens)]
    phases: list[Phase] = []
    reference: list[int] = []

    def phase(name: str, engine: EngineCore) -> None:
        ttft, cached, tokens = _generate(engine, f"{name}-{len(phases)}", doc, opts.check_tokens)
        if not reference:
            reference.extend(tokens)
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), len(tokens)
        )
        phases.append(Phase(name, ttft, cached, _rss_mib(), same))
        say(f"{name}: TTFT {ttft:.3f} s, cached_tokens {cached}, {same}/{len(tokens)} tokens as cold")

    phase("cold", core)
    phase("device pool", core)
    _demote_all(core)
    phase("host RAM", core)
    _demote_all(core)
    if core.tiers is not None and core.tiers.host is not None:
        core.tiers.host.clear()
    if core.tiers is not None and core.tiers.disk is not None:
        core.tiers.disk.flush(600)
    _drop_page_cache(disk_dir)
    phase("disk", core)
    core.close()
    del core
    gc.collect()  # (the core holds cycles: its memory goes only now)
    _drop_page_cache(disk_dir)
    restarted = EngineCore(replace(config, kv_host_memory_gib=0.0), loaded)
    phase("disk after restart", restarted)
    restarted.close()
    return phases


def report(phases: list[Phase], opts: TierBenchOptions) -> str:
    cold = phases[0].ttft_s
    lines = [
        f"{opts.tokens}-token document, one engine, TTFT by where its KV came from "
        f"(disk tier stores: {opts.offload_dtype})",
        "| from | TTFT (s) | x faster than cold | cached_tokens | greedy tokens as cold | peak RSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for p in phases:
        x = cold / p.ttft_s
        same = f"{p.same_tokens}/{opts.check_tokens}"
        cells = (p.name, f"{p.ttft_s:.3f}", f"{x:.1f}", p.cached_tokens, same, f"{p.peak_rss_mib:.0f}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def cmd_kv_tiers(args: argparse.Namespace) -> int:
    opts = TierBenchOptions(
        tokens=args.tokens,
        yarn_factor=args.yarn_factor,
        offload_dtype=args.offload_dtype,
        dir=args.dir,
        check_tokens=args.check_tokens,
        seed=args.seed,
        out=args.out,
        device=args.device,
    )
    phases = run(opts)
    payload = {"options": {k: str(v) for k, v in asdict(opts).items()}, "phases": [asdict(p) for p in phases]}
    publish(opts.out, payload, report(phases, opts))
    return 0


def add_kv_tiers_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = TierBenchOptions()
    p = bench.add_parser(
        "kv-tiers", help="TTFT of a long document from each KV tier: cold, device, host RAM, disk, restart"
    )
    p.add_argument("--tokens", type=int, default=d.tokens, help="document length (default %(default)s)")
    p.add_argument(
        "--yarn-factor",
        type=float,
        default=d.yarn_factor,
        help="YaRN RoPE scaling for a document past the model's context (default %(default)s; 0: none)",
    )
    p.add_argument(
        "--offload-dtype",
        choices=["auto", "int8", "int4"],
        default=d.offload_dtype,
        help="what the disk tier stores (default %(default)s: the cache's own bytes)",
    )
    p.add_argument("--dir", type=Path, default=None, help="the disk tier (default: a temporary directory)")
    p.add_argument(
        "--check-tokens",
        type=int,
        default=d.check_tokens,
        help="greedy tokens compared with the cold run's (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="document tokens (default %(default)s)")
    p.add_argument("--out", type=Path, default=d.out, help="JSON results file (default %(default)s)")
    p.add_argument("--device", default=d.device, help="auto (default), cpu, cuda or cuda:N")
    p.set_defaults(func=cmd_kv_tiers)
