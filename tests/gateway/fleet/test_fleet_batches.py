"""The Batch API of a gateway in fleet mode, over stub OpenAI-compatible servers: a batch's requests
are routed like live ones, a line's 4xx is that line's answer, and a batch outlives an outage of
the whole fleet (its requests wait and run when a backend is back; none is failed or lost)."""

from __future__ import annotations

import time
from pathlib import Path

import openai

from ..batches import chat_line, lines_of, start, wait
from .openai_stub import StubServer
from .stub_fleet import Running, fleet_of, run_fleet


def client_of(fleet: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_a_batch_is_routed_across_the_fleet(stubs: tuple[StubServer, StubServer], tmp_path: Path) -> None:
    a, b = stubs
    fleet = run_fleet(fleet_of(a, b), data_dir=tmp_path)
    try:
        client = client_of(fleet)
        lines = [chat_line(f"q{i}", f"Question {i}") for i in range(12)]
        lines.append(chat_line("streamed", stream=True))
        batch = wait(client, start(client, lines).id)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (12, 1)
        out = {x["custom_id"]: x for x in lines_of(client, batch.output_file_id)}
        answers = {x["response"]["body"]["choices"][0]["message"]["content"] for x in out.values()}
        assert set(out) == {f"q{i}" for i in range(12)} and answers == {"a", "b"}  # both took work
        assert all(x["response"]["status_code"] == 200 for x in out.values())
        (refused,) = lines_of(client, batch.error_file_id)
        assert refused["custom_id"] == "streamed" and refused["response"]["status_code"] == 400
        assert refused["response"]["body"]["error"]["param"] == "stream"
        seen = a.behaviour.seen + b.behaviour.seen
        assert sorted(body["messages"][0]["content"] for body in seen) == sorted(
            f"Question {i}" for i in range(12)
        )  # each request sent once, as written; the refused one never left the gateway
    finally:
        fleet.stop()  # type: ignore[operator]


def test_a_batch_waits_out_an_outage_of_every_backend(
    stubs: tuple[StubServer, StubServer], tmp_path: Path
) -> None:
    a, b = stubs
    a.behaviour.fail = b.behaviour.fail = True
    fleet = run_fleet(fleet_of(a, b), data_dir=tmp_path)
    try:
        client = client_of(fleet)
        batch = start(client, [chat_line(f"q{i}") for i in range(4)])
        deadline = time.monotonic() + 20
        while len(a.behaviour.seen) + len(b.behaviour.seen) < 4:  # tried, and refused by both
            assert time.monotonic() < deadline, "the batch's requests never reached the backends"
            time.sleep(0.05)
        time.sleep(1.5)  # more than a retry round of the runner
        waiting = client.batches.retrieve(batch.id)
        assert waiting.status == "in_progress" and waiting.request_counts is not None
        assert (waiting.request_counts.completed, waiting.request_counts.failed) == (0, 0)
        a.behaviour.fail = b.behaviour.fail = False
        done = wait(client, batch.id, timeout=30)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (4, 0)
        assert {x["custom_id"] for x in lines_of(client, done.output_file_id)} == {f"q{i}" for i in range(4)}
    finally:
        fleet.stop()  # type: ignore[operator]
