"""The batch runner: one task per gateway process that takes batches oldest first and drives up to
`max_running` of them side by side through their states, running each one's requests through the
engine at low priority, a few at a time.

    validating --(input file ok)--> in_progress --(all requests have results)--> finalizing --> completed
        `--(bad lines)--> failed        |-- cancel --> cancelling --(in-flight aborted)--> cancelled
                                        `-- past expires_at --> expired (unrun requests: batch_expired)

Every step is read from and written to the store, so a new process resumes where the last one
stopped: a request is run until its result is stored, and a stored result is never run again. Every
store call runs off the event loop. A batch is isolated from the others: an unexpected error on it is
retried (RETRY_S apart) and after ATTEMPTS in a row in one process the batch is failed with the
reason, its results so far in its files, while the other batches go on. A write its disk refuses (a
StorageFault: full, read-only) pauses it instead: it keeps its status, shows the reason in `errors`
(shown()), and is tried again every STORAGE_RETRY_S until the write works: never failed for it,
never completed short. Every SWEEP_S (and at start) the runner deletes expired files, which the store
hides from the second they expire. The database is opened on first use (a route, or at start when it
already exists), so a gateway that never serves a batch writes nothing.

One runner per data dir: opening the database first takes the dir's lock (shared/dir_lock.py), so a
second process over the same dir refuses to start (DirInUse, when the database exists at start) or
answers batch routes with a 503 naming the owner (when both started before it existed); it never
runs a batch the first one runs. The lock is taken with the database rather than at start so that
gateways which never serve a batch (most test gateways share the default dir) never contend.

Replicas over one Redis (`--redis-url`): the store is Redis's (batch/store_redis.py), there is no dir
lock, and every replica's runner polls for active batches every POLL_S (a wake() is this process's
only). A runner drives a batch only while it holds the batch's lease (batch/lease.py, which states
what "no request runs twice" holds): it renews the lease every ttl/3, starts no request of the batch
once a renewal fails, and lets go when the batch is done. While Redis is down, store calls raise
SharedStateDown: a batch waits (RETRY_S apart), it is never failed for it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from gateway.batch import steps
from gateway.batch.executor import BATCH_PRIORITY, Answer, Executor
from gateway.batch.input import BatchItem
from gateway.batch.lease import HeldLease, Leases, LocalLeases, RedisLeases
from gateway.batch.store import ACTIVE, BatchStore
from gateway.batch.store_api import Store
from gateway.batch.store_redis import RedisBatchStore
from gateway.encoding import encode
from gateway.errors import ServiceUnavailableError
from gateway.shared_state.redis_link import RedisLink, SharedStateDown
from shared.batch_protocol import Batch
from shared.dir_lock import DirInUse, DirLock, HeldBy, lock_dir
from shared.errors import CtxfuseError, QueueFullError
from shared.storage_faults import StorageFault

log = structlog.get_logger("ctxfuse.gateway")

RETRY_S = 1.0  # wait before retrying work that could not be taken (queue full, no engine or backend)
MAX_RUNNING = 4  # batches run side by side (GatewayConfig.max_running_batches)
ATTEMPTS = 3  # unexpected errors in a row on one batch before it is failed
STORAGE_RETRY_S = 5.0  # between tries of a batch whose disk refused a write (full, read-only)
SWEEP_S = 60.0  # between deletions of expired files (they are hidden from their expiry on anyway)
POLL_S = 1.0  # with Redis: between looks for batches made (or left by a dead replica) elsewhere
_LOOK_AHEAD = 256  # active batches looked at per pass for one whose lease is free


class BatchRunner:
    def __init__(
        self,
        execute: Executor,
        path: Path,
        concurrency: int = 4,
        priority: int = BATCH_PRIORITY,
        clock: Callable[[], float] = time.time,
        max_running: int = MAX_RUNNING,
        file_ttl_s: int | None = None,
        redis: RedisLink | None = None,
        lease_s: float | None = None,
        min_free_bytes: int = 0,
        storage_retry_s: float | None = None,
    ):
        """`path`: the SQLite database (unused with `redis`, the store every replica shares);
        `lease_s`: with Redis, how long a batch stays leased to a replica that stopped renewing (None:
        batch/lease.py's default); `min_free_bytes`: the free space uploads leave on the database's disk
        (batch/files.py); `storage_retry_s`: between tries of a batch paused by its disk."""
        if max_running < 1 or concurrency < 1:
            raise ValueError(f"max_running and concurrency must be >= 1, got {max_running} and {concurrency}")
        self.execute = execute  # the in-process engine's (batch/executor.py) or the fleet's
        self.path = path
        self.concurrency = concurrency  # requests of one batch in flight
        self.max_running = max_running  # batches in progress at once
        self.priority = priority
        self.clock = clock  # seconds since the epoch; decides when a batch, or a file, has expired
        self.file_ttl_s = file_ttl_s  # lifetime of a file made without one (None: until deleted)
        self.redis = redis
        self.leases: Leases = LocalLeases() if redis is None else RedisLeases(redis, lease_s)
        self.min_free_bytes = min_free_bytes
        self.storage_retry_s = STORAGE_RETRY_S if storage_retry_s is None else storage_retry_s
        # batches whose disk refused their last write, with the fault: shown on the batch as its
        # reason until a step of it works again
        self.paused: dict[str, StorageFault] = {}
        self._store: Store | None = None
        self._dir_lock: DirLock | None = None
        self._task: asyncio.Task[None] | None = None
        # one event per waiter (the loop, each running batch): a waiter clears only its own, so no
        # waiter can swallow a wake meant for another
        self._wake = asyncio.Event()
        self._waiters: set[asyncio.Event] = {self._wake}
        self._given_up: set[str] = set()  # failed but could not be marked so: left until the next start
        self._started = False

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = self._open()
        if self._started and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batch-runner")
        return self._store

    def _open(self) -> Store:
        # the store asks the runner's clock each time, so one clock decides every expiry
        if self.redis is not None:
            return RedisBatchStore(self.redis, lambda: self.clock(), self.file_ttl_s)
        lock = lock_dir(self.path.parent, "ctxfuse gateway batch runner")
        if isinstance(lock, HeldBy):
            raise DirInUse(lock, "gateway data dir (--data-dir)")
        self._dir_lock = lock
        return BatchStore(self.path, lambda: self.clock(), self.file_ttl_s, self.min_free_bytes)

    async def start(self) -> None:
        self._started = True
        if self.redis is not None or self.path.exists():
            _ = self.store  # unfinished batches of an earlier process resume now

    async def stop(self) -> None:
        """Abort what runs (its results are not stored, so it runs again on the next start)."""
        self._started = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None

    def shown(self, batch: Batch) -> Batch:
        """The batch as a client sees it: a paused one carries the reason in `errors`."""
        fault = self.paused.get(batch.id)
        return batch if fault is None or batch.status not in ACTIVE else steps.paused(batch, fault)

    def wake(self) -> None:
        """New work, or a cancel: look at the store again."""
        for event in self._waiters:
            event.set()

    async def _loop(self) -> None:
        running: dict[str, asyncio.Task[None]] = {}
        next_sweep = 0.0  # (monotonic) at once: files may have expired while no process ran
        try:
            while True:
                self._wake.clear()  # before the look: a batch stored after it still wakes the wait
                if time.monotonic() >= next_sweep:
                    await self.sweep()
                    next_sweep = time.monotonic() + SWEEP_S
                await self._take(running)
                waker = asyncio.create_task(self._wake.wait())
                await asyncio.wait(
                    {*running.values(), waker}, timeout=self._poll_s(), return_when=asyncio.FIRST_COMPLETED
                )
                waker.cancel()
                for batch_id in [i for i, t in running.items() if t.done()]:
                    running.pop(batch_id).result()  # _drive raises nothing but a cancel
        finally:
            for t in running.values():
                t.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)

    def _poll_s(self) -> float:
        """Alone over a data dir, wakes say when there is work; replicas also look every POLL_S."""
        return SWEEP_S if self.redis is None else POLL_S

    async def sweep(self) -> int:
        """Delete the expired files (the disk is freed); how many went. A failure is logged and left
        to the next sweep: expired files stay hidden meanwhile."""
        try:
            gone = await asyncio.to_thread(self.store.sweep)
        except Exception:
            log.exception("batch_runner_sweep_error")
            return 0
        if gone:
            log.info("expired_files_deleted", count=gone)
        return gone

    async def _take(self, running: dict[str, asyncio.Task[None]]) -> None:
        """Start driving the oldest active batches whose lease this runner gets, up to max_running."""
        free = self.max_running - len(running)
        if free <= 0:
            return
        skip = frozenset(running) | self._given_up
        try:
            ids = await asyncio.to_thread(self.store.active_ids, _LOOK_AHEAD, skip)
        except Exception as exc:
            if isinstance(exc, SharedStateDown):  # no traceback: it says what is down
                log.warning("batch_runner_store_down", error=str(exc))
            else:
                log.exception("batch_runner_store_error")
            await asyncio.sleep(RETRY_S)
            self._wake.set()  # look again
            return
        for batch_id in ids:
            sent_at = time.monotonic()
            if await asyncio.to_thread(self.leases.acquire, batch_id):
                lease = HeldLease(batch_id, self.leases.ttl_s, sent_at)
                running[batch_id] = asyncio.create_task(self._drive(lease), name=f"batch-{batch_id}")
                free -= 1
                if free == 0:
                    return

    async def _drive(self, lease: HeldLease) -> None:
        """Advance one batch while this runner holds its lease, then let the lease go."""
        keeper = asyncio.create_task(self._keep(lease), name=f"lease-{lease.batch_id}")
        try:
            await self._drive_held(lease)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            self.paused.pop(lease.batch_id, None)  # (shown again if it pauses when next driven)
            if lease.held():  # (a lapsed lease may be another replica's by now: release checks that too)
                await asyncio.to_thread(self.leases.release, lease.batch_id)

    async def _keep(self, lease: HeldLease) -> None:
        """Renew the lease every ttl/3 until the batch is done; a failed renewal loses it, and wakes
        the batch so it stops taking requests at once. Each renewal also wakes the batch to look at
        the store again: a cancel made on another replica reaches it within ttl/3."""
        if lease.ttl_s is None:
            return
        while True:
            await asyncio.sleep(lease.ttl_s / 3)
            sent_at = time.monotonic()
            if await asyncio.to_thread(self.leases.renew, lease.batch_id):
                lease.renewed(sent_at)
            else:
                lease.lost = True
                log.warning("batch_lease_lost", batch_id=lease.batch_id)
            self.wake()
            if lease.lost:
                return

    async def _drive_held(self, lease: HeldLease) -> None:
        """Advance one batch until it is done or its lease is lost; what goes wrong with it stays
        with it."""
        batch_id = lease.batch_id
        errors = 0
        while lease.held():
            try:
                batch = await asyncio.to_thread(self.store.get_batch, batch_id)
                if batch is None or batch.status not in ACTIVE:
                    return
                await self._advance(batch, lease)
                errors = 0
                self.paused.pop(batch_id, None)
            except StorageFault as fault:
                # the disk is full (or read-only): the batch waits with its reason, never failed for it
                # and never reported complete; what it stored stays, and it goes on once a write works
                if batch_id not in self.paused:
                    log.warning("batch_paused", batch_id=batch_id, store=fault.store, kind=fault.kind)
                self.paused[batch_id] = fault
                await asyncio.sleep(self.storage_retry_s)
            except ServiceUnavailableError:
                # the engine stopped, the gateway drains or Redis is down: try later
                await asyncio.sleep(RETRY_S)
            except Exception as exc:
                errors += 1
                log.exception("batch_runner_error", batch_id=batch_id, attempt=errors)
                if errors >= ATTEMPTS:
                    await self._fail(batch_id, exc)
                    return
                await asyncio.sleep(RETRY_S)

    async def _fail(self, batch_id: str, exc: Exception) -> None:
        try:
            await asyncio.to_thread(self.store.finish, batch_id, "failed", steps.failure(exc, ATTEMPTS))
        except Exception:
            log.exception("batch_runner_fail_error", batch_id=batch_id)
            self._given_up.add(batch_id)
        log.error("batch_failed", batch_id=batch_id, error=type(exc).__name__)

    async def _advance(self, batch: Batch, lease: HeldLease) -> None:
        store = self.store
        if batch.status == "validating":
            await self._validate(batch)
        elif batch.status == "in_progress":
            await self._run(batch, lease)
        elif batch.status == "finalizing":
            done = await asyncio.to_thread(store.finish, batch.id, "completed")
            log.info("batch_done", batch_id=batch.id, status=done.status if done else None)
        elif batch.status == "cancelling":
            await asyncio.to_thread(store.finish, batch.id, "cancelled")

    async def _validate(self, batch: Batch) -> None:
        await asyncio.to_thread(steps.validate, self.store, batch)

    async def _halted(self, batch: Batch) -> bool:
        """Cancelled, or past its window (then its unrun requests fail as expired)."""
        current = await asyncio.to_thread(self.store.get_batch, batch.id)
        if current is None or current.status != "in_progress":
            return True
        if batch.expires_at is not None and self.clock() >= batch.expires_at:
            await asyncio.to_thread(steps.expire, self.store, batch)
            return True
        return False

    async def _run(self, batch: Batch, lease: HeldLease) -> None:
        """Run the batch's requests without results, `concurrency` at a time, while the lease is
        held; then (all run, the lease still held) move it on to finalizing."""
        pending = deque(await asyncio.to_thread(self.store.pending, batch.id))
        owner = await asyncio.to_thread(self.store.owner_of, batch.id)  # its requests run as its owner
        running: set[asyncio.Task[Any]] = set()
        failed: BaseException | None = None  # stop taking work, raise once what runs has ended
        wake = asyncio.Event()
        self._waiters.add(wake)
        try:
            while (pending and failed is None and lease.held()) or running:
                wake.clear()  # before the check: a cancel stored after it still wakes the wait
                if await self._halted(batch):
                    break
                # a request starts only under the lease: once lost, what runs ends and nothing starts
                while failed is None and pending and len(running) < self.concurrency and lease.held():
                    running.add(asyncio.create_task(self._one(batch, pending.popleft(), owner, lease)))
                waker = asyncio.create_task(wake.wait())
                done, running = await asyncio.wait({*running, waker}, return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
                running.discard(waker)
                for t in done - {waker}:
                    exc = t.exception()  # each one read: none is left unretrieved
                    failed = failed or exc
            if failed is not None:
                # raised only once the requests in flight have ended: one of them may be a fleet
                # backend's circuit probe, and a cancelled probe would keep it from being found well
                raise failed
        finally:
            self._waiters.discard(wake)
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        if lease.held() and not pending:
            await asyncio.to_thread(self.store.transition, batch.id, "finalizing", only_from=("in_progress",))

    async def _one(self, batch: Batch, item: BatchItem, owner: str, lease: HeldLease) -> None:
        rid = uuid.uuid4().hex
        while True:
            if not lease.held():
                return  # no result stored: the lease's next holder runs it
            try:
                answer = await self.execute(batch.endpoint, item.body, rid, self.priority, owner)
                break
            except QueueFullError as exc:
                await asyncio.sleep(max(RETRY_S, exc.retry_after_s))
            except ServiceUnavailableError:
                raise
            except Exception:
                log.exception("batch_request_error", batch_id=batch.id, custom_id=item.custom_id)
                error = CtxfuseError("the server failed on this request; it has been logged")
                answer = Answer(error.status, encode(error.to_openai()))
                break
        ok, line = answer.status_code == 200, steps.output_line(item, answer, rid)
        await asyncio.to_thread(self.store.put_result, batch.id, item.line, ok, line)
