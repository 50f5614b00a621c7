"""Quest block selection on the CPU (quest_select.cpp): the rule and output of the Triton kernel
(kernels/triton/quest_select.py) and its PyTorch reference `quest_select_reference`, from the fp16 key
summaries read in place. The CPU attention backend takes it for sparse decode in place of
SparseAttention.select's ~15 PyTorch operations a layer.

Built once per machine (build.py); `available()` is False where it cannot be built, and the backend
keeps the PyTorch selection. Tests: tests/kernels/test_cpu_quest_select.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.triton.sparse_checks import check_select

from .build import Extension

_EXT = Extension("quest_select", Path(__file__).with_name("quest_select.cpp"))


def available() -> bool:
    """Whether the compiled kernel loads here (the first call builds it)."""
    return _EXT.available()


_module = _EXT.module
_NONE = torch.empty(0, dtype=torch.bool)  # no head keeps every block


def quest_select_cpu(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sink_blocks: int,
    window_blocks: int,
    top_k: int,
    *,
    block_size: int,
    every: torch.Tensor | None = None,
    vector: bool = True,
    check: bool = True,
) -> torch.Tensor:
    """As kernels/triton/quest_select.py `quest_select`: -> [b, kv_heads, sink_blocks + top_k +
    window_blocks] int32 block positions, ascending, then -1. `every`: [kv_heads] bool, heads that keep
    every block of their context (retrieval heads); with one set the output is as wide as the table
    where that is wider. `vector=False` takes the plain C++ path (for tests). `check=False` skips the
    checks that name a bad argument, for a caller that made them once this step (the C++ still refuses
    what would read out of bounds)."""
    if check:
        check_select(q, kmin, kmax, block_tables, context_lens, sink_blocks, window_blocks, top_k, block_size)
        if q.device.type != "cpu":
            raise ValueError(f"q must be on the CPU, got {q.device}")
        if every is not None and (every.dtype != torch.bool or tuple(every.shape) != (kmin.shape[0],)):
            raise ValueError(
                f"every must be bool [kv_heads={kmin.shape[0]}], got {every.dtype} {tuple(every.shape)}"
            )
    if every is None:
        every = _NONE
    out: torch.Tensor = _module().quest_select(
        q.float().contiguous(),
        kmin.half(),
        kmax.half(),
        block_tables.long().contiguous(),
        context_lens.long().contiguous(),
        every.contiguous(),
        sink_blocks,
        window_blocks,
        top_k,
        block_size,
        vector,
    )
    return out


def vector_path() -> bool:
    """Whether this CPU takes the F16C + FMA path."""
    return bool(_module().vector_path())
