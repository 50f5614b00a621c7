"""The KV caches as stores: key summaries follow blocks as they fill, are freed and reused; the
quantized cache keeps partly filled blocks exact and quantizes a block once it is complete."""

from __future__ import annotations

import torch

from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.quantized_cache import QuantizedKVCache

BS, HEADS, DIM = 4, 2, 8


def _write(cache: KVCache | QuantizedKVCache, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    mapping = torch.tensor(slots, dtype=torch.long)
    cache.begin_step(mapping)
    cache.write(0, k, v, mapping)


def _rand(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HEADS, DIM, generator=torch.Generator().manual_seed(seed))


def test_summaries_follow_a_block_as_it_fills_and_restart_when_it_is_reused() -> None:
    cache = KVCache(1, 4, BS, HEADS, DIM, torch.float32, track_summaries=True)
    block = 2
    toks = _rand(BS, 0)
    for i in range(BS):  # one decode token at a time into block 2
        _write(cache, [block * BS + i], toks[i : i + 1], toks[i : i + 1])
        kmin, kmax = cache.key_bounds(0)
        seen = toks[: i + 1].transpose(0, 1)  # [heads, i + 1, dim]
        torch.testing.assert_close(kmin[:, block].float(), seen.amin(1).half().float())
        torch.testing.assert_close(kmax[:, block].float(), seen.amax(1).half().float())
    # freed and handed to another request: its first write starts the summary over
    fresh = _rand(2, 1) * 0.01
    _write(cache, [block * BS, block * BS + 1], fresh, fresh)
    kmin, kmax = cache.key_bounds(0)
    torch.testing.assert_close(kmin[:, block].float(), fresh.transpose(0, 1).amin(1).half().float())
    torch.testing.assert_close(kmax[:, block].float(), fresh.transpose(0, 1).amax(1).half().float())
    assert bool((kmin[:, 0] == torch.inf).all())  # untouched blocks stay empty


def test_gather_per_head_takes_each_heads_own_blocks() -> None:
    cache = KVCache(1, 4, BS, HEADS, DIM, torch.float32)
    k = _rand(16, 2)
    _write(cache, list(range(16)), k, -k)
    blocks = torch.tensor([[3, 0], [1, 2]])  # head 0 reads blocks 3, 0; head 1 reads 1, 2
    kh, vh = cache.gather_per_head(0, blocks)
    for h in range(HEADS):
        ks, _ = cache.gather(0, blocks[h])
        torch.testing.assert_close(kh[h], ks[h])
    torch.testing.assert_close(vh, -kh)


def _pair(bits: int) -> tuple[KVCache, QuantizedKVCache, set[int]]:
    free: set[int] = set()
    ref = KVCache(1, 6, BS, HEADS, DIM, torch.float32)
    q = QuantizedKVCache(1, 6, BS, HEADS, DIM, torch.float32, bits, free.__contains__, staging_slots=1)
    return ref, q, free


def test_quantized_cache_keeps_the_filling_block_exact_and_quantizes_complete_ones() -> None:
    ref, q, _ = _pair(8)
    table = [4, 1, 3]  # a request's blocks, not side by side
    slots = [table[p // BS] * BS + p % BS for p in range(10)]
    k, v = _rand(10, 3), _rand(10, 4)
    for cache in (ref, q):
        _write(cache, slots, k, v)  # a 10-token prefill: blocks 4 and 1 complete, 3 holds two tokens
    blocks = torch.tensor(table)
    (kr, vr), (kq, vq) = ref.gather(0, blocks), q.gather(0, blocks)
    assert torch.equal(kq[:, 8:10], kr[:, 8:10]) and torch.equal(vq[:, 8:10], vr[:, 8:10])  # staged: exact
    assert not torch.equal(kq[:, :8], kr[:, :8])  # quantized
    torch.testing.assert_close(kq[:, :8], kr[:, :8], atol=0.03, rtol=0)
    torch.testing.assert_close(vq[:, :8], vr[:, :8], atol=0.03, rtol=0)
    # decode two more tokens: block 3 completes and leaves staging
    for i, p in enumerate((10, 11)):
        kd, vd = _rand(1, 10 + i), _rand(1, 20 + i)
        for cache in (ref, q):
            _write(cache, [table[p // BS] * BS + p % BS], kd, vd)
    assert int(q.stage_of[3]) == -1 and len(q._free_slots) == q.num_staging_slots
    (kr, _), (kq, _) = ref.gather(0, blocks), q.gather(0, blocks)
    torch.testing.assert_close(kq, kr, atol=0.03, rtol=0)
    kh, _ = q.gather_per_head(0, torch.tensor([[3, 4], [1, 3]]))
    torch.testing.assert_close(kh[1, :BS], kq[1, BS : 2 * BS])


def test_int4_cache_is_coarser_than_int8_but_within_its_bound() -> None:
    errs = []
    for bits in (8, 4):
        ref, q, _ = _pair(bits)
        k = _rand(24, 5)
        for cache in (ref, q):
            _write(cache, list(range(24)), k, k)
        blocks = torch.arange(6)
        errs.append(float((q.gather(0, blocks)[0] - ref.gather(0, blocks)[0]).abs().max()))
    assert errs[0] < errs[1] < 0.5


def test_staging_of_a_block_freed_while_filling_is_collected_and_grows_when_needed() -> None:
    _, q, free = _pair(4)
    one = _rand(1, 6)
    _write(q, [0 * BS], one, one)  # request A starts block 0 and takes the only staging slot
    free.add(0)  # A ends while block 0 is partly filled
    _write(q, [2 * BS], one, one)  # B needs a slot: A's is collected, nothing grows
    assert q.num_staging_slots == 1 and int(q.stage_of[0]) == -1 and int(q.stage_of[2]) >= 0
    _write(q, [5 * BS], one, one)  # C while B still fills block 2: the area grows
    assert q.num_staging_slots == 2 and int(q.stage_of[2]) != int(q.stage_of[5])
