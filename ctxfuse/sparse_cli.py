"""The engine's attention options: `--attention` and the block-sparse attention's `--sparse-*` flags
(cloud/engine/config.py's SparseConfig), part of engine_cli.py's engine group."""

from __future__ import annotations

import argparse

from cloud.engine.config import DENSE_LAYERS, EngineConfig, SparseConfig
from ctxfuse.cli_values import non_negative_int, positive_int


def add_sparse_options(g: argparse._ArgumentGroup) -> None:
    d = EngineConfig()
    s = d.sparse
    g.add_argument(
        "--attention",
        choices=["dense", "sparse"],
        default=d.attention,
        help="dense (exact) or sparse: attention sinks + a recent window + the top KV blocks by key bounds "
        "(Quest), within --sparse-budget tokens",
    )
    g.add_argument(
        "--sparse-sinks", type=int, default=s.sinks, help=f"first tokens always attended ({s.sinks})"
    )
    g.add_argument(
        "--sparse-window", type=int, default=s.window, help=f"recent tokens always attended ({s.window})"
    )
    g.add_argument(
        "--sparse-budget", type=int, default=s.budget, help=f"tokens attended per query ({s.budget})"
    )
    g.add_argument(
        "--sparse-dense-layers",
        type=non_negative_int,
        default=s.dense_layers,
        metavar="N",
        help="first layers that stay dense (default: none where retrieval heads are dense, else "
        f"{DENSE_LAYERS})",
    )
    g.add_argument(
        "--sparse-top-p",
        type=float,
        default=None,
        help="keep the fewest selected blocks whose estimated attention mass reaches p (default off)",
    )
    g.add_argument(
        "--sparse-select",
        choices=("group", "head"),
        default=s.select,
        help="rank a KV head's blocks by the best bound over its query heads (group) or by each query "
        f"head's own bound order (head) ({s.select})",
    )
    g.add_argument(
        "--sparse-retrieval-heads",
        default=s.retrieval_heads,
        metavar="auto|none|FILE",
        help="KV heads that retrieve (a head calibration) attend densely, the rest sparsely "
        "(DuoAttention's split): auto (default) takes the calibration shipped for the model where there "
        "is one; a FILE as `ctxfuse bench longctx --configs sparse-eighth-duo` writes it (heads.json)",
    )
    g.add_argument(
        "--sparse-retrieval-threshold",
        type=float,
        default=s.retrieval_threshold,
        help=f"mean needle attention mass that makes a head a retrieval head ({s.retrieval_threshold:g})",
    )
    g.add_argument(
        "--sparse-reselect",
        type=positive_int,
        default=s.reselect,
        metavar="N",
        help="a decode step chooses its blocks afresh every N tokens (and whenever a request opens a KV "
        "block); in between each layer attends to the blocks it chose last: fewer selections, a staler "
        f"choice ({s.reselect}; 1: every step, as Quest)",
    )
    g.add_argument(
        "--sparse-score-block",
        type=positive_int,
        default=s.score_block,
        metavar="TOKENS",
        help="score blocks by key summaries of this many tokens, a divisor of the KV block (default: one "
        "per block): a tighter bound for the same blocks read, the summaries' memory times "
        "block / TOKENS, selection in PyTorch (full-precision or fp8 KV)",
    )


def sparse_config(args: argparse.Namespace) -> SparseConfig:
    return SparseConfig(
        args.sparse_sinks,
        args.sparse_window,
        args.sparse_budget,
        args.sparse_dense_layers,
        args.sparse_top_p,
        args.sparse_select,
        args.sparse_retrieval_heads,
        args.sparse_retrieval_threshold,
        args.sparse_reselect,
        args.sparse_score_block,
    )
