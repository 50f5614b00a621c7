"""Which runner drives a batch: a lease per batch. One gateway over a data dir needs none (the dir's
lock makes its runner the only one: `LocalLeases` grants every batch). Replicas over one Redis take
`RedisLeases`: `batch:lease:<id>` holds the replica's id, set only if absent and with a time to live
(SET NX PX), so one replica drives a batch at a time. The runner renews it every ttl/3 while it
drives the batch and deletes it when done; a renewal or a release is one Lua script that acts only if
the key still names this replica, so a replica never extends or frees another's lease. A replica
that dies (kill -9) renews nothing: its leases lapse after the ttl (LEASE_S, or `ctxfuse serve --batch-lease`)
and another replica's runner, which polls for active batches, takes the batch over.

What "no request runs twice" holds, exactly:
- A result is stored once (the store's put_result only goes from no result to one), so no custom_id
  ever has two results, and a request with a stored result never runs again.
- A runner starts a request only while it holds the batch's lease (`HeldLease.held`: the last
  renewal succeeded, less than the ttl ago by this process's clock); a failed renewal stops it taking
  more of that batch at once. So two replicas run the requests of one batch side by side only in the
  window where the old owner's requests were already in flight.
- A request in flight on a replica when it died (or lost the lease) had no stored result: the new
  owner runs it again. So the engine may run a request more than once (at least once), while its
  result is stored exactly once: the first stored wins, a late one is dropped.
"""

from __future__ import annotations

import time
from dataclasses import InitVar, dataclass, field
from typing import Protocol

from gateway.shared_state.redis_link import DOWN, RedisLink

LEASE_S = 10.0  # a dead replica's batches are taken over this long after its last renewal
# KEYS: lease; ARGV: replica, ttl ms -> 1 if it is (now) this replica's, 0 if another holds it
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""
# KEYS: lease; ARGV: replica, ttl ms -> 1 renewed, 0 not this replica's (lapsed, or taken over)
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""
# KEYS: lease; ARGV: replica -> 1 released, 0 not this replica's
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Leases(Protocol):
    """Blocking calls (run them off the event loop); none raises: an error is "not held"."""

    ttl_s: float | None  # None: a lease never lapses (nothing to renew)

    def acquire(self, batch_id: str) -> bool: ...
    def renew(self, batch_id: str) -> bool: ...
    def release(self, batch_id: str) -> None: ...


class LocalLeases:
    """One runner over a data dir (it holds the dir's lock): every batch is its own."""

    ttl_s: float | None = None

    def acquire(self, batch_id: str) -> bool:
        return True

    def renew(self, batch_id: str) -> bool:
        return True

    def release(self, batch_id: str) -> None:
        return None


class RedisLeases:
    def __init__(self, link: RedisLink, ttl_s: float | None = None) -> None:
        """`ttl_s`: None, LEASE_S."""
        ttl_s = LEASE_S if ttl_s is None else ttl_s
        if ttl_s <= 0:
            raise ValueError(f"a lease's ttl must be > 0, got {ttl_s}")
        self.ttl_s: float | None = ttl_s
        self._link = link
        self._ms = max(1, round(ttl_s * 1000))
        self._acquire = link.sync.register_script(_ACQUIRE)
        self._renew = link.sync.register_script(_RENEW)
        self._release = link.sync.register_script(_RELEASE)

    def _key(self, batch_id: str) -> str:
        return self._link.key("batch", "lease", batch_id)

    def _call(self, script: object, batch_id: str, *args: object) -> bool:
        try:
            return bool(script(keys=[self._key(batch_id)], args=[self._link.replica, *args]))  # type: ignore[operator]
        except DOWN:
            return False  # Redis cannot say we hold it: we do not

    def acquire(self, batch_id: str) -> bool:
        return self._call(self._acquire, batch_id, self._ms)

    def renew(self, batch_id: str) -> bool:
        return self._call(self._renew, batch_id, self._ms)

    def release(self, batch_id: str) -> None:
        self._call(self._release, batch_id)

    def holder(self, batch_id: str) -> str | None:
        """The replica that holds the batch's lease now, or None."""
        who = self._link.sync.get(self._key(batch_id))
        return who.decode() if isinstance(who, bytes) else None


@dataclass(slots=True)
class HeldLease:
    """This runner's lease on one batch, as far as it knows: held until `until` (monotonic seconds,
    counted from when the last acquire or renewal was sent, so never later than Redis's own expiry),
    unless a renewal failed."""

    batch_id: str
    ttl_s: float | None
    sent_at: InitVar[float]  # when the acquire that granted it was sent
    until: float = field(init=False)
    lost: bool = False

    def __post_init__(self, sent_at: float) -> None:
        self.renewed(sent_at)

    def renewed(self, sent_at: float) -> None:
        self.until = float("inf") if self.ttl_s is None else sent_at + self.ttl_s

    def held(self) -> bool:
        return not self.lost and time.monotonic() < self.until
