"""The CPU's compiled Quest selection (kernels/cpu/quest_select.py) against the PyTorch reference
the Triton kernel answers to (kernels/triton/quest_select.py `quest_select_reference`): the same
positions on both of its paths (F16C + FMA, plain C++), ties to the lower position, no block without
a real bound, retrieval heads keeping every block, and bad input refused."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import quest_select as qs
from kernels.triton.quest_select import quest_select_reference

pytestmark = pytest.mark.skipif(not qs.available(), reason="the C++ extension cannot be built here")

BS = 16
# rows: a long one, a short one with an empty middle (nblk < sinks + window), one past its table's
# last whole block, a middling one
LENS = [40 * BS - 5, 2 * BS + 3, 25 * BS, 9 * BS + 1]
PATHS = [True, False] if qs.vector_path() else [False]


def _layout(lens: list[int], num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables of shuffled block ids, two spare columns padded with 0."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // BS) for n in lens]
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(nblk) + 2, dtype=torch.int64)
    at = 0
    for r, n in enumerate(nblk):
        tables[r, :n] = ids[at : at + n]
        at += n
    return tables, torch.tensor(lens)


def _summaries(kv_heads: int, num_blocks: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kmin = torch.randn(kv_heads, num_blocks, d, generator=g)
    kmax = kmin + torch.rand(kv_heads, num_blocks, d, generator=g) * 2
    return kmin.half(), kmax.half()


@pytest.mark.parametrize("vector", PATHS)
@pytest.mark.parametrize(
    ("group", "d", "sinks", "window", "top_k"),
    [
        (1, 64, 1, 2, 3),
        (3, 64, 2, 1, 8),  # the default model's group
        (8, 128, 0, 0, 5),  # no sinks, no window
        (3, 24, 1, 2, 4),  # a head dim the vector path does not take: plain C++
        (3, 64, 1, 2, 0),  # sinks and window only
        (20, 64, 1, 1, 6),  # a group wider than the vector path's: plain C++
        (2, 64, 1, 1, 60),  # top_k past every middle: all blocks
    ],
)
def test_selection_equals_the_reference(
    group: int, d: int, sinks: int, window: int, top_k: int, vector: bool
) -> None:
    kv_heads, num_blocks = 3, 100
    tables, lens = _layout(LENS, num_blocks, seed=d + group)
    kmin, kmax = _summaries(kv_heads, num_blocks, d, seed=group)
    q = torch.randn(len(LENS), kv_heads * group, d, generator=torch.Generator().manual_seed(top_k))
    args = (q, kmin, kmax, tables, lens, sinks, window, top_k)
    got = qs.quest_select_cpu(*args, block_size=BS, vector=vector)
    assert got.dtype == torch.int32 and got.shape == (len(LENS), kv_heads, sinks + top_k + window)
    assert torch.equal(got, quest_select_reference(*args, block_size=BS))
    # int32 tables and lengths, fp16 queries and a strided kmax select the same
    q16 = q.half()
    strided = torch.cat([kmax, kmax], -1)[..., :d]
    args16 = (q16, kmin, strided, tables.int(), lens.int(), sinks, window, top_k)
    want16 = quest_select_reference(q16, kmin, kmax, tables, lens, sinks, window, top_k, block_size=BS)
    assert torch.equal(qs.quest_select_cpu(*args16, block_size=BS, vector=vector), want16)


@pytest.mark.parametrize("vector", PATHS)
def test_ties_go_to_the_lower_position(vector: bool) -> None:
    tables, lens = _layout([36 * BS], 40, seed=1)
    kmin = torch.zeros(1, 40, 64, dtype=torch.float16)
    kmax = torch.ones_like(kmin)
    q = torch.ones(1, 2, 64)  # every middle block bounds at 64: all tie
    got = qs.quest_select_cpu(q, kmin, kmax, tables, lens, 1, 1, 5, block_size=BS, vector=vector)
    assert got[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 35]


@pytest.mark.parametrize("vector", PATHS)
def test_a_block_without_a_real_bound_is_never_picked(vector: bool) -> None:
    """A block no key was summarized into (kmin +inf, kmax -inf) bounds at NaN or -inf; a NaN summary
    gives NaN: neither is chosen, even when the budget has room for them."""
    tables, lens = _layout([12 * BS], 20, seed=2)
    kmin, kmax = _summaries(1, 20, 64, seed=2)
    empty, poisoned = int(tables[0, 3]), int(tables[0, 6])
    kmin[0, empty], kmax[0, empty] = torch.inf, -torch.inf
    kmax[0, poisoned, 5] = torch.nan
    q = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(2))
    got = qs.quest_select_cpu(q, kmin, kmax, tables, lens, 1, 1, 10, block_size=BS, vector=vector)
    kept = [p for p in got[0, 0].tolist() if p >= 0]
    assert 3 not in kept and 6 not in kept
    assert kept == [p for p in range(12) if p not in (3, 6)]


def test_retrieval_heads_keep_every_block_of_their_context() -> None:
    kv_heads, num_blocks = 3, 100
    tables, lens = _layout(LENS, num_blocks, seed=5)
    kmin, kmax = _summaries(kv_heads, num_blocks, 64, seed=5)
    q = torch.randn(len(LENS), kv_heads * 3, 64, generator=torch.Generator().manual_seed(5))
    every = torch.tensor([False, True, False])
    args = (q, kmin, kmax, tables, lens, 1, 2, 4)
    got = qs.quest_select_cpu(*args, block_size=BS, every=every)
    want = quest_select_reference(*args, block_size=BS)
    width = tables.shape[1]  # wider than 1 + 4 + 2
    assert got.shape == (len(LENS), kv_heads, width)
    for r, n in enumerate(LENS):
        nblk = -(-n // BS)
        assert got[r, 1].tolist() == list(range(nblk)) + [-1] * (width - nblk)
        for h in (0, 2):  # the others as without: the reference's positions, padded with -1
            assert got[r, h, :7].tolist() == want[r, h].tolist() and bool((got[r, h, 7:] == -1).all())
    # with no head marked, the width stays the selection's
    none = torch.zeros(kv_heads, dtype=torch.bool)
    assert torch.equal(qs.quest_select_cpu(*args, block_size=BS, every=none), want)


def test_bad_input_is_refused_with_the_reason() -> None:
    tables, lens = _layout([12 * BS], 20, seed=3)
    kmin, kmax = _summaries(2, 20, 64, seed=3)
    q = torch.randn(1, 6, 64)
    with pytest.raises(ValueError, match="top_k"):
        qs.quest_select_cpu(q, kmin, kmax, tables, lens, 1, 1, -1, block_size=BS)
    with pytest.raises(ValueError, match="query heads"):
        qs.quest_select_cpu(torch.randn(1, 5, 64), kmin, kmax, tables, lens, 1, 1, 2, block_size=BS)
    with pytest.raises(ValueError, match="every"):
        qs.quest_select_cpu(q, kmin, kmax, tables, lens, 1, 1, 2, block_size=BS, every=torch.ones(3).bool())
    bad = tables.clone()
    bad[0, 4] = 20  # past the 20 blocks summarized: refused before anything is read
    with pytest.raises(ValueError, match="outside"):
        qs.quest_select_cpu(q, kmin, kmax, bad, lens, 1, 1, 2, block_size=BS, check=False)
