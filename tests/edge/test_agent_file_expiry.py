"""The agent's Files and Batch API honours file expiry as the gateway's does: `expires_after` on an
upload (same bounds, same 400s), `expires_at` on the file, gone from then on; the forwarder uploads
the input with the lifetime it has left (an hour at least, the gateway's minimum); a batch's
`output_expires_after` reaches the gateway and its result files here. An outbox from before expiry
opens and takes expiring files.

A real agent in front of a real gateway edge listener (agent_stack.py); time moves through the
outbox's clock, never by sleeping. The gateway's copies are read from the gateway, with the
device's certificate."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from edge.agent import Agent
from edge.outbox import Outbox
from shared.batch_protocol import FileObject
from shared.tls import client_context

from ..gateway.batches import BAD_EXPIRES_AFTER
from .agent_stack import Gatewayside, gatewayside, serving

HOUR = 3600
FAST = {"retry_base_s": 0.05, "retry_cap_s": 0.3, "poll_s": 0.05, "poll_max_s": 0.3}
EXPIRY = {"anchor": "created_at", "seconds": 2 * HOUR}


class Clock:
    """Seconds since the epoch: the real time until a test sets `at`."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self) -> float:
        return time.time() if self.at is None else self.at


@dataclass
class Side:
    gateway: Gatewayside
    agent: Agent
    url: str
    clock: Clock
    opened: list[httpx.Client] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)

    def gateway_client(self) -> openai.OpenAI:
        """The gateway's Files and Batch API as this device sees it (its edge listener); closed with
        the fixture, so no kept-alive connection holds the gateway's shutdown."""
        http = httpx.Client(verify=client_context(self.gateway.tls, "dev1"), timeout=30)
        self.opened.append(http)
        return openai.OpenAI(base_url=f"{self.gateway.edge_url}/v1", api_key="unused", http_client=http)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gatewayside]:
    with gatewayside(tmp_path_factory.mktemp("expiry")) as g:
        yield g


@pytest.fixture
def side(gw: Gatewayside, tmp_path: Path) -> Iterator[Side]:
    """A fresh agent (its own outbox and clock) for each test, in front of the module's gateway."""
    agent = Agent(gw.agent_config(tmp_path / "dev1", **FAST))
    clock = Clock()
    agent.outbox.clock = clock
    with serving(agent) as url:
        side = Side(gw, agent, url, clock)
        yield side
        for http in side.opened:
            http.close()


def batch_input(*custom_ids: str) -> bytes:
    lines = [
        {
            "custom_id": c,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "stub", "messages": [{"role": "user", "content": c}], "max_tokens": 2},
        }
        for c in custom_ids
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def eventually_remote_file(side: Side, file_id: str) -> str:
    """The gateway's id of the local file, once the forwarder has uploaded it (a hang guard only)."""
    deadline = time.monotonic() + 30
    while (remote := side.agent.outbox.remote_file_id(file_id)) is None:
        assert time.monotonic() < deadline, f"{file_id} was not uploaded to the gateway"
        time.sleep(0.02)
    return remote


def test_an_upload_with_expires_after_shows_expires_at_and_is_gone_from_then_on(side: Side) -> None:
    client, content = side.client(), batch_input("a")
    f = client.files.create(file=("in.jsonl", content), purpose="batch", expires_after=EXPIRY)  # type: ignore[arg-type]
    kept = client.files.create(file=("kept.jsonl", content), purpose="batch")
    assert f.expires_at == f.created_at + 2 * HOUR and kept.expires_at is None
    assert client.files.retrieve(f.id).expires_at == f.expires_at

    side.clock.at = f.expires_at - 1  # the last second it lives
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == content
    assert f.id in {x.id for x in client.files.list()}
    used = side.agent.outbox.used_bytes()

    side.clock.at = f.expires_at
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    listed = {x.id for x in client.files.list()}
    assert f.id not in listed and kept.id in listed
    assert side.agent.outbox.used_bytes() == used - len(content)  # its space is free again
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


