"""KV tiers below the device pool (cloud/engine/kv/tiers): prefix blocks evicted from a tiny pool come
back from host RAM or disk as hits, bit for bit (greedy output unchanged), a restarted engine finds its
disk tier, and no hit crosses a tenant, a dtype or a model's RoPE; damaged files are never served.
Real model, real files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from cloud.engine.kv.tiers.codec import ColdCodec
from cloud.engine.kv.tiers.disk import DiskTier
from cloud.engine.kv.tiers.offload import KVTiers, model_identity
from cloud.engine.kv.tiers.records import BlockRecords
from gateway.ops.metrics import Metrics
from shared.block_hash import hash_block
from shared.engine_types import EngineStats, SamplingParams, TierStats, sum_tiers
from shared.errors import InvalidRequestError

# 17 blocks of 16 tokens: two ~120-token documents do not fit side by side with their outputs
TINY = EngineConfig(
    dtype="float32", weight_quant="none", kv_cache_memory_gib=0.012, max_model_len=256, max_num_seqs=2
)


def document(core: EngineCore, word: str) -> list[int]:
    return core.encode_chat([{"role": "user", "content": f"{word} " * 100 + "Which word is repeated?"}])


def answer(core: EngineCore, rid: str, ids: list[int], salt: str | None = None) -> tuple[list[int], int]:
    """Greedy tokens and cached_tokens of one request run alone."""
    core.add_request(rid, ids, SamplingParams(max_tokens=4, temperature=0.0, cache_salt=salt))
    tokens, cached = [], -1
    while core.has_work():
        for o in core.step():
            tokens += o.token_ids
            if o.finished:
                cached = o.num_cached_tokens
    return tokens, cached


def chain(ids: list[int], salt: bytes = b"") -> list[bytes]:
    """The block hashes of a prompt's full blocks, as the engine names them."""
    out: list[bytes] = []
    for i in range(len(ids) // 16):
        out.append(hash_block(out[-1] if out else None, ids[i * 16 : (i + 1) * 16], salt))
    return out


def tier(core: EngineCore, name: str) -> TierStats:
    return next(t for t in core.stats().kv_tiers if t.tier == name)


def evict(core: EngineCore) -> None:
    """Fill the pool with other documents, pushing earlier blocks out of it."""
    for w in ("river", "stone"):
        answer(core, f"evict-{w}", document(core, w))


def test_evicted_blocks_come_back_from_host_ram_as_hits_with_the_same_output(
    loaded_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(replace(TINY, kv_host_memory_gib=0.5), loaded_model)
    doc = document(core, "apple")
    cold = answer(core, "cold", doc)
    evict(core)
    assert core.pool.lookup(chain(doc)[-1]) is None  # the document's blocks left the pool
    tokens, cached = answer(core, "warm", doc)
    full_blocks = (len(doc) - 1) // 16
    assert tokens == cold[0]  # the same KV bytes: the same greedy answer
    assert cached == full_blocks * 16 and cold[1] == 0
    host = tier(core, "host")
    assert host.promotions > 0 and host.demotions >= host.promotions and host.bytes <= host.capacity_bytes
    assert core.stats().prefix_hit_tokens >= cached


def test_a_restarted_engine_finds_its_disk_tier_and_a_damaged_file_is_recomputed(
    loaded_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    config = replace(TINY, kv_offload_dir=str(tmp_path))
    first = EngineCore(config, loaded_model)
    doc = document(first, "apple")
    cold = answer(first, "cold", doc)
    first.close()  # the writes in flight land
    stored = {f.stem: f for f in tmp_path.rglob("*.kvb")}
    hashes = chain(doc)
    assert sorted(stored) == sorted(h.hex() for h in hashes)  # every full block, written through

    damaged = stored[hashes[3].hex()]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # a flipped byte in the fourth block's payload
    damaged.write_bytes(bytes(data))

    again = EngineCore(config, loaded_model)  # a new engine over the same directory
    tokens, cached = answer(again, "after-restart", doc)
    disk = tier(again, "disk")
    assert tokens == cold[0]
    assert cached == 3 * 16 and disk.hits == 3  # the chain is served up to the damaged block
    assert disk.corrupt == 1
    again.close()
    assert damaged.read_bytes() != bytes(data)  # recomputed and written again, whole


def test_no_hit_crosses_a_tenant_a_kv_dtype_or_a_rope_scaling(loaded_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = replace(TINY, kv_offload_dir=str(tmp_path))
    core = EngineCore(config, loaded_model)
    doc = document(core, "apple")
    answer(core, "t1", doc, salt="tenant-1")
    evict(core)
    _, cached = answer(core, "t2", doc, salt="tenant-2")
    assert cached == 0 and tier(core, "disk").hits == 0
    _, cached = answer(core, "t1-again", doc, salt="tenant-1")
    assert cached > 0 and tier(core, "disk").hits > 0  # its own tenant does hit
    core.close()
    for other in (
        replace(config, kv_dtype="int8"),
        replace(config, rope_scaling={"type": "linear", "factor": 2.0}),
        replace(config, kv_offload_dtype="int8"),  # the same blocks, stored another way
    ):
        engine = EngineCore(other, loaded_model)
        _, cached = answer(engine, "other", doc, salt="tenant-1")
        assert cached == 0 and tier(engine, "disk").hits == 0
        # what each stores, as /metrics' readers and the console show it
        assert engine.stats().kv_dtype == ("int8" if other.kv_dtype == "int8" else "float32")
        assert tier(engine, "disk").dtype == ("int8" if other.kv_offload_dtype == "int8" else "")
        engine.close()


def test_what_cannot_be_honoured_is_refused_at_start(loaded_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    blocked = tmp_path / "file"
    blocked.write_text("")
    for config, why in (
        (replace(TINY, kv_offload_dir=str(blocked / "kv")), "cannot be written"),
        (replace(TINY, kv_host_memory_gib=0.1, enable_prefix_caching=False), "prefix caching"),
        (replace(TINY, kv_offload_dir=str(tmp_path), kv_dtype="int8", kv_offload_dtype="int4"), "already"),
    ):
        with pytest.raises(InvalidRequestError, match=why):
            EngineCore(config, loaded_model)


def test_model_identity_tells_files_apart_by_content(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(3 * 2**20))
    b.write_bytes(b"GGUF" + bytes(3 * 2**20 - 1) + b"\1")  # same size, another tail
    assert model_identity(a) != model_identity(b) and model_identity(a) == model_identity(a)


@pytest.mark.parametrize("kind", ["full", "full, key summaries by half block", "int4"])
def test_a_record_restores_every_part_of_a_block(kind: str) -> None:
    torch.manual_seed(0)
    if kind.startswith("full"):
        halves = 2 if "half" in kind else 1  # --sparse-score-block: [kv_heads, blocks, 2, d] summaries
        cache: KVCache | QuantizedKVCache = KVCache(
            2, 6, 4, 2, 8, torch.float32, track_summaries=True, summary_parts=halves
        )
    else:
        cache = QuantizedKVCache(2, 6, 4, 2, 8, torch.float32, 4, lambda b: True, staging_slots=2)
    parts = cache.block_parts()
    for p in parts:
        p.copy_(torch.randn(p.shape).to(p.dtype) if p.is_floating_point() else torch.randint_like(p, 256))
    before = [p.clone() for p in parts]
    records = BlockRecords(parts)
    rows = records.export([4, 1])
    for p in parts:
        p.zero_()
    records.load([2, 5], rows)  # block 4's record into block 2, block 1's into 5
    for p, was in zip(parts, before, strict=True):
        assert torch.equal(p[:, 2], was[:, 4]) and torch.equal(p[:, 5], was[:, 1])
        assert not p[:, [0, 1, 3, 4]].any()


def test_the_disk_tier_stays_within_its_bound_and_drops_torn_files_at_start(tmp_path: Path) -> None:
    ns = bytes(16)
    disk = DiskTier(tmp_path, ns, capacity_bytes=3 * (64 + 100), record_bytes=100)
    for i in range(5):
        disk.put(bytes([i]) * 16, torch.full((100,), i, dtype=torch.uint8))
    assert disk.flush()
    assert len(disk) == 3 and disk.used_bytes <= disk.capacity_bytes
    assert disk.get(bytes([0]) * 16) is None  # the least recently used went first
    kept = disk.get(bytes([4]) * 16)
    assert kept is not None and torch.equal(kept, torch.full((100,), 4, dtype=torch.uint8))
    disk.close()
    torn = disk.path(bytes([3]) * 16)
    torn.write_bytes(torn.read_bytes()[:50])  # a write cut short by a power cut
    (torn.parent / "x.tmp").write_bytes(b"half")  # a temporary left behind
    again = DiskTier(tmp_path, ns, capacity_bytes=10**6, record_bytes=100)
    assert bytes([3]) * 16 not in again and not torn.exists() and not (torn.parent / "x.tmp").exists()
    assert again.get(bytes([4]) * 16) is not None
    again.close()


@pytest.mark.parametrize("bits", [8, 4])
def test_cold_blocks_decode_within_half_a_code_step_and_keep_their_summaries(bits: int) -> None:
    torch.manual_seed(1)
    layers, heads, bs, d = 2, 3, 16, 8
    cache = KVCache(layers, 4, bs, heads, d, torch.float32, track_summaries=True)
    for p in cache.block_parts():
        p.copy_(torch.randn(p.shape) * 3)
    records = BlockRecords(cache.block_parts())
    rows = records.export([0, 3])
    tail = 2 * 2 * layers * heads * d
    codec = ColdCodec(layers, heads, bs, d, torch.float32, bits, tail)
    cold = codec.encode(rows)
    assert cold.shape == (2, codec.cold_bytes)
    assert codec.cold_bytes - tail <= (rows.shape[1] - tail) * bits / 32 * 2  # codes, and scales at d=8
    back = codec.decode(cold)
    assert back.shape == rows.shape
    assert torch.equal(back[:, -tail:], rows[:, -tail:])  # the key summaries, as they were
    full = rows[:, :-tail].contiguous().view(torch.float32).view(2, layers, 2, heads, bs, d)
    got = back[:, :-tail].contiguous().view(torch.float32).view(2, layers, 2, heads, bs, d)
    k, v = full[:, :, 0], full[:, :, 1]
    levels = (1 << bits) - 1
    kstep = (k.amax(3, keepdim=True) - k.amin(3, keepdim=True)) / levels  # per channel in the block
    vstep = (v.amax(4, keepdim=True) - v.amin(4, keepdim=True)) / levels  # per token
    slack = 1e-2  # fp16 rounding of the scales and zero points
    assert ((got[:, :, 0] - k).abs() <= kstep / 2 + slack * kstep + 1e-3).all()
    assert ((got[:, :, 1] - v).abs() <= vstep / 2 + slack * vstep + 1e-3).all()


def test_each_tier_is_reported_in_the_metrics_and_summed_over_engines() -> None:
    host = TierStats("host", 3, 300, 1000, hits=5, misses=2, promotions=5, demotions=8, load_seconds=0.5)
    disk = TierStats("disk", 9, 900, 9000, 4, 1, 4, 9, 1.5, write_errors=2, writes_dropped=0, corrupt=1)
    stats = EngineStats(0, 0, 10, 10, 0.0, 1.0, 0, 0, kv_tiers=sum_tiers([host, disk, disk]))
    text = Metrics(lambda: stats).render().decode()
    assert 'ctxfuse_kv_tier_hits_total{tier="host"} 5.0' in text
    assert 'ctxfuse_kv_tier_hits_total{tier="disk"} 8.0' in text  # two engines' disks
    assert 'ctxfuse_kv_tier_corrupt_blocks_total{tier="disk"} 2.0' in text
    assert 'ctxfuse_kv_tier_bytes{tier="disk"} 1800.0' in text


def test_a_block_whose_bytes_are_not_copied_in_yet_is_demoted_as_its_pending_record(tmp_path: Path) -> None:
    """A promoted block waits for the next step to get its bytes; if it is evicted (or written to
    disk) before, its pending record goes, never the stale bytes the block still holds."""
    cache = KVCache(1, 3, 4, 1, 2, torch.float32)
    pool = BlockPool(3)
    records = BlockRecords(cache.block_parts())
    tiers = KVTiers(records, 1 << 20, tmp_path, 1 << 20, bytes(16), pool)
    pool.tiers = tiers
    wanted = torch.arange(records.record_bytes, dtype=torch.uint8)
    (bid,) = pool.allocate(1) or []
    tiers.promote([bid], [wanted])
    pool.cache(bid, b"h" * 16)
    pool.free([bid])
    pool.allocate(3)  # every block, the promoted one among them, before any step copied it in
    assert tiers.host is not None and torch.equal(tiers.host.take(b"h" * 16), wanted)
    tiers.apply_loads()  # nothing left pending: the block is another request's now
    assert not cache.k[0].any()
    tiers.close()
