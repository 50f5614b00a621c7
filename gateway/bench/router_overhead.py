"""`ctxfuse bench gateway --fleet`: what the fleet router (`ctxfuse serve --backend URL`) costs in front
of backends that answer at once, measured beside the backend reached directly. Two kinds of backend:

- `openai`: an OpenAI-compatible server (instant_upstream.py) answering with bytes recorded from the
  gateway over the instant engine. The router relays the body and the answer, so whatever it takes
  beyond the upstream is its own: decoding, routing, the upstream hop and relaying ("added"). Beside
  it, the least relay this stack can make (bare_relay.py: uvicorn and the router's HTTP client, no
  framework) before the same upstream: the floor ("bare_added"), and the router's own work above it.
- `worker`: a ctxfuse worker over the instant engine with the default model's tokenizer and template
  (serve.py `instant-worker`). The router plans each chat itself (template, tokenize through its key
  memo, block keys) and streams the answer from the worker's output frames: the engine seam with a
  free engine. wrk repeats one body, so the memo finds each prompt whole: this is a conversation's
  next turn, not a first one (`ctxfuse bench router-keys` times both). The worker reached directly
  templates and tokenizes the whole chat itself on every request: a reference, not a baseline.

Prompts are multi-turn chats of about 50, 2,000 and 16,000 tokens (router_keys.py's conversations),
each sent plain and streamed. Per size and mode: wrk at one connection (p50, p99) and at the fleet's
connection count (requests per second), against issue 30's aims. Prints nothing; returns the figures.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.bench.baseline import Recorded
from gateway.bench.fake_engine import MODEL_NAME
from gateway.bench.load import run_wrk, wrk_path
from gateway.bench.run import ROUTE, WARMUP_S, _post, request_body
from gateway.bench.serve import WORKER_KEY, ServerProcess
from gateway.bench.worker_proc import ChildServer
from shared.errors import CtxfuseError

if TYPE_CHECKING:
    from gateway.backends.fleet.keys import KeyMaker

# issue 30's aims: what the router may add at one connection, and the rate it must hold at 32
AIM_ADDED_P50_MS = 0.5
AIM_ADDED_P99_MS = 2.0
AIM_REQUESTS_PER_S = {"non_streaming": 1500.0, "streaming": 1000.0}
MODES = (("non_streaming", False), ("streaming", True))
KINDS = ("openai", "worker")
# after a closed loop at many connections, a server may still work off what it accepted (a worker
# tokenizing 32 chats of 16,000 tokens: most of a second): the next run starts once it has
SETTLE_S = 1.0


@dataclass(frozen=True, slots=True)
class RouterBenchOptions:
    duration_s: float = 5.0  # per wrk run
    prompt_tokens: tuple[int, ...] = (50, 2000, 16000)  # about this many prompt tokens per chat
    connections: int = 1  # for the added-latency comparison
    fleet_connections: int = 32  # for the rate
    kinds: tuple[str, ...] = KINDS  # the backends measured

    def __post_init__(self) -> None:
        if not self.kinds or set(self.kinds) - set(KINDS):
            raise ValueError(f"backend kinds are among {', '.join(KINDS)}")
        if not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise ValueError("prompt token counts must be >= 1")
        if min(self.connections, self.fleet_connections) < 1 or self.duration_s <= 0:
            raise ValueError("connections must be >= 1 and the duration > 0")


@dataclass(frozen=True, slots=True)
class Rig:
    """The instant backend, the router in front of it, and the answers the backend sends."""

    kind: str
    upstream: ServerProcess
    router: ChildServer
    plain: Recorded
    streamed: Recorded
    bare: ServerProcess | None = None  # the least relay before the same upstream (openai kind only)

    @property
    def upstream_headers(self) -> dict[str, str]:
        """What a client of the backend itself sends (a worker requires its key)."""
        return {"Authorization": f"Bearer {WORKER_KEY}"} if self.kind == "worker" else {}


@dataclass(frozen=True, slots=True)
class ChatBody:
    text: str  # JSON, one line
    prompt_tokens: int


def key_maker() -> KeyMaker:
    """The router's prompt keys over the default model's tokenizer and template: what counts a
    chat's prompt tokens as the router would. (The tokenizer's imports wait until here: `ctxfuse
    bench --help` reads this module's defaults.)"""
    from cloud.model.text_side import load_text_side
    from gateway.backends.fleet.keys import KeyMaker

    return KeyMaker(*load_text_side(None), memo=False)


