"""The outbox's forwarder: one task per agent that takes pending batches oldest first and drives each
to the gateway's Batch API and back (outbox.py holds the states):

    local --POST /v1/files--> file_uploaded --POST /v1/batches--> batch_created
          --GET /v1/batches/{id} until done, GET /v1/files/{id}/content--> completed

A cancel the app made after the create goes first: POST /v1/batches/{id}/cancel, then the batch is
polled as before until the gateway calls it cancelled (or done, when the cancel came too late).

Uploads and creates carry the Idempotency-Key stored at acceptance, so a step repeated after a crash
or a lost answer returns the gateway's first object. When the link fails (unreachable, 5xx, 429) the
forwarder waits with exponential backoff and full jitter, capped (retry_cap_s); a forwarded batch
is looked at again after poll_s, doubling up to poll_max_s while it runs.

A step whose write the disk refuses (a StorageFault: full, read-only, failing; counted and logged
where it is raised) leaves that batch where it was, as a dead link would: the other batches still take
their steps in the same pass, then the forwarder backs off as for a dead link and repeats the step
(the gateway's side again, under the same Idempotency-Key, which makes it harmless). So queued
uploads and creates reach the gateway while the disk is full, and results fetched then are stored
once there is room again, without a restart.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx
import msgspec
import structlog

from shared.batch_protocol import Batch, FileObject
from shared.file_expiry import EXPIRES_MIN_S
from shared.storage_faults import StorageFault

from .config import EdgeConfig
from .outbox import Outbox
from .outbox_values import TERMINAL, Fetched, Pending
from .uplink import GatewayUnreachable, Uplink

log = structlog.get_logger("ctxfuse.edge")


def backoff_delay(failures: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Seconds to wait after `failures` failures in a row (0 = the first): full jitter, uniform in
    [0, min(cap, base * 2^failures)], so many agents coming back at once do not arrive together."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(failures, 62)))


def gateway_ttl(left_s: int) -> int:
    """The `expires_after[seconds]` to upload a file with that has `left_s` seconds to live here.

    The gateway anchors it at its own upload time, so its copy expires when this one does (the
    transit later at most), never later, except that the gateway takes no lifetime under an hour
    (EXPIRES_MIN_S): a file with less left is sent with an hour. Failing the batch instead would fail
    every batch over a file uploaded with the minimum lifetime the moment forwarding takes a second
    (and any batch held in the outbox through an outage), though the app asked for nothing invalid;
    the cost is a gateway copy outliving the app's expiry by under an hour, no longer than the
    shortest lifetime the app could have asked the gateway for itself.
    """
    return max(left_s, EXPIRES_MIN_S)


class LinkDown(Exception):
    """The gateway did not answer usefully (unreachable, 5xx, 429): retry the step later."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The gateway answered the step with a 4xx: the batch cannot go further."""

    code: str
    message: str


