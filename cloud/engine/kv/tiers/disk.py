"""The disk tier (`--kv-offload-dir`): KV blocks in files that outlive the process, bounded in bytes
(`--kv-offload-disk`), least recently used first out.

- What a file holds is the block's record (records.py), or its cold encoding (codec.py, with
  `--kv-offload-dtype int8|int4`), which the writer thread makes and a read decodes.
- One file per block: `<dir>/<namespace>/<hh>/<block hash>.kvb`. The namespace is a digest of what
  makes a record mean something (the model file, its RoPE and weight plan, the run and KV dtypes,
  the block size and layout, the block hash scheme: tiers/offload.py), so another model's or
  dtype's blocks are never found, and an engine started again on the same model finds its own.
- A file is a header (magic, namespace, block hash, length, CRC-32 of the payload) and the record.
  It is written to a temporary name and renamed into place, so a reader never sees a half-written
  file under a block's name; a file torn by a power cut or flipped on disk fails the header or the
  CRC when read, is deleted and counts as a miss: a damaged block is recomputed, never served.
- Writes happen on a writer thread so the engine never waits for the disk; a block waiting to be
  written is served from memory meanwhile. When the queue holds more than `MAX_QUEUED_BYTES`, new
  writes are dropped (counted): the disk is a cache, nothing is lost but a future hit.
- A failed write (disk full, permissions) is logged once per kind of error and counted; the tier
  keeps serving what it holds and writes again when it can.
- Recency survives a restart through the files' modification times (a hit touches its file).
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import structlog
import torch

from cloud.engine.kv.tiers.codec import ColdCodec
from shared.block_hash import BlockHash

log = structlog.get_logger("ctxfuse.engine")

MAGIC = b"CFKVB1\0\0"
_HEADER = struct.Struct("<8s16s16sQI")  # magic, namespace, block hash, payload bytes, crc32
MAX_QUEUED_BYTES = 256 * 2**20  # writes waiting for the writer thread beyond this are dropped
SUFFIX = ".kvb"


class DiskTier:
    def __init__(
        self,
        root: Path,
        namespace: bytes,
        capacity_bytes: int,
        record_bytes: int,
        codec: ColdCodec | None = None,
    ) -> None:
        if len(namespace) != 16:
            raise ValueError("a disk tier's namespace is a 16-byte digest")
        self.namespace = namespace
        self.dir = root / namespace.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.record_bytes = record_bytes
        self.codec = codec
        self.stored_bytes = record_bytes if codec is None else codec.cold_bytes
        self.file_bytes = _HEADER.size + self.stored_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, None] = OrderedDict()  # on disk, oldest use first
        self._pending: dict[BlockHash, torch.Tensor] = {}  # queued for the writer
        self._queued_bytes = 0
        self._queue: queue.Queue[BlockHash | None] = queue.Queue()
        self.writes = self.write_dropped = self.write_errors = self.corrupt = 0
        self._errors_logged: set[str] = set()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # -- what it holds ------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the files an earlier run left, oldest use first; half-written temporaries go."""
        found = []
        for sub in self.dir.iterdir() if self.dir.is_dir() else []:
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.suffix != SUFFIX:
                    f.unlink(missing_ok=True)  # a temporary a crash left
                    continue
                try:
                    block_hash = bytes.fromhex(f.stem)
                    st = f.stat()
                except (ValueError, OSError):
                    f.unlink(missing_ok=True)
                    continue
                if st.st_size != self.file_bytes or len(block_hash) != 16:
                    f.unlink(missing_ok=True)  # another layout's or torn: never read
                    continue
                found.append((st.st_mtime_ns, block_hash))
        for _, block_hash in sorted(found):
            self._index[block_hash] = None
        self._trim()

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return len(self._index) * self.file_bytes

    @property
    def max_blocks(self) -> int:
        return self.capacity_bytes // self.file_bytes

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    # -- writing ------------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, record: torch.Tensor) -> None:
        """Queue a block for writing (a no-op when it is held or queued already)."""
        if self.max_blocks < 1:
            return
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return
            if self._queued_bytes + self.record_bytes > MAX_QUEUED_BYTES:
                self.write_dropped += 1
                return
            self._pending[block_hash] = record
            self._queued_bytes += self.record_bytes
        self._queue.put(block_hash)

    def _write_loop(self) -> None:
        while (block_hash := self._queue.get()) is not None:
            with self._lock:
                record = self._pending.get(block_hash)
            if record is not None:
                self._write(block_hash, record)
            with self._lock:
                if self._pending.pop(block_hash, None) is not None:
                    self._queued_bytes -= self.record_bytes

    def _write(self, block_hash: BlockHash, record: torch.Tensor) -> None:
        stored = record if self.codec is None else self.codec.encode(record.unsqueeze(0))[0]
        payload = stored.numpy().tobytes()
        header = _HEADER.pack(MAGIC, self.namespace, block_hash, len(payload), zlib.crc32(payload))
        path = self.path(block_hash)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            kind = type(exc).__name__ + (f" errno {exc.errno}" if exc.errno else "")
            if kind not in self._errors_logged:  # once per kind: a full disk fails every write
                self._errors_logged.add(kind)
                log.warning("kv_disk_write_failed", dir=str(self.dir), error=f"{kind}: {exc.strerror or exc}")
            return
        self.writes += 1
        with self._lock:
            self._index[block_hash] = None
            self._index.move_to_end(block_hash)
        self._trim()

    def _trim(self) -> None:
        """Delete the least recently used files beyond the capacity."""
        while True:
            with self._lock:
                if len(self._index) <= self.max_blocks:
                    return
                block_hash, _ = self._index.popitem(last=False)
            self.path(block_hash).unlink(missing_ok=True)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued write is done (or timeout_s passed); True when none is left."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=10)

    # -- reading ------------------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block's record (it stays on disk), or None: not held, or damaged (then deleted)."""
        with self._lock:
            queued = self._pending.get(block_hash)
            if queued is not None:
                return queued
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read(self.file_bytes + 1)
            os.utime(path)  # its recency, for an engine that starts over this directory
        except OSError:
            self._forget(block_hash)
            return None
        if not self._valid(raw, block_hash):
            self.corrupt += 1
            log.warning("kv_disk_block_damaged", path=str(path), action="deleted; the block is recomputed")
            self._forget(block_hash)
            path.unlink(missing_ok=True)
            return None
        stored = torch.frombuffer(bytearray(raw[_HEADER.size :]), dtype=torch.uint8)
        return stored if self.codec is None else self.codec.decode(stored.unsqueeze(0))[0]

    def _valid(self, raw: bytes, block_hash: BlockHash) -> bool:
        if len(raw) != self.file_bytes:
            return False
        magic, namespace, stored_hash, n, crc = _HEADER.unpack_from(raw)
        return (
            magic == MAGIC
            and namespace == self.namespace
            and stored_hash == block_hash
            and n == self.stored_bytes
            and zlib.crc32(memoryview(raw)[_HEADER.size :]) == crc
        )

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._index.pop(block_hash, None)