def chat_body(keys: KeyMaker, tokens: int, streaming: bool, seed: int = 0) -> ChatBody:
    """A multi-turn chat of about `tokens` prompt tokens (as `keys` count them), ending on a user's
    turn."""
    from gateway.bench.router_keys import _conversation, _request

    messages = _conversation(keys.tokenizer, tokens, seed, random.Random(seed))
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 16, "stream": streaming}
    text = json.dumps(body, separators=(",", ":"))  # ASCII: wrk's Lua long string takes it as is
    return ChatBody(text, len(keys.chat(_request(messages), True).token_ids))


def _record(tmp: Path) -> tuple[Path, Path]:
    """The gateway's plain and streamed answers over the instant engine, saved for the upstream."""
    gateway = ServerProcess("gateway")
    paths = (tmp / "plain.json", tmp / "streamed.json")
    try:
        gateway.wait_ready()
        for path, streaming in zip(paths, (False, True), strict=True):
            headers, reply = _post(gateway.url + ROUTE, request_body(streaming))
            Recorded.from_response(headers, reply, streaming).save(path)
    finally:
        gateway.stop()
    return paths


def _wait_routable(router: ChildServer, timeout_s: float = 60.0) -> None:
    """Until the router's /ready says it has found its backend."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(router.url + "/ready", timeout=5):
                return
        except OSError:  # HTTPError 503 included: not yet
            time.sleep(0.1)
    raise CtxfuseError(f"the router found no backend within {timeout_s:g} s")


@contextmanager
def router_rig(kind: str = "openai") -> Iterator[Rig]:
    """The backend of `kind` and the router, started, ready and stopped again on the way out."""
    with tempfile.TemporaryDirectory(prefix="ctxfuse-bench-router-") as tmp:
        plain, streamed = _record(Path(tmp))
        if kind == "worker":
            upstream, key = ServerProcess("instant-worker"), ["--backend-key", WORKER_KEY]
        else:
            upstream, key = ServerProcess("upstream", MODEL_NAME, str(plain), str(streamed)), []
        env = {k: v for k, v in os.environ.items() if k not in ("CTXFUSE_API_KEY", "CTXFUSE_REDIS_URL")}
        args = [
            "serve",
            "--backend",
            upstream.url,
            *key,
            "--port",
            "0",
            "--data-dir",
            str(Path(tmp) / "router"),
        ]
        router: ChildServer | None = None
        bare: ServerProcess | None = None
        try:
            upstream.wait_ready()
            if kind == "openai":
                bare = ServerProcess("bare-relay", upstream.url)
                bare.wait_ready()
            router = ChildServer(args, env)
            router.wait_ready()
            _wait_routable(router)
            yield Rig(kind, upstream, router, Recorded.load(plain), Recorded.load(streamed), bare)
        finally:
            if router is not None:
                router.stop()
            if bare is not None:
                bare.stop()
            upstream.stop()


def sse_events(body: bytes) -> list[bytes]:
    """A stream's events, without the blank lines between them (how a relay frames them may differ)."""
    return [e.strip() for e in body.split(b"\n\n") if e.strip()]