class Forwarder:
    def __init__(self, outbox: Outbox, uplink: Uplink, config: EdgeConfig, rng: random.Random | None = None):
        self.outbox = outbox
        self.uplink = uplink
        self.config = config
        self._rng = rng or random.Random()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()  # bound to the loop the agent runs on
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="outbox-forwarder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def wake(self) -> None:
        """New work: look at the outbox now (a wait after a link failure is not cut short)."""
        self._wake.set()

    async def _loop(self) -> None:
        cfg = self.config
        failures, poll = 0, cfg.poll_s
        while True:
            self._wake.clear()
            try:
                in_flight = await self._pass()
            except (LinkDown, StorageFault) as exc:  # the step is repeated after the wait
                delay = backoff_delay(failures, cfg.retry_base_s, cfg.retry_cap_s, self._rng)
                failures += 1
                if isinstance(exc, StorageFault):
                    log.info(
                        "outbox_waits_for_disk", store=exc.store, kind=exc.kind, retry_in_s=round(delay, 3)
                    )
                else:
                    log.info("outbox_link_down", reason=str(exc), retry_in_s=round(delay, 3))
                await asyncio.sleep(delay)
                continue
            except Exception:
                log.exception("outbox_forwarder_error")
                await asyncio.sleep(backoff_delay(failures, cfg.retry_base_s, cfg.retry_cap_s, self._rng))
                failures += 1
                continue
            failures = 0
            if not in_flight:
                poll = cfg.poll_s
                await self._wake.wait()
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), poll)
                poll = cfg.poll_s  # new work: start looking often again
            except TimeoutError:
                poll = min(poll * 2, cfg.poll_max_s)

    async def _pass(self) -> bool:
        """One step for every pending batch, oldest first; whether any is still pending after. A batch
        whose step the disk refused waits; the others go on, and the fault is raised after them."""
        pending = await asyncio.to_thread(self.outbox.pending)
        left, refused = False, None
        for p in pending:
            try:
                done = await self._advance(p)
            except StorageFault as fault:
                done, refused = False, fault
            left = not done or left
        if refused is not None:
            raise refused
        return left

    async def _advance(self, p: Pending) -> bool:
        """Take the batch as far as it goes now; whether it is completed."""
        if p.cancel and p.remote_id is not None:
            await self._cancel(p.batch_id, p.remote_id)
            if p.state == "completed":  # cancelled here while its create was on the way
                return True
        outcome: Refused | None = None
        if p.state == "local":
            outcome = await self._upload(p)
            state = await asyncio.to_thread(self.outbox.state_of, p.batch_id)
            if outcome is None and state == "file_uploaded":  # (not if cancelled meanwhile)
                outcome = await self._create(p)
        elif p.state == "file_uploaded":
            outcome = await self._create(p)
        elif p.state == "batch_created" and p.remote_id is not None:
            return await self._poll(p.batch_id, p.remote_id)
        if isinstance(outcome, Refused):
            await asyncio.to_thread(self.outbox.fail, p.batch_id, outcome.code, outcome.message)
            return True
        return False

    async def _upload(self, p: Pending) -> Refused | None:
        file_id = p.request.input_file_id
        if p.file_remote_id is not None:  # another batch over this file uploaded it
            await asyncio.to_thread(self.outbox.file_uploaded, p.batch_id, file_id, p.file_remote_id)
            return None
        up = await asyncio.to_thread(self.outbox.upload_of, file_id)
        if up is None:
            return Refused("invalid_file", f"the input file {file_id} expired or was deleted")
        data, key = {"purpose": up.purpose}, up.idem_key
        if up.left_s is not None:
            ttl_s = gateway_ttl(up.left_s)
            data |= {"expires_after[anchor]": "created_at", "expires_after[seconds]": str(ttl_s)}
            # the gateway keys an upload by its lifetime too: a retry a second later asks a shorter
            # one, so it gets its own key (else a 422). A first try whose answer was lost leaves a
            # copy there that no batch uses and that expires when the app asked, like this one.
            key = f"{key}-{ttl_s}"
        resp = await self._call(
            "POST",
            "/v1/files",
            files={"file": (up.filename, up.content, "application/jsonl")},
            data=data,
            headers={"Idempotency-Key": key},
        )
        if isinstance(resp, Refused):
            return resp
        remote = msgspec.json.decode(resp.content, type=FileObject)
        await asyncio.to_thread(self.outbox.file_uploaded, p.batch_id, file_id, remote.id)
        return None

    async def _create(self, p: Pending) -> Refused | None:
        file_remote = await asyncio.to_thread(self.outbox.remote_file_id, p.request.input_file_id)
        if file_remote is None:
            return Refused("invalid_file", f"the input file {p.request.input_file_id} is gone")
        body = msgspec.structs.replace(p.request, input_file_id=file_remote)
        resp = await self._call(
            "POST",
            "/v1/batches",
            content=msgspec.json.encode(body),
            headers={"Idempotency-Key": p.idem_key, "content-type": "application/json"},
        )
        if isinstance(resp, Refused):
            return resp
        remote = msgspec.json.decode(resp.content, type=Batch)
        log.info("outbox_forwarded", batch_id=p.batch_id, remote_id=remote.id)
        if not await asyncio.to_thread(self.outbox.batch_created, p.batch_id, remote):
            await self._cancel(p.batch_id, remote.id)  # the app cancelled it while it was created
        return None

    async def _cancel(self, batch_id: str, remote_id: str) -> None:
        resp = await self._call("POST", f"/v1/batches/{remote_id}/cancel")
        # a refusal (409: it finished first) leaves nothing to cancel: polling brings the outcome
        remote = None if isinstance(resp, Refused) else msgspec.json.decode(resp.content, type=Batch)
        await asyncio.to_thread(self.outbox.cancel_sent, batch_id, remote)
        log.info("outbox_cancel_sent", batch_id=batch_id, remote_id=remote_id, refused=remote is None)

    async def _poll(self, batch_id: str, remote_id: str) -> bool:
        resp = await self._call("GET", f"/v1/batches/{remote_id}")
        if isinstance(resp, Refused):
            await asyncio.to_thread(self.outbox.fail, batch_id, resp.code, resp.message)
            return True
        remote = msgspec.json.decode(resp.content, type=Batch)
        if remote.status not in TERMINAL:
            await asyncio.to_thread(self.outbox.observe, batch_id, remote)
            return False
        output = await self._fetch(remote.output_file_id)
        error = await self._fetch(remote.error_file_id)
        await asyncio.to_thread(self.outbox.complete, batch_id, remote, output, error)
        log.info("outbox_completed", batch_id=batch_id, status=remote.status)
        return True

    async def _fetch(self, remote_file_id: str | None) -> Fetched | None:
        if remote_file_id is None:
            return None
        resp = await self._call("GET", f"/v1/files/{remote_file_id}/content")
        if isinstance(resp, Refused):
            raise LinkDown(f"result file {remote_file_id}: {resp.message}")  # it exists: try again
        return Fetched(remote_id=remote_file_id, content=resp.content)

    async def _call(self, method: str, path: str, **kw: object) -> httpx.Response | Refused:
        try:
            resp = await self.uplink.request(method, path, **kw)
        except GatewayUnreachable as exc:
            raise LinkDown(str(exc)) from exc
        if resp.status_code >= 500 or resp.status_code in (408, 429):
            raise LinkDown(f"{method} {path}: HTTP {resp.status_code}")
        if resp.status_code >= 400:
            return Refused(*_error_of(resp))
        return resp


def _error_of(resp: httpx.Response) -> tuple[str, str]:
    try:
        err = msgspec.json.decode(resp.content)["error"]
        return str(err.get("code") or "gateway_refused"), str(err.get("message"))
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
        return "gateway_refused", f"HTTP {resp.status_code}"
