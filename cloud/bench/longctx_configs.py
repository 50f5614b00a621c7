"""The engine configurations the long-context benchmark compares, and which engines each needs.

A configuration is named after what it changes from dense: `sparse-1024` (block-sparse attention,
1024 tokens attended per query), `int4` (KV cache in int4), `sparse-1024-int4` (both), `pruned-25`
(after its prefill a case keeps the KV of 25% of its tokens, chosen by attention: kv/prune.py; its
budget follows each case's length, so such a configuration runs one engine per length), `cold-int4`
(the prompt's KV comes back from a disk tier that stores it as int4: each case runs once to fill the
tier, then again, scored, with every full prompt block read from disk), `dense-allkv` (a model's
sliding-window layers keep every token's KV, as before kv/layout.py; the same as dense for a model
without such layers). Every
configuration runs the same cases; cases longer than the model's native (trained) context run on a
second engine with YaRN RoPE scaling. `dense-noyarn` is the exception: it runs only those long cases
up to twice the native context, with unscaled RoPE, to show what YaRN buys.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from typing import Any, Literal

from cloud.engine.config import AttentionKind, EngineConfig, KVDType, OffloadDType, SparseConfig

from .longctx_data import CaseSpec, Task

DEFAULT_NATIVE_CONTEXT = 8192  # SmolLM2-135M-Instruct's trained context
DEFAULT_YARN_FACTOR = 4.0
BUDGET_ROUNDING = 32  # a share-of-context budget in whole blocks of any KV layout (16 or 32 tokens)


@dataclass(frozen=True, slots=True)
class LongCtxConfig:
    name: str
    attention: AttentionKind = "dense"
    sparse_budget: int | None = None  # tokens attended per query (sparse attention only)
    kv_dtype: KVDType = "auto"
    yarn: bool = True  # False: long cases keep unscaled RoPE (and only those up to 2x native run)
    prune: float | None = None  # KV pruned after the prefill to this share of the case's tokens
    # the case's prompt KV read back from a disk tier that stores it at this precision (kv/tiers):
    # each case runs twice, the second (scored) run takes every full prompt block from disk
    cold: OffloadDType | None = None
    hybrid: bool = True  # False: every layer keeps every token's KV, sliding-window layers included
    # sparse attention's budget as a share of the case's length (one engine per length), not in tokens
    budget_share: float | None = None
    sparse_select: Literal["group", "head"] = "group"  # SparseConfig.select
    dense_layers: int | None = None  # None: SparseConfig's default
    top_p: float | None = None  # SparseConfig.top_p
    # retrieval heads dense (DuoAttention's split), from a head calibration (longctx_calibrate.py)
    retrieval: bool = False
    retrieval_threshold: float | None = None  # None: SparseConfig's default
    reselect: int = 1  # SparseConfig.reselect: a decode step chooses its blocks every this many tokens
    score_block: int | None = None  # SparseConfig.score_block: tokens per key summary (None: a block)


def _duo(
    name: str, threshold: float, dense_layers: int, share: float = 1 / 8, **changes: Any
) -> LongCtxConfig:
    """Sparse at a share of the context (an eighth unless told) with retrieval heads dense
    (DuoAttention's split)."""
    return LongCtxConfig(
        name,
        attention="sparse",
        budget_share=share,
        retrieval=True,
        retrieval_threshold=threshold,
        dense_layers=dense_layers,
        **changes,
    )


CONFIGS: dict[str, LongCtxConfig] = {
    c.name: c
    for c in (
        LongCtxConfig("dense"),  # the reference: every ratio is to this one, so it runs first
        LongCtxConfig("sparse-1024", attention="sparse", sparse_budget=1024),
        LongCtxConfig("sparse-2048", attention="sparse", sparse_budget=2048),
        # `--attention sparse` as served to a model without a head calibration (Gemma 3): SparseConfig's
        # budget, reselection and dense layers
        LongCtxConfig("sparse-2048-r4", attention="sparse", sparse_budget=2048, reselect=4),
        LongCtxConfig("int8", kv_dtype="int8"),
        LongCtxConfig("int4", kv_dtype="int4"),
        LongCtxConfig("sparse-1024-int4", attention="sparse", sparse_budget=1024, kv_dtype="int4"),
        # the budget: an eighth of the context, and what each change to the selection buys there
        LongCtxConfig("sparse-eighth", attention="sparse", budget_share=1 / 8),
        LongCtxConfig("sparse-eighth-head", attention="sparse", budget_share=1 / 8, sparse_select="head"),
        LongCtxConfig("sparse-eighth-dense8", attention="sparse", budget_share=1 / 8, dense_layers=8),
        LongCtxConfig("sparse-eighth-topp", attention="sparse", budget_share=1 / 8, top_p=0.95),
        LongCtxConfig("sparse-eighth-int4", attention="sparse", budget_share=1 / 8, kv_dtype="int4"),
        # blocks scored by summaries of 8 or 4 of their 16 tokens (the same blocks read)
        LongCtxConfig("sparse-eighth-score8", attention="sparse", budget_share=1 / 8, score_block=8),
        LongCtxConfig("sparse-eighth-score4", attention="sparse", budget_share=1 / 8, score_block=4),
        # the threshold pinned where the first pass measured it (0.1: 18 heads), whatever the default;
        # the retrieval-head configurations before -dense0 pin the two dense layers they ran with
        _duo("sparse-eighth-duo", 0.1, 2),
        _duo("sparse-eighth-duo-int4", 0.1, 2, kv_dtype="int4"),
        # fewer retrieval heads (11 of SmolLM2's 90 KV heads rather than 18)
        _duo("sparse-eighth-duo-0.2", 0.2, 2),
        # its selection taken again for 4 tokens, or for as long as a row's newest block is open (16
        # with 16-token blocks)
        _duo("sparse-eighth-duo-0.2-r4", 0.2, 2, reselect=4),
        _duo("sparse-eighth-duo-0.2-r16", 0.2, 2, reselect=16),
        # and no layer dense but the retrieval heads: the default since its runs (the first two layers
        # are a quarter of what a sparse step reads at 16K)
        _duo("sparse-eighth-duo-0.2-r4-dense0", 0.2, 0, reselect=4),
        # the same at half the budget: the Quest heads read half as many blocks
        _duo("sparse-sixteenth-duo-0.2-r4-dense0", 0.2, 0, share=1 / 16, reselect=4),
        LongCtxConfig("pruned-25", prune=0.25),
        LongCtxConfig("pruned-10", prune=0.10),
        LongCtxConfig("cold-int8", cold="int8"),
        LongCtxConfig("cold-int4", cold="int4"),
        LongCtxConfig("dense-noyarn", yarn=False),
        LongCtxConfig("dense-allkv", hybrid=False),
    )
}
REFERENCE = "dense"
# one change each to the selection at a budget of an eighth (or a sixteenth) of the context, and the
# served selection at its default budget: run when asked for
ABLATIONS = (
    *(name for name in CONFIGS if name.startswith(("sparse-eighth-", "sparse-sixteenth-"))),
    "sparse-2048-r4",
)


@dataclass(frozen=True, slots=True)
class Grid:
    tasks: tuple[Task, ...]
    lengths: tuple[int, ...]  # total tokens per case (prompt + answer)
    depths: tuple[int, ...]  # percent
    samples: int = 1  # cases per (task, length, depth) cell
    native_context: int = DEFAULT_NATIVE_CONTEXT
    yarn_factor: float = DEFAULT_YARN_FACTOR

    def specs(self, lengths: tuple[int, ...]) -> tuple[CaseSpec, ...]:
        return tuple(
            CaseSpec(task, n, depth, s)
            for n in lengths
            for task in self.tasks
            for depth in self.depths
            for s in range(self.samples)
        )


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """Cases that share one engine: the same RoPE scaling and context length."""

    rope_scaling: dict[str, float | str] | None  # None: the model's own RoPE
    max_model_len: int
    specs: tuple[CaseSpec, ...]


def plan(config: LongCtxConfig, grid: Grid) -> list[EngineGroup]:
    """The engines a configuration needs, shortest context first, each with its cases."""
    native = grid.native_context
    short = tuple(sorted(n for n in grid.lengths if n <= native))
    long = tuple(sorted(n for n in grid.lengths if n > native))
    if not config.yarn:
        within = tuple(n for n in long if n <= 2 * native)
        return [EngineGroup(None, within[-1], grid.specs(within))] if within else []
    groups = [EngineGroup(None, short[-1], grid.specs(short))] if short else []
    if long:
        yarn: dict[str, float | str] = {"type": "yarn", "factor": grid.yarn_factor}
        # the context YaRN stretches the model to, as the issue has it (32768 for SmolLM2 x 4)
        scaled = max(int(native * grid.yarn_factor), long[-1])
        groups.append(EngineGroup(yarn, scaled, grid.specs(long)))
    if config.prune is not None or config.budget_share is not None:  # budgets per engine: one per length
        return [
            replace(g, specs=tuple(s for s in g.specs if s.length == n))
            for g in groups
            for n in sorted({s.length for s in g.specs})
        ]
    return groups


def engine_config(base: EngineConfig, config: LongCtxConfig, group: EngineGroup) -> EngineConfig:
    """The engine for one group, less its KV budget (sized once bytes per token are known)."""
    # retrieval heads only where the configuration asks (the worker names the file): the others
    # measure the selection alone
    sparse = SparseConfig(
        select=config.sparse_select,
        top_p=config.top_p,
        retrieval_heads=None,
        reselect=config.reselect,
        score_block=config.score_block,
    )
    if config.dense_layers is not None:
        sparse = replace(sparse, dense_layers=config.dense_layers)
    if config.sparse_budget is not None:
        sparse = replace(sparse, budget=config.sparse_budget)
    elif config.budget_share is not None:  # whole blocks; never less than the sinks, the window and a block
        share = int(config.budget_share * max(s.length for s in group.specs))
        share -= share % BUDGET_ROUNDING
        sparse = replace(sparse, budget=max(share, sparse.sinks + sparse.window + BUDGET_ROUNDING))
    prune = None if config.prune is None else int(config.prune * max(s.length for s in group.specs))
    chosen = replace(
        base,
        attention=config.attention,
        sparse=sparse,
        kv_dtype=config.kv_dtype,
        kv_prune_budget=prune,
        rope_scaling=group.rope_scaling,
        max_model_len=group.max_model_len,
        # cases share haystack prefixes: a prefix-cache hit would make prefill look faster than it is
        # (a cold configuration needs the cache: its scored run takes the prompt's blocks from disk)
        enable_prefix_caching=config.cold is not None,
        kv_offload_dir=None if config.cold is None else tempfile.mkdtemp(prefix="ctxfuse-longctx-cold-"),
        kv_offload_dtype=config.cold or "auto",
        max_num_seqs=1,  # one request at a time: per-request long-context behaviour
        disable_hybrid_kv_cache_manager=not config.hybrid,
    )
    # pinned, so that the KV budget can be sized in whole blocks of a known size
    return replace(chosen, block_size=chosen.kv_block_size)
