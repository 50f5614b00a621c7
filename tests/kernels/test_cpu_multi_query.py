"""Multi-query decode on the CPU (`paged_decode_cpu` / `paged_decode_quant_cpu` with q [b, n, H, d]):
each request's last n positions attend causally in one pass over its context. Row i of a request of
length len is the one-query decode of position len - n + i (context len - n + 1 + i), so every row is
checked against the PyTorch references run one query at a time, on every vector path this CPU runs;
and a chunk against the prefill kernel and the float64 reference of causal attention."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.cpu import paged_attention as pa
from kernels.triton.paged_decode import paged_decode_reference
from kernels.triton.paged_decode_quant import paged_decode_quant_reference
from tests.kernels.test_cpu_paged_attention import _isa, _layout, _quant_cache, _quant_inputs

pytestmark = pytest.mark.skipif(not pa.available(), reason="the C++ extension cannot be built here")
ISAS = list(pa.Isa)
BF16 = torch.bfloat16


def _one_query_each(
    q: torch.Tensor, tables: torch.Tensor, lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same rows as b * n one-query decodes: q [b * n, H, d], each row's table and context."""
    b, n = q.shape[:2]
    rows = q.reshape(b * n, *q.shape[2:])
    ctx = torch.tensor([max(0, length - n + 1 + i) for length in lens for i in range(n)])
    return rows, tables.repeat_interleave(n, 0), ctx


DENSE = [  # cache dtype, group, d, block_size, n, lens
    (torch.float32, 3, 64, 16, 4, [100, 5, 17]),  # 17: the rows' keys cross a block boundary
    (torch.float32, 1, 128, 32, 2, [64, 33]),
    (torch.float32, 8, 64, 16, 7, [40, 3, 0]),  # 3 < n: the first rows see nothing (0)
    (BF16, 3, 64, 16, 16, [90, 16]),
    (torch.float16, 3, 128, 16, 1, [70, 1]),  # one row: plain decode
]


@pytest.mark.parametrize("isa", ISAS, ids=[i.name for i in ISAS])
@pytest.mark.parametrize(
    ("dtype", "group", "d", "bs", "n", "lens"),
    DENSE,
    ids=[f"{str(c[0])[6:]}-g{c[1]}-d{c[2]}-bs{c[3]}-n{c[4]}" for c in DENSE],
)
def test_each_row_is_the_decode_of_its_position(
    isa: pa.Isa, dtype: torch.dtype, group: int, d: int, bs: int, n: int, lens: list[int]
) -> None:
    gen = torch.Generator().manual_seed(group * 100 + d + n)
    kv_heads = 2
    k, v, tables = _layout(lens, kv_heads, d, bs, gen)
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(len(lens), n, kv_heads * group, d, generator=gen)
    ctx = torch.tensor(lens, dtype=torch.int32)

    out = pa.paged_decode_cpu(q, k, v, tables, ctx, d**-0.5, isa=_isa(isa))
    rows, row_tables, row_ctx = _one_query_each(q, tables, lens)
    want = paged_decode_reference(rows, k, v, row_tables, row_ctx, d**-0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out.reshape(rows.shape), want, atol=1e-5, rtol=1e-5)
    blind = (row_ctx == 0).nonzero().squeeze(1)
    assert torch.count_nonzero(out.reshape(rows.shape)[blind]) == 0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_contexts_split_over_threads_agree(threads: int) -> None:
    """At 2+ threads a long context is cut into splits merged by log-sum-exp; a split past a row's
    last key (the chunk's own keys lie in the last one) leaves that row's partial empty."""
    gen = torch.Generator().manual_seed(threads)
    lens, d, n = [2000, 700], 64, 5
    k, v, tables = _layout(lens, 3, d, 16, gen)
    q = torch.randn(2, n, 9, d, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = pa.paged_decode_cpu(q, k, v, tables, torch.tensor(lens), d**-0.5)
    finally:
        torch.set_num_threads(before)
    rows, row_tables, row_ctx = _one_query_each(q, tables, lens)
    want = paged_decode_reference(rows, k, v, row_tables, row_ctx, d**-0.5)
    torch.testing.assert_close(out.reshape(rows.shape), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS, ids=[i.name for i in ISAS])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_rows_are_the_decode_of_their_positions(isa: pa.Isa, bits: int) -> None:
    lens, d, n = [70, 37, 2], 64, 3
    cache, tables = _quant_cache(bits, 3, d, 16, torch.float32, lens, seed=bits)
    q = torch.randn(len(lens), n, 9, d, generator=torch.Generator().manual_seed(5))
    params: list[Any] = _quant_inputs(cache)
    out = pa.paged_decode_quant_cpu(q, *params, tables, torch.tensor(lens), d**-0.5, bits, isa=_isa(isa))
    rows, row_tables, row_ctx = _one_query_each(q, tables, lens)
    want = paged_decode_quant_reference(rows, *params, row_tables, row_ctx, d**-0.5, bits)
    torch.testing.assert_close(out.reshape(rows.shape), want, atol=2e-5, rtol=1e-4)


def test_a_chunk_is_the_prefill_kernels_causal_attention() -> None:
    """The verify step's view: a chunk of n positions after `start` cached tokens, by either kernel."""
    gen = torch.Generator().manual_seed(9)
    start, n, d = 300, 4, 64
    k, v, tables = _layout([start + n], 3, d, 16, gen)
    q = torch.randn(n, 9, d, generator=gen)
    prefill = pa.prefill_attention_cpu(q, k, v, tables[0], start, d**-0.5)
    multi = pa.paged_decode_cpu(q[None], k, v, tables, torch.tensor([start + n]), d**-0.5)
    torch.testing.assert_close(multi[0], prefill, atol=1e-5, rtol=1e-5)


def test_refuses_what_it_cannot_take() -> None:
    gen = torch.Generator().manual_seed(1)
    k, v, tables = _layout([40], 3, 64, 16, gen)
    ctx = torch.tensor([40])
    with pytest.raises(ValueError, match="query rows per request"):
        pa.paged_decode_cpu(torch.randn(1, pa.MAX_QUERY_ROWS + 1, 9, 64), k, v, tables, ctx, 0.125)
    with pytest.raises(ValueError, match="query rows per request"):
        pa.paged_decode_cpu(torch.randn(1, 0, 9, 64), k, v, tables, ctx, 0.125)
    with pytest.raises(ValueError, match="dimensions"):  # sparse decode takes one row per request
        pa.sparse_paged_decode_cpu(
            torch.randn(1, 2, 9, 64), k, v, tables, torch.zeros(1, 3, 2, dtype=torch.long), ctx, 0.125
        )