@pytest.mark.parametrize(("fields", "param"), BAD_EXPIRES_AFTER)
def test_a_bad_expires_after_is_the_gateways_400_and_stores_nothing(
    side: Side, fields: dict[str, str], param: str
) -> None:
    r = httpx.post(
        f"{side.url}/v1/files",
        data={"purpose": "batch", **fields},
        files={"file": ("in.jsonl", batch_input("a"))},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert side.client().files.list().data == [] and side.agent.outbox.used_bytes() == 0


def test_an_idempotency_key_covers_the_expiry(side: Side) -> None:
    def upload(seconds: int) -> httpx.Response:
        return httpx.post(
            f"{side.url}/v1/files",
            data={
                "purpose": "batch",
                "expires_after[anchor]": "created_at",
                "expires_after[seconds]": str(seconds),
            },
            files={"file": ("in.jsonl", batch_input("a"))},
            headers={"Idempotency-Key": "k-1"},
            timeout=30,
        )

    first = upload(HOUR)
    assert first.status_code == 200 and upload(HOUR).json() == first.json()
    reused = upload(2 * HOUR)  # the same key for another request
    assert reused.status_code == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"


@pytest.mark.parametrize(
    ("waited_s", "gateway_lifetime_s"),
    [
        (100, 2 * HOUR - 100),  # the lifetime left when it is uploaded: it expires there as here
        (2 * HOUR - 10, HOUR),  # under the gateway's minimum: an hour
    ],
)
def test_the_gateways_copy_of_an_input_expires_with_the_lifetime_it_had_left(
    side: Side, waited_s: int, gateway_lifetime_s: int
) -> None:
    side.clock.at = float(int(time.time()))
    client = side.client()
    f = client.files.create(file=("in.jsonl", batch_input("a")), purpose="batch", expires_after=EXPIRY)  # type: ignore[arg-type]
    side.clock.at += waited_s  # the link was down meanwhile, say
    client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    remote = side.gateway_client().files.retrieve(eventually_remote_file(side, f.id))
    assert remote.expires_at is not None
    assert remote.expires_at - remote.created_at == gateway_lifetime_s


def test_output_expires_after_is_checked_here_and_reaches_the_gateway_and_the_results(side: Side) -> None:
    client = side.client()
    f = client.files.create(file=("in.jsonl", batch_input("a", "b")), purpose="batch")
    for expiry, param in (
        ({"anchor": "created_at", "seconds": 60}, "output_expires_after.seconds"),
        ({"anchor": "created_at", "seconds": 31 * 24 * HOUR}, "output_expires_after.seconds"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(
                input_file_id=f.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                output_expires_after=expiry,  # type: ignore[arg-type]
            )
        assert err.value.param == param
    assert client.batches.list().data == []  # nothing was queued for the gateway

    b = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after=EXPIRY,  # type: ignore[arg-type]
        metadata={"test": "output-expiry"},
    )
    deadline = time.monotonic() + 30
    while (b := client.batches.retrieve(b.id)).status != "completed":
        assert b.status not in ("failed", "cancelled", "expired"), b
        assert time.monotonic() < deadline, f"batch still {b.status}"
        time.sleep(0.05)
    assert b.output_file_id is not None
    here = client.files.retrieve(b.output_file_id)
    assert here.expires_at == here.created_at + 2 * HOUR

    gateway = side.gateway_client()
    there = [x for x in gateway.batches.list() if x.metadata == {"test": "output-expiry"}]
    assert len(there) == 1 and there[0].output_file_id is not None
    output = gateway.files.retrieve(there[0].output_file_id)
    assert output.expires_at == output.created_at + 2 * HOUR


_OUTBOX_BEFORE_EXPIRY = """
CREATE TABLE files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, filename TEXT NOT NULL,
    purpose TEXT NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL, idem_key TEXT NOT NULL,
    remote_id TEXT UNIQUE, app_key TEXT UNIQUE, app_digest BLOB
);
INSERT INTO files (id, filename, purpose, created_at, content, idem_key)
    VALUES ('file-old', 'old.jsonl', 'batch', 1, x'7b7d0a', 'k');
"""


def test_an_outbox_from_before_expiry_opens_and_takes_expiring_files(tmp_path: Path) -> None:
    path = tmp_path / "outbox.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(_OUTBOX_BEFORE_EXPIRY)
    db.close()
    outbox = Outbox(path, 2**20, "refuse")
    try:
        old = outbox.get_file("file-old")
        assert old is not None and old.expires_at is None  # kept, as it was promised
        made = outbox.put_file("new.jsonl", "batch", b"{}\n", None, b"d", HOUR)
        assert isinstance(made, FileObject) and made.expires_at == made.created_at + HOUR
        new = outbox.get_file(made.id)
        assert new is not None and new.expires_at == new.created_at + HOUR
    finally:
        outbox.close()
