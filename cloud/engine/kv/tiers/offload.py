"""Tiers below the device pool: reusable prefix blocks that leave the pool are kept, by block hash, in
host RAM and on disk, and come back on a hit instead of being prefilled again (SGLang's HiCache and
LMCache do this; here it is one engine's own).

- Demotion: when the pool evicts a cached block to reuse it (block_pool.py), its record (kv/tiers/
  records.py) goes to the host tier; what the host tier pushes out goes to disk unless it is there.
- Write-through: with a disk tier, every block entering the prefix cache is queued for disk once its
  step is done, so a restart finds every document the engine had prefilled (a disk tier only fed by
  evictions would lose the pool's and host tier's blocks with the process).
- Promotion: a prefix lookup (kv/manager.py) goes on past the pool's last hit through the host tier,
  then disk, block by block, and stops at the first block found nowhere. Found blocks get fresh pool
  blocks and enter the prefix cache at once, so the request takes them as ordinary hits
  (`cached_tokens` counts them); their bytes are copied in at the start of the next step, before its
  forward and after the step's prune copies (kv/prune.py reads blocks the scheduler has already
  freed, which a promotion may have taken). Until then a block's pending record stands for it: an
  eviction or a disk write of such a block takes the record, never the block's stale bytes.
- Prefetch: when a request is queued, the disk reads of its blocks that only disk holds start at
  once on reader threads (READERS of them), overlapped with the steps that run meanwhile; the lookup
  at its admission takes what they read (waiting for what is still being read). The copy into the
  pool is synchronous on the engine thread, between steps.

A hit never serves a block of another model, dtype or tenant: the block hash chains the tenant's
cache salt and every image's digest (shared/block_hash.py), and the disk tier's namespace digests the
model file, its RoPE scaling and weight plan, the run and KV dtypes and the record layout.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.tiers.codec import ColdCodec
from cloud.engine.kv.tiers.disk import DiskTier
from cloud.engine.kv.tiers.host import HostTier
from cloud.engine.kv.tiers.records import BlockRecords
from shared.block_hash import BlockHash
from shared.engine_types import TierStats

RECORD_VERSION = 1  # what a record is (records.py); a change makes every stored block a miss
READERS = 2  # threads reading disk blocks ahead of a request's admission
MAX_STAGED_BYTES = 1 << 30  # records read ahead and not yet taken; the oldest reads are let go past it


@dataclass(slots=True)
class _Counts:
    hits: int = 0  # blocks found here
    misses: int = 0  # blocks looked up here and not found
    promotions: int = 0  # blocks that went from here back to the device pool
    demotions: int = 0  # blocks put here
    load_s: float = 0.0  # reading and copying blocks back to the pool


class KVTiers:
    def __init__(
        self,
        records: BlockRecords,
        host_bytes: int,
        disk_dir: Path | None,
        disk_bytes: int,
        namespace: bytes,
        pool: BlockPool,
        codec: ColdCodec | None = None,
    ) -> None:
        self.records = records
        self.pool = pool
        rb = records.record_bytes
        self.host = HostTier(host_bytes, rb) if host_bytes > 0 else None
        self.disk = DiskTier(disk_dir, namespace, disk_bytes, rb, codec) if disk_dir is not None else None
        self._counts = {"host": _Counts(), "disk": _Counts()}
        self._fresh: list[tuple[BlockHash, int]] = []  # entered the prefix cache since the last flush
        self._pending: dict[int, torch.Tensor] = {}  # pool block -> the record to copy in (next step)
        # disk reads ahead of admission: block hash -> the read's future, oldest first
        self._staged: OrderedDict[BlockHash, Future[torch.Tensor | None]] = OrderedDict()
        self._max_staged = max(1, MAX_STAGED_BYTES // rb)
        self._readers = (
            ThreadPoolExecutor(READERS, thread_name_prefix="kv-disk-read") if self.disk is not None else None
        )

    # -- the pool's hooks -----------------------------------------------------------------------

    def stored(self, block_hash: BlockHash, block_id: int) -> None:
        """A block entered the prefix cache (its KV is written by the step that computed it)."""
        if self.disk is not None:
            self._fresh.append((block_hash, block_id))

    def evicting(self, blocks: list[tuple[BlockHash, int]]) -> None:
        """Cached blocks are about to be reused for other tokens; their KV is still intact."""
        self.write_through()
        if self.host is not None:
            going = blocks
        elif self.disk is not None:
            going = [(h, b) for h, b in blocks if h not in self.disk]
        else:
            return
        for block_hash, record in self._records(going):
            self._demote(block_hash, record)
        for _, b in blocks:  # reused: a load still pending for it would overwrite its new owner's KV
            self._pending.pop(b, None)

    def _demote(self, block_hash: BlockHash, record: torch.Tensor) -> None:
        if self.host is not None:
            self._counts["host"].demotions += 1
            for pushed_hash, pushed in self.host.put(block_hash, record):
                self._to_disk(pushed_hash, pushed)
        else:
            self._to_disk(block_hash, record)

    def _to_disk(self, block_hash: BlockHash, record: torch.Tensor) -> None:
        if self.disk is not None and block_hash not in self.disk:
            self._counts["disk"].demotions += 1
            self.disk.put(block_hash, record)

    def write_through(self) -> None:
        """Queue the blocks that entered the prefix cache since the last call for disk (call it after
        the step that wrote them); a block reused since is skipped."""
        fresh, self._fresh = self._fresh, []
        if self.disk is None or not fresh:
            return
        blocks = self.pool.blocks
        fresh = [(h, b) for h, b in fresh if blocks[b].block_hash == h and h not in self.disk]
        for block_hash, record in self._records(fresh):
            self.disk.put(block_hash, record)

    def _records(self, blocks: list[tuple[BlockHash, int]]) -> list[tuple[BlockHash, torch.Tensor]]:
        """The blocks' records, each in its own storage: a pending one's record, the others exported
        in one batch (and each row copied out of the batch's buffer)."""
        pending = [(h, self._pending[b]) for h, b in blocks if b in self._pending]
        rest = [(h, b) for h, b in blocks if b not in self._pending]
        if not rest:
            return pending
        rows = self.records.export([b for _, b in rest])
        return pending + [(h, row.clone()) for (h, _), row in zip(rest, rows, strict=True)]

    # -- promotion ----------------------------------------------------------------------------

    def prefetch(self, hashes: list[BlockHash]) -> None:
        """Start reading, off the engine thread, the blocks of a queued request's prefix that only the
        disk tier holds (`hashes`: its blocks past the pool's hits, in order; reading stops at the
        first block no tier holds)."""
        if self._readers is None or self.disk is None:
            return
        for h in hashes:
            if h in self._staged or (self.host is not None and h in self.host):
                continue
            if h not in self.disk:
                return
            while len(self._staged) >= self._max_staged:  # reads nobody took (aborted requests) go
                self._staged.popitem(last=False)[1].cancel()
            self._staged[h] = self._readers.submit(self.disk.get, h)

    def fetch(self, block_hash: BlockHash) -> torch.Tensor | None:
        """A block's record from the highest tier holding it (it leaves the host tier; a disk copy
        stays), or None when no tier has it."""
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            c = self._counts[name]
            t0 = time.perf_counter()
            if isinstance(tier, HostTier):
                record = tier.take(block_hash)
            elif (staged := self._staged.pop(block_hash, None)) is not None:
                record = staged.result()  # read ahead (or still being read: wait for it)
            else:
                record = tier.get(block_hash)
            c.load_s += time.perf_counter() - t0
            if record is None:
                c.misses += 1
                continue
            c.hits += 1
            c.promotions += 1
            return record
        return None

    def promote(self, block_ids: list[int], records: list[torch.Tensor]) -> None:
        """Fetched records for fresh pool blocks: copied in by apply_loads, at the next step's start."""
        self._pending.update(zip(block_ids, records, strict=True))

    def apply_loads(self) -> None:
        """Copy the promoted records into their blocks (one batched copy). Called by the runner at the
        start of a step, after its prune copies and before its forward. If the copy fails, the blocks'
        hashes leave the prefix cache (their bytes are not the KV their hashes name) and it raises."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        ids = list(pending)
        t0 = time.perf_counter()
        try:
            self.records.load(ids, torch.stack(list(pending.values())))
        except BaseException:
            self.pool.forget(ids)
            raise
        share = (time.perf_counter() - t0) / 2
        for c in self._counts.values():  # the copy is both tiers' cost; split it evenly
            c.load_s += share

    # -- reporting and shutdown -----------------------------------------------------------------

    def stats(self) -> tuple[TierStats, ...]:
        out = []
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            c = self._counts[name]
            disk = tier if isinstance(tier, DiskTier) else None
            out.append(
                TierStats(
                    tier=name,
                    blocks=len(tier),
                    bytes=tier.used_bytes,
                    capacity_bytes=tier.capacity_bytes,
                    hits=c.hits,
                    misses=c.misses,
                    promotions=c.promotions,
                    demotions=c.demotions,
                    load_seconds=c.load_s,
                    write_errors=0 if disk is None else disk.write_errors,
                    writes_dropped=0 if disk is None else disk.write_dropped,
                    corrupt=0 if disk is None else disk.corrupt,
                    dtype="" if disk is None or disk.codec is None else f"int{disk.codec.bits}",
                )
            )
        return tuple(out)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the disk writes in flight (so an engine started again finds them), then stop."""
        if self._readers is not None:
            self._readers.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.flush(timeout_s)
            self.disk.close()


def model_identity(path: Path) -> bytes:
    """A digest naming a model's files without reading them whole: each file's name, size and its
    first and last MiB (a GGUF's header and tensor index, a safetensors' header)."""
    h = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(2**20))
            if size > 2**20:
                fh.seek(max(2**20, size - 2**20))
                h.update(fh.read(2**20))
    return h.digest()


def tier_namespace(*parts: object) -> bytes:
    """The disk tier's namespace: a digest of everything that makes a stored record mean something."""
    h = hashlib.blake2b(digest_size=16)
    for p in (RECORD_VERSION, *parts):
        h.update(repr(p).encode() if not isinstance(p, bytes) else p)
        h.update(b"\0")
    return h.digest()