def _content(reply: bytes, streaming: bool) -> str:
    """The answer's text: a whole answer's message, or a stream's deltas joined."""
    if not streaming:
        return str(json.loads(reply)["choices"][0]["message"]["content"])
    chunks = [json.loads(e[len(b"data: ") :]) for e in sse_events(reply) if e != b"data: [DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def relays(rig: Rig, body: str, streaming: bool, via: str | None = None) -> bool:
    """Whether the router (or the server at `via`) answers `body` as the backend does: before a
    relayed server, the same bytes (a stream: the same events); before a worker, whose answers carry
    ids of the router's own, the same text, a stream ending in `[DONE]`."""
    try:
        reply = _post((via or rig.router.url) + ROUTE, body)[1]
    except urllib.error.HTTPError:
        return False
    expected = b"".join((rig.streamed if streaming else rig.plain).chunks)
    if rig.kind == "worker":
        ends = not streaming or sse_events(reply)[-1:] == [b"data: [DONE]"]
        try:
            return ends and _content(reply, streaming) == _content(expected, streaming)
        except (ValueError, KeyError, IndexError):
            return False
    return sse_events(reply) == sse_events(expected) if streaming else reply == expected


def _compare(rig: Rig, body: ChatBody, mode: str, opts: RouterBenchOptions) -> dict[str, Any]:
    """The router and the backend on one body: at one connection, then at the fleet's count."""
    targets = {
        "router": (rig.router.url + ROUTE, None),
        "upstream": (rig.upstream.url + ROUTE, rig.upstream_headers),
    }
    if rig.bare is not None:
        targets["bare_relay"] = (rig.bare.url + ROUTE, None)
    one, many = {}, {}
    for name, (url, headers) in targets.items():  # one target at a time, each left to drain after
        run_wrk(url, body.text, opts.fleet_connections, WARMUP_S, headers)
        time.sleep(SETTLE_S)
        one[name] = run_wrk(url, body.text, opts.connections, opts.duration_s, headers)
        many[name] = run_wrk(url, body.text, opts.fleet_connections, opts.duration_s, headers)
        time.sleep(SETTLE_S)
    router, upstream, rate = one["router"], one["upstream"], many["router"]
    row: dict[str, Any] = {
        "prompt_tokens": body.prompt_tokens,
        "body_bytes": len(body.text.encode()),
        "router": {"latency": router.as_dict(), "rate": rate.as_dict()},
        "upstream": {"latency": upstream.as_dict(), "rate": many["upstream"].as_dict()},
    }
    if rig.kind == "worker":  # the worker does more than the router's upstream: no difference to take
        row["aims_met"] = {
            "p50_within_added_aim": router.p50_ms <= AIM_ADDED_P50_MS and router.errors == 0,
            "requests_per_s": rate.requests_per_s >= AIM_REQUESTS_PER_S[mode] and rate.errors == 0,
        }
        return row
    added_p50, added_p99 = router.p50_ms - upstream.p50_ms, router.p99_ms - upstream.p99_ms
    row["added_p50_ms"], row["added_p99_ms"] = round(added_p50, 3), round(added_p99, 3)
    if "bare_relay" in one:  # the floor: what a relay that does nothing else adds
        bare = one["bare_relay"]
        row["bare_relay"] = {"latency": bare.as_dict(), "rate": many["bare_relay"].as_dict()}
        row["bare_added_p50_ms"] = round(bare.p50_ms - upstream.p50_ms, 3)
        row["router_beyond_bare_p50_ms"] = round(router.p50_ms - bare.p50_ms, 3)
    row["aims_met"] = {  # a run with errors meets nothing
        "added_p50": added_p50 <= AIM_ADDED_P50_MS and router.errors == 0,
        "added_p99": added_p99 <= AIM_ADDED_P99_MS and router.errors == 0,
        "requests_per_s": rate.requests_per_s >= AIM_REQUESTS_PER_S[mode] and rate.errors == 0,
    }
    return row


def run(opts: RouterBenchOptions) -> dict[str, Any]:
    wrk_path()  # fail before starting anything when wrk is missing
    keys = key_maker()
    bodies = {
        (size, mode): chat_body(keys, size, streaming, seed=size)
        for size in opts.prompt_tokens
        for mode, streaming in MODES
    }
    result: dict[str, Any] = {
        "options": asdict(opts),
        "aims": {
            "added_p50_ms": AIM_ADDED_P50_MS,
            "added_p99_ms": AIM_ADDED_P99_MS,
            "requests_per_s": {**AIM_REQUESTS_PER_S, "at_connections": opts.fleet_connections},
        },
        "load": "wrk -t1, closed loop of N kept-alive connections; latency to the last byte of the response",
        "servers": "the router (`ctxfuse serve --backend URL`, default options) before an instant "
        "backend (openai: a raw ASGI OpenAI-compatible server; worker: `ctxfuse worker` over the "
        "instant engine), each one process on loopback; before the openai backend, the bare relay too "
        "(bare_relay.py, the floor)",
    }
    for kind in opts.kinds:
        rows: list[dict[str, Any]] = []
        with router_rig(kind) as rig:
            relayers = {"router": rig.router.url} | ({"bare relay": rig.bare.url} if rig.bare else {})
            for (size, mode), body in bodies.items():
                for name, url in relayers.items():
                    if not relays(rig, body.text, mode == "streaming", url):
                        raise CtxfuseError(
                            f"the {name} does not relay the {kind} backend's {mode} answer ({size} tokens)"
                        )
            for size in opts.prompt_tokens:
                row = {mode: _compare(rig, bodies[size, mode], mode, opts) for mode, _ in MODES}
                rows.append({"prompt_tokens_asked": size, **row})
        result[kind] = rows
    result["all_aims_met"] = all(
        met
        for kind in opts.kinds
        for row in result[kind]
        for mode, _ in MODES
        for met in row[mode]["aims_met"].values()
    )
    return result
