"""`ctxfuse bench serve` against small real OpenAI-compatible servers on loopback.

The servers here are fakes only in that their tokens come on a timer: they stream real SSE over real
HTTP with delays the test chooses, so the bench's own accounting (TTFT, ITL, TPOT, token counts,
failures, concurrency) can be held to what the server did. Timings are asserted as orders and ratios
with wide margins, never as wall-clock thresholds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from gateway.bench.serve import free_port
from gateway.bench.serving import add_serve_bench_parser
from gateway.bench.serving.client import Target, make_client, request_body, send
from gateway.bench.serving.dataset import long_doc_prompts, random_prompts
from gateway.bench.serving.metrics import percentile, stats_ms
from gateway.bench.serving.options import ServeBenchOptions
from gateway.bench.serving.runner import BenchResult, run, run_setting
from gateway.bench.serving.sharegpt import file_prompts, load_prompts
from gateway.bench.serving.stream import RequestRecord, StreamReader

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Script:
    """What the server does: its delays, its chunks, and per request (cycled) a mode."""

    first_delay_s: float = 0.0
    gap_s: float = 0.0
    tokens: int = 4
    usage: bool = True
    reported_tokens: int | None = None  # completion_tokens in the usage chunk (default: `tokens`)
    modes: tuple[str, ...] = ("ok",)  # ok, http500, error_event, truncate
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    clients: set[tuple[str, int]] = field(default_factory=set)  # connections used
    in_flight: int = 0
    max_in_flight: int = 0


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(s: Script, chat: bool, text: str | None, finish: str | None = None) -> bytes:
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {} if text is None else {"content": text}}
    else:
        choice = {"index": 0, "text": text or ""}
    return _event({"object": "chunk", "choices": [choice | {"finish_reason": finish}]})


async def _stream(s: Script, mode: str, chat: bool, send: Send) -> None:
    async def out(data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    if chat:
        await out(_chunk(s, chat, None))  # the role chunk: no content, no token
    await asyncio.sleep(s.first_delay_s)
    for i in range(s.tokens):
        if i:
            await asyncio.sleep(s.gap_s)
        await out(_chunk(s, chat, f" w{i}"))
        if mode == "error_event":
            await out(_event({"error": {"message": "stub failed mid-stream", "type": "server_error"}}))
            break
        if mode == "truncate" and i == 1:
            break
    else:
        await out(_chunk(s, chat, None, "length"))
        if s.usage:
            usage = {"prompt_tokens": 11, "completion_tokens": s.reported_tokens or s.tokens}
            await out(_event({"object": "chunk", "choices": [], "usage": usage}))
        await out(b"data: [DONE]\n\n")
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def stub_app(s: Script) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        raw, more = b"", True
        while more:
            message = await receive()
            raw, more = raw + message.get("body", b""), message.get("more_body", False)
        mode = s.modes[len(s.requests) % len(s.modes)]
        s.requests.append(json.loads(raw))
        s.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        s.clients.add(tuple(scope["client"]))
        s.in_flight += 1
        s.max_in_flight = max(s.max_in_flight, s.in_flight)
        try:
            if mode == "http500":
                err = json.dumps({"error": {"message": "stub overloaded", "type": "server_error"}})
                await send({"type": "http.response.start", "status": 500, "headers": []})
                await send({"type": "http.response.body", "body": err.encode()})
                return
            await _stream(s, mode, scope["path"] == "/v1/chat/completions", send)
        finally:
            s.in_flight -= 1

    return app


class StubServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        config = uvicorn.Config(stub_app(script), host="127.0.0.1", port=0, log_config=None, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="serve-bench-stub")
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the stub server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def serve() -> Iterator[Callable[[Script], StubServer]]:
    started: list[StubServer] = []

    def start(script: Script) -> StubServer:
        started.append(StubServer(script))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def bench(tmp_path: Path, *urls: str, **kw: Any) -> BenchResult:
    """A quiet bench: no warm-up, one run of 3 prompts of 8 words at concurrency 1, unless told."""
    given: dict[str, Any] = {
        "warmup": 0,
        "concurrency": (1,),
        "num_prompts": 3,
        "input_len": 8,
        "output_len": 16,
    }
    given |= kw
    return run(ServeBenchOptions(base_urls=urls, out=tmp_path / "serve.json", **given), report=lambda _: None)


# pure accounting


def test_percentiles_interpolate_linearly_between_order_statistics() -> None:
    values = [10.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0, 6.0, 5.0]  # 1..10, unsorted
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert (percentile(values, 0), percentile(values, 100)) == (1.0, 10.0)
    assert percentile([7.0], 99) == 7.0 and percentile([10.0, 20.0], 50) == 15.0
    with pytest.raises(ValueError):
        percentile([], 50)
    s = stats_ms([0.001, 0.002, 0.003, 0.004])
    assert s is not None and (s.mean, s.p50, s.count) == (2.5, 2.5, 4)
    assert stats_ms([]) is None


def _content(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})


def test_a_stream_read_at_known_times_gives_exact_ttft_itl_and_tpot() -> None:
    reader = StreamReader(start=10.0)
    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    finish = json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    lines = [
        (f"data: {role}", 10.1),
        (_content("a"), 10.5),
        ("", 10.5),
        (": keep-alive comment", 10.55),
        (_content("b"), 10.6),
        (_content("c"), 10.8),
        (f"data: {finish}", 10.8),
        ("data: [DONE]", 10.9),
        (_content("after done: ignored"), 11.5),
    ]
    for line, t in lines:
        reader.feed(line, t)
    r = reader.record(12.0, prompt_words=7)
    assert r.ok and r.error is None and not r.usage_reported
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(0.9)
    assert r.itl_s == pytest.approx([0.1, 0.2])
    assert (r.output_tokens, r.prompt_tokens) == (3, 7)
    assert r.tpot_s == pytest.approx((0.9 - 0.5) / 2)


def test_error_events_in_every_framing_fail_the_request_with_their_message() -> None:
    framings = [
        'data: {"error": {"message": "openai style", "type": "server_error"}}',
        'data: {"object": "error", "message": "old vllm style", "code": 400}',
        'error: {"code": 500, "message": "llama.cpp style"}',
        'data: {"error": "a bare string"}',
        "data: {not json",
    ]
    for line in framings:
        reader = StreamReader(start=0.0)
        reader.feed(_content("x"), 0.1)
        reader.feed(line, 0.2)
        r = reader.record(0.3, 1)
        assert not r.ok and r.error and r.e2e_s == pytest.approx(0.2), line
    reader = StreamReader(start=0.0)
    for line in ("event: error", 'data: {"message": "sse error event"}'):
        reader.feed(line, 0.1)
    assert reader.record(0.2, 1).error == "sse error event"
    truncated = StreamReader(start=0.0)
    truncated.feed(_content("x"), 0.1)
    assert "ended without [DONE]" in (truncated.record(0.2, 1).error or "")


# the datasets


def test_random_prompts_have_the_asked_lengths_and_are_seeded() -> None:
    exact = random_prompts(20, input_len=50, output_len=30, ratio=0.0, seed=1)
    assert {(len(p.text.split()), p.input_words, p.output_len) for p in exact} == {(50, 50, 30)}
    assert len({p.text for p in exact}) == 20
    spread = random_prompts(50, input_len=100, output_len=40, ratio=0.5, seed=1)
    lengths = [len(p.text.split()) for p in spread]
    assert all(50 <= n <= 150 for n in lengths) and len(set(lengths)) > 10
    assert all(20 <= p.output_len <= 60 for p in spread)
    assert [p.input_words for p in spread] == lengths
    assert random_prompts(5, 10, 5, 0.2, seed=3) == random_prompts(5, 10, 5, 0.2, seed=3)
    assert random_prompts(5, 10, 5, 0.2, seed=3) != random_prompts(5, 10, 5, 0.2, seed=4)


def test_long_doc_prompts_share_one_document_and_differ_in_their_question() -> None:
    prompts = long_doc_prompts(12, input_len=300, output_len=8, seed=0)
    documents = {p.text.split("\n\n")[0] for p in prompts}
    questions = [p.text.split("\n\n")[1] for p in prompts]
    assert len(documents) == 1 and len(documents.pop().split()) == 300
    assert len(set(questions)) == 12 and all(len(q.split()) < 30 for q in questions)
    assert all(
        p.input_words == 300 + len(q.split()) and p.output_len == 8
        for p, q in zip(prompts, questions, strict=True)
    )


SHAREGPT = [
    {
        "id": "a",
        "conversations": [{"from": "human", "value": "one two three"}, {"from": "gpt", "value": "a b"}],
    },
    {"id": "no-answer", "conversations": [{"from": "human", "value": "unanswered"}]},
    {"id": "no-human", "conversations": [{"from": "gpt", "value": "hello"}]},
    {
        "id": "system-first",
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "four five"},
            {"from": "gpt", "value": "x y z w"},
            {"from": "human", "value": "a later turn"},
        ],
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "six seven"}]},
            {"role": "assistant", "content": "q"},
        ]
    },
]


def test_sharegpt_files_give_first_human_turns_and_answer_lengths(tmp_path: Path) -> None:
    as_json, as_jsonl = tmp_path / "s.json", tmp_path / "s.jsonl"
    as_json.write_text(json.dumps(SHAREGPT))
    as_jsonl.write_text("\n".join(json.dumps(c) for c in SHAREGPT) + "\n")
    for path in (as_json, as_jsonl):
        got = [(p.text, p.input_words, p.output_len) for p in load_prompts(path, None)]
        assert got == [("one two three", 3, 2), ("four five", 2, 4), ("six seven", 2, 1)]
    overridden = load_prompts(as_json, 64)
    assert [p.text for p in overridden][:2] == ["one two three", "unanswered"]
    assert {p.output_len for p in overridden} == {64}
    cycled = file_prompts(as_json, 7, None, seed=0)
    assert len(cycled) == 7 and {p.text for p in cycled} == {"one two three", "four five", "six seven"}
    (tmp_path / "empty.jsonl").write_text('{"not": "a conversation"}\n')
    (tmp_path / "bad.json").write_text("[1, 2]")
    for bad, says in (
        ("missing.json", "cannot read"),
        ("empty.jsonl", "no conversation"),
        ("bad.json", "not a"),
    ):
        with pytest.raises(ValueError, match=says):
            file_prompts(tmp_path / bad, 4, None, seed=0)


# against real servers


def test_ttft_itl_and_tpot_follow_where_each_server_spends_its_time(serve: Any, tmp_path: Path) -> None:
    slow_start = serve(Script(first_delay_s=0.25, gap_s=0.02, tokens=6))
    slow_tokens = serve(Script(first_delay_s=0.01, gap_s=0.08, tokens=6))
    result = bench(tmp_path, slow_start.url, slow_tokens.url, concurrency=(3,), num_prompts=3)
    a, b = result.runs
    for f in (a, b):
        assert (f.completed, f.failed, f.errors, f.model) == (3, 0, [], "stub-model")
        assert f.total_output_tokens == 18 and f.usage_reported == 3 and f.total_input_tokens == 33
        assert f.ttft_ms and f.itl_ms and f.tpot_ms and f.e2e_ms
        assert f.itl_ms.count == 15 and f.ttft_ms.count == f.tpot_ms.count == f.e2e_ms.count == 3
        assert 0.5 < f.tpot_ms.mean / f.itl_ms.mean < 2  # TPOT averages the same gaps ITL lists
        assert f.e2e_ms.p50 > f.ttft_ms.p50 and f.e2e_ms.p50 > 5 * f.itl_ms.p50
        assert f.output_throughput > 0 and f.request_throughput > 0
    assert a.ttft_ms.p50 > 3 * a.itl_ms.p50  # type: ignore[union-attr]
    assert b.itl_ms.p50 > 2 * b.ttft_ms.p50  # type: ignore[union-attr]
    assert a.ttft_ms.p50 > 2 * b.ttft_ms.p50 and b.itl_ms.p50 > 2 * a.itl_ms.p50  # type: ignore[union-attr]


def test_tokens_come_from_usage_when_reported_and_from_chunks_otherwise(serve: Any, tmp_path: Path) -> None:
    reported = serve(Script(tokens=5, reported_tokens=9))
    unreported = serve(Script(tokens=5, usage=False))
    with_usage, without = bench(tmp_path, reported.url, unreported.url, input_len=8).runs
    assert (with_usage.total_output_tokens, with_usage.total_input_tokens, with_usage.usage_reported) == (
        27,
        33,
        3,
    )
    assert (without.total_output_tokens, without.total_input_tokens, without.usage_reported) == (15, 24, 0)


def test_request_bodies_ask_for_usage_and_send_ignore_eos_only_when_asked(serve: Any, tmp_path: Path) -> None:
    server = serve(Script(tokens=3))
    bench(tmp_path, server.url, num_prompts=2)
    bench(tmp_path, server.url, num_prompts=2, ignore_eos=True, endpoint="completions", temperature=0.0)
    plain, eos = server.script.requests[:2], server.script.requests[2:]
    for body in plain:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert "ignore_eos" not in body and body["temperature"] == 0.8 and body["max_tokens"] == 16
        assert body["model"] == "stub-model" and len(body["messages"][0]["content"].split()) == 8
    for body in eos:
        assert body["ignore_eos"] is True and "messages" not in body and len(body["prompt"].split()) == 8
    result = bench(tmp_path, server.url, endpoint="completions")
    assert result.runs[0].total_output_tokens == 9 and result.runs[0].itl_ms.count == 6  # type: ignore[union-attr]


def test_concurrency_caps_requests_in_flight_over_kept_alive_connections(serve: Any, tmp_path: Path) -> None:
    for cap in (2, 5):
        server = serve(Script(first_delay_s=0.05, gap_s=0.01, tokens=3))
        result = bench(tmp_path, server.url, concurrency=(cap,), num_prompts=12)
        assert result.runs[0].completed == 12 and result.runs[0].concurrency == cap
        assert server.script.max_in_flight == cap
        assert len(server.script.clients) == cap  # one connection per slot, each reused
    paced = serve(Script(first_delay_s=0.05, tokens=2))
    result = bench(tmp_path, paced.url, concurrency=(2,), num_prompts=8, request_rate=200.0)
    assert result.runs[0].completed == 8 and result.runs[0].request_rate == 200.0
    assert paced.script.max_in_flight <= 2


def test_failed_requests_are_counted_with_their_messages(serve: Any, tmp_path: Path) -> None:
    server = serve(Script(tokens=3, modes=("ok", "http500", "error_event", "truncate")))
    f = bench(tmp_path, server.url, num_prompts=8).runs[0]
    assert (f.completed, f.failed) == (2, 6)
    assert f.errors == [
        "HTTP 500: stub overloaded",
        "stub failed mid-stream",
        "the stream ended without [DONE] or a finish reason",
    ]
    assert f.total_output_tokens == 6 and f.ttft_ms and f.ttft_ms.count == 2


class OneAnswerPerConnection:
    """A raw HTTP/1.1 server that answers the first request on a connection (keep-alive, a whole
    SSE stream) and drops every later one unanswered: a server closing a kept-alive connection as
    the next request goes out. `answers=0`: it drops every request."""

    def __init__(self, answers: int = 1) -> None:
        self.answers = answers
        self.connections = 0
        self.dropped = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main() -> None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            started.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="one-answer")
        self.thread.start()
        asyncio.run_coroutine_threadsafe(main(), self.loop)
        assert started.wait(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if served >= self.answers:
                    self.dropped += 1
                    return
                s = Script(tokens=2)
                body = _chunk(s, True, None) + _chunk(s, True, " a") + _chunk(s, True, " b")
                body += _chunk(s, True, None, "length") + b"data: [DONE]\n\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _send_all(url: str, n: int) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        target = Target(url, "m", "chat")
        body = request_body(target, random_prompts(1, 4, 2, 0.0, seed=0)[0], 0.0, False)
        async with make_client(1, None) as client:
            return [await send(client, target, body, 4) for _ in range(n)]

    return asyncio.run(go())


def test_a_request_dropped_on_a_closed_kept_alive_connection_is_sent_again_once() -> None:
    server = OneAnswerPerConnection()
    try:
        got = _send_all(server.url, 4)
        assert [r.ok for r in got] == [True] * 4 and all(r.output_tokens == 2 for r in got)
        assert server.connections == 4 and server.dropped == 3  # each later request: one drop, one resend
    finally:
        server.stop()
    never = OneAnswerPerConnection(answers=0)
    try:
        got = _send_all(never.url, 2)
        assert [r.ok for r in got] == [False, False] and never.dropped == 4  # once more, not forever
        assert all("RemoteProtocolError" in (r.error or "") for r in got)
    finally:
        never.stop()


def test_records_of_a_run_hold_the_tpot_identity(serve: Any) -> None:
    server = serve(Script(first_delay_s=0.03, gap_s=0.01, tokens=4))

    async def records() -> list[RequestRecord]:
        target = Target(server.url, "stub-model", "chat")
        prompts = random_prompts(4, 5, 4, 0.0, seed=0)
        bodies = [(request_body(target, p, 0.0, False), p.input_words) for p in prompts]
        async with make_client(2, None) as client:
            got, duration = await run_setting(client, target, bodies, 2, None, random.Random(0))
        assert duration > max(r.e2e_s for r in got)
        return got

    for r in asyncio.run(records()):
        assert r.ok and r.output_tokens == 4 and len(r.itl_s) == 3 and r.ttft_s is not None
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 3)
        assert r.ttft_s + sum(r.itl_s) <= r.e2e_s


# the command


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="ctxfuse bench")
    add_serve_bench_parser(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(["serve", *argv])
    return int(args.func(args))


def test_the_command_prints_a_table_and_writes_json_without_the_key(
    serve: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = serve(Script(tokens=3))
    out = tmp_path / "r" / "serve.json"
    code = _cli(
        *("--base-url", server.url + "/v1/", "--api-key", "s3cret", "--dataset", "long-doc"),
        *("--input-len", "20", "--num-prompts", "2", "--concurrency", "1,2", "--out", str(out)),
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("| server | model | concurrency |") and printed.count(f"| {server.url} |") == 2
    data = json.loads(out.read_text())
    assert [r["concurrency"] for r in data["runs"]] == [1, 2] and "s3cret" not in out.read_text()
    assert data["options"]["dataset"] == "long-doc" and data["runs"][0]["ttft_ms"]["count"] == 2
    assert {h["authorization"] for h in server.script.headers} == {"Bearer s3cret"}
    assert len(server.script.requests) == 1 + 2 * 2  # the warm-up, then two runs


def test_a_server_that_is_not_up_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert _cli("--base-url", url, "--out", str(tmp_path / "x.json")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ctxfuse: no server answers at {url}") and "\n" not in err
    assert not (tmp_path / "x.json").exists()
    assert _cli("--base-url", url, "--num-prompts", "0") == 2  # bad options never reach the network
    assert "must be >= 1" in capsys.readouterr().err
