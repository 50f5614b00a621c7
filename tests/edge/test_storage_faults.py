"""Issue 33 on the device: the agent's state dir on a real small filesystem (a tmpfs this test mounts:
root only, as CI runs; skipped with the reason elsewhere) filled to the last byte, remounted
read-only, and its databases damaged for real.

What a user relies on: an upload or a batch the disk cannot hold gets a 507 `insufficient_storage`
with Retry-After, never a 500 or a hang; everything accepted before reads back byte for byte and
still reaches the gateway; chat does not care (the acknowledged-chunk set is a hint); the metric
names the full store; once space is freed the same agent takes uploads and finishes its batches,
without a restart. A read-only state dir or a damaged outbox refuses `ctxfuse edge` with one line
that names the path; the outbox is left as it was. A damaged acknowledged-chunk set is moved aside.

A real agent in front of a real gateway edge listener (agent_stack.py); events are polled for with a
deadline that only guards against a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge.acked import AckedChunks
from edge.agent import Agent
from edge.outbox import Outbox
from shared.batch_protocol import Batch, BatchCreateRequest, FileObject
from shared.storage_faults import FAULTS
from shared.tls import client_context

from ..storage_rig import fill, free_bytes, make_room, remount, small_fs
from .agent_stack import Gatewayside, gatewayside, serving
from .test_agent_file_expiry import batch_input

FAST = {"retry_base_s": 0.05, "retry_cap_s": 0.3, "poll_s": 0.05, "poll_max_s": 0.3}
DISK_KIB = 4096


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gatewayside]:
    with gatewayside(tmp_path_factory.mktemp("storage")) as g:
        yield g


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_fs(tmp_path / "disk", DISK_KIB) as path:
        yield path


def agent_on(gw: Gatewayside, disk: Path, **options: object) -> Agent:
    return Agent(gw.agent_config(disk / "state", **{**FAST, "outbox_min_free_bytes": 0, **options}))


def until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def faults(store: str, kind: str = "full") -> int:
    return FAULTS.counts().get((store, kind), 0)


def upload(url: str, content: bytes, name: str = "in.jsonl") -> httpx.Response:
    return httpx.post(
        f"{url}/v1/files", files={"file": (name, content)}, data={"purpose": "batch"}, timeout=30
    )


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def assert_insufficient_storage(resp: httpx.Response, disk: Path) -> None:
    assert resp.status_code == 507, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["type"]) == ("insufficient_storage", "server_error")
    assert "outbox" in error["message"] and str(disk) not in error["message"]  # no server path
    assert int(resp.headers["retry-after"]) > 0


def wait_done(client: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    def done() -> bool:
        return client.batches.retrieve(batch_id).status in ("completed", "failed", "expired", "cancelled")

    until(done, f"batch {batch_id} did not finish")
    return client.batches.retrieve(batch_id)


def output_ids(client: openai.OpenAI, batch: openai.types.Batch) -> list[str]:
    assert batch.status == "completed" and batch.output_file_id is not None, batch
    text = client.files.content(batch.output_file_id).text
    return sorted(json.loads(line)["custom_id"] for line in text.splitlines() if line)


def test_an_upload_the_full_disk_cannot_hold_gets_a_507_and_what_was_accepted_reads_back(
    gw: Gatewayside, disk: Path
) -> None:
    agent = agent_on(gw, disk)
    with serving(agent) as url:
        client = client_of(url)
        contents = [batch_input(*(f"a{i}-{j}" for j in range(200))) for i in range(3)]
        kept = [client.files.create(file=("in.jsonl", c), purpose="batch") for c in contents]
        batch = client.batches.create(
            input_file_id=kept[0].id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        fill(disk)
        before = faults("outbox")

        assert_insufficient_storage(upload(url, contents[0]), disk)
        with pytest.raises(openai.InternalServerError) as err:  # what the official client sees
            client.files.create(file=("in.jsonl", contents[1]), purpose="batch")
        assert err.value.status_code == 507 and err.value.code == "insufficient_storage"
        made = httpx.post(
            f"{url}/v1/batches",
            json={
                "input_file_id": kept[1].id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
            timeout=30,
        )
        assert_insufficient_storage(made, disk)

        # nothing acknowledged is lost: every file byte for byte, the batch, and nothing more
        for f, content in zip(kept, contents, strict=True):
            assert client.files.content(f.id).content == content
        assert [b.id for b in client.batches.list().data] == [batch.id]
        assert {f.id for f in client.files.list(purpose="batch").data} == {f.id for f in kept}

        # the metric (and the log) name the full store
        text = httpx.get(f"{url}/metrics", timeout=30).text
        counts = {
            (s.labels["store"], s.labels["kind"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "ctxfuse_storage_errors"
            for s in family.samples
            if s.name == "ctxfuse_storage_errors_total"
        }
        assert counts[("outbox", "full")] >= before + 3


def test_queued_work_reaches_the_gateway_while_the_disk_is_full_and_finishes_once_there_is_room(
    gw: Gatewayside, disk: Path
) -> None:
    agent = agent_on(gw, disk)
    # accepted as the routes accept them, before the forwarder runs: queued when the disk fills
    name = f"queued-{uuid.uuid4().hex}.jsonl"
    f = agent.outbox.put_file(name, "batch", batch_input("q-0", "q-1"), None, b"")
    assert isinstance(f, FileObject)
    request = BatchCreateRequest(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"n": name}
    )
    queued = agent.outbox.create_batch(request, None, b"")
    assert isinstance(queued, Batch)
    fill(disk)
    before = faults("outbox")
    refused = batch_input("later")
    http = httpx.Client(verify=client_context(gw.tls, "dev1"), timeout=30)
    gateway = openai.OpenAI(base_url=f"{gw.edge_url}/v1", api_key="unused", http_client=http)
    try:
        with serving(agent) as url:
            client = client_of(url)

            def uploaded_to_gateway() -> bool:
                return any(x.filename == name for x in gateway.files.list())

            # the forwarder sends the queued upload, meets the full disk recording it, and repeats
            until(uploaded_to_gateway, "the queued upload did not reach the gateway")
            until(lambda: faults("outbox") >= before + 2, "the forwarder did not retry on the full disk")
            assert_insufficient_storage(upload(url, refused), disk)
            assert client.files.content(f.id).content == batch_input("q-0", "q-1")

            make_room(disk)  # no restart from here on
            done = wait_done(client, queued.id)
            assert output_ids(client, done) == ["q-0", "q-1"]
            again = upload(url, refused)
            assert again.status_code == 200, again.text
            assert client.files.content(again.json()["id"]).content == refused
            # the repeated steps made one copy and one batch on the gateway (their Idempotency-Keys)
            assert [x.filename for x in gateway.files.list()].count(name) == 1
            assert [b.metadata for b in gateway.batches.list()].count({"n": name}) == 1
    finally:
        http.close()


def test_the_free_space_floor_refuses_uploads_while_accepted_batches_still_finish(
    gw: Gatewayside, disk: Path
) -> None:
    floor = 1 << 20
    agent = agent_on(gw, disk, outbox_min_free_bytes=floor)
    with serving(agent) as url:
        client = client_of(url)
        fill(disk, leave=floor + (256 << 10))  # another program takes the disk to near the floor
        before = faults("outbox")
        assert_insufficient_storage(upload(url, os.urandom(512 << 10)), disk)  # would cross the floor
        assert faults("outbox") == before + 1
        small = client.files.create(file=("in.jsonl", batch_input("s-0", "s-1")), purpose="batch")
        batch = client.batches.create(
            input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert output_ids(client, wait_done(client, batch.id)) == ["s-0", "s-1"]  # results stored
        assert free_bytes(disk) > 0


def test_chat_through_the_agent_works_with_a_full_disk(gw: Gatewayside, disk: Path) -> None:
    agent = agent_on(gw, disk, chunk_threshold=64)  # the long message travels as a chunk
    with serving(agent) as url:
        client = client_of(url)

        def ask(text: str) -> None:
            reply = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": text}])
            assert reply.choices[0].message.content

        fill(disk)
        before = faults("acked")
        ask("a long question " * 20)  # its chunk cannot be recorded as acknowledged: still answered
        assert faults("acked") > before
        ask("another long question " * 20)
        assert len(agent.acked) == 0
        make_room(disk)
        ask("a third long question " * 20)
        assert len(agent.acked) > 0  # recorded again once there is room, without a restart


def test_the_agent_starts_on_a_disk_already_full_and_serves_what_needs_no_disk(
    gw: Gatewayside, disk: Path
) -> None:
    """Its databases' -shm files went with the last run's close and cannot be made on a full disk:
    the agent still starts (no crash loop), reads what it holds, refuses new work with 507, and
    takes it once there is room."""
    first = agent_on(gw, disk)
    content = batch_input("kept-0", "kept-1")
    with serving(first) as url:
        kept = client_of(url).files.create(file=("in.jsonl", content), purpose="batch")
    fill(disk)
    agent = agent_on(gw, disk)
    with serving(agent) as url:
        client = client_of(url)
        assert client.files.content(kept.id).content == content
        reply = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        assert_insufficient_storage(upload(url, content), disk)
        make_room(disk)
        assert client.files.create(file=("in.jsonl", content), purpose="batch").id != kept.id


def edge_cmd(gw: Gatewayside, state: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ctxfuse", "edge", "--gateway", gw.edge_url, "--tls-dir", str(gw.tls)]
    cmd += ["--name", "dev1", "--state-dir", str(state), "--port", "0"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def assert_refused_with_one_line(done: subprocess.CompletedProcess[str], path: Path, fix: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("ctxfuse: ") and str(path) in lines[0] and fix in lines[0], lines[0]


def test_a_read_only_state_dir_refuses_the_agent_with_one_line(gw: Gatewayside, disk: Path) -> None:
    (disk / "state").mkdir()
    remount(disk, "ro")
    try:
        for state in (disk / "state", disk / "missing"):  # there, or to be made under a read-only mount
            assert_refused_with_one_line(edge_cmd(gw, state), state, "writable")
    finally:
        remount(disk, "rw")


def outbox_with_work(state: Path) -> Path:
    outbox = Outbox(state / "outbox.sqlite", 1 << 30, "refuse")
    for i in range(3):
        outbox.put_file(f"in-{i}.jsonl", "batch", batch_input(*(f"r{i}-{j}" for j in range(100))), None, b"")
    outbox.close()
    return state / "outbox.sqlite"


def damage_page_2(raw: bytes) -> bytes:
    return raw[:4096] + b"\xff" * 8 + raw[4096 + 8 :]  # a b-tree page header: an invalid page type


def truncate_mid_page(raw: bytes) -> bytes:
    return raw[: len(raw) - 4096 - 2048]


@pytest.mark.parametrize("damage", [damage_page_2, truncate_mid_page])
def test_a_damaged_outbox_refuses_the_agent_with_one_line_and_is_left_as_it_was(
    gw: Gatewayside, tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    path = outbox_with_work(tmp_path / "state")
    damaged = damage(path.read_bytes())
    path.write_bytes(damaged)
    assert_refused_with_one_line(edge_cmd(gw, tmp_path / "state"), path, "damaged")
    assert path.read_bytes() == damaged  # never replaced, never "repaired"
    assert sorted(p.name for p in path.parent.iterdir()) == ["ctxfuse.lock", "outbox.sqlite"]


def test_a_damaged_acked_set_is_moved_aside_and_the_agent_starts(gw: Gatewayside, tmp_path: Path) -> None:
    state = tmp_path / "state"
    acked = state / "acked.sqlite"
    before = AckedChunks(acked, 1000)
    before.add([bytes([i]) * 32 for i in range(200)])
    before.close()
    damaged = damage_page_2(acked.read_bytes())
    acked.write_bytes(damaged)

    agent = Agent(gw.agent_config(state, **FAST, chunk_threshold=64))
    with serving(agent) as url:
        aside = [p for p in state.iterdir() if p.name.startswith("acked.sqlite.damaged-")]
        assert len(aside) == 1 and aside[0].read_bytes() == damaged  # kept for a look, not in the way
        assert len(agent.acked) == 0
        reply = client_of(url).chat.completions.create(
            model="stub", messages=[{"role": "user", "content": "hello " * 40}]
        )
        assert reply.choices[0].message.content and len(agent.acked) > 0
