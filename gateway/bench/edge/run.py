"""The edge bench's measurements: bytes on the link per request, then the latency the agent adds.
Prints nothing; returns the figures (cli.py prints them)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import httpx
import msgspec

from cloud.bench.report import say
from cloud.bench.structured_results import Spread, spread
from cloud.model.registry import fetch
from cloud.model.tokenizer import Tokenizer
from gateway.bench.edge.document import document, questions
from gateway.bench.edge.rig import Rig, rig
from gateway.bench.fake_engine import MODEL_NAME
from shared.chunking import digest, split
from shared.errors import CtxfuseError

ROUTE = "/v1/chat/completions"
MAX_TOKENS = 16
AIM_FEWER = 0.95  # from the second request on, at least this much fewer bytes than plain JSON
AIM_ADDED_P50_MS = 5.0
ENGINE = (
    "the instant fake engine (gateway/bench/fake_engine.py): no model, five tokens per answer; the "
    "engine's time is not what is measured"
)
NETWORK = (
    "loopback; the gateway in its own process, the agent and the client in this one: the agent's added "
    "latency includes its own HTTP hop, chunking and hashing, msgpack, TLS, and the gateway putting the "
    "text back"
)


@dataclass(frozen=True, slots=True)
class EdgeBenchOptions:
    tokens: int = 16_384  # document size, counted with the default model's tokenizer
    questions: int = 10  # asked about the document through the agent, one request each
    latency_requests: int = 200  # timed requests per path and case
    warmup: int = 20  # untimed requests per path and case first
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1024:
            raise ValueError(
                f"--tokens must be at least 1024 (the agent chunks strings of 2 KiB up), not {self.tokens}"
            )
        if self.questions < 2:
            raise ValueError(
                f"--questions must be at least 2 (a first request and a later one), not {self.questions}"
            )
        if self.latency_requests < 1 or self.warmup < 0:
            raise ValueError("--latency-requests must be at least 1 and --warmup at least 0")


@dataclass(frozen=True, slots=True)
class DocumentFigures:
    tokens: int
    bytes: int  # UTF-8
    chunks: int  # content-defined chunks of the document alone
    distinct_chunks: int
    distinct_share: float  # bytes in first occurrences of chunks / all bytes


@dataclass(frozen=True, slots=True)
class RequestBytes:
    question: str
    plain_bytes: int  # the OpenAI JSON body an app would send straight to the gateway
    link_bytes: int  # the agent's msgpack bodies on the link (a 409 retry would count twice)
    fewer: float  # 1 - link / plain


@dataclass(frozen=True, slots=True)
class WireFigures:
    document: DocumentFigures
    requests: list[RequestBytes]  # in the order sent; the first carries the document
    first_compression: float  # plain / link bytes of the first request
    later_fewer_min: float
    later_fewer_mean: float
    aim_met: bool  # every later request at least AIM_FEWER fewer bytes


@dataclass(frozen=True, slots=True)
class LatencyCase:
    name: str
    body_bytes: int  # the largest JSON body of the case
    direct_ms: Spread  # app -> gateway's plain-HTTP listener
    agent_ms: Spread  # app -> agent -> mutual TLS -> gateway's edge listener
    added_p50_ms: float
    added_p99_ms: float


@dataclass(frozen=True, slots=True)
class Report:
    options: EdgeBenchOptions
    engine: str
    network: str
    wire: WireFigures
    latency: list[LatencyCase]
    aims: list[str]  # each aim of the issue and whether this run meets it


def chat_body(prompt: str) -> bytes:
    """What an app sends: compact UTF-8 JSON, the same bytes to the agent and to the gateway."""
    messages = [{"role": "user", "content": prompt}]
    return msgspec.json.encode({"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS})


def _post(client: httpx.Client, base_url: str, body: bytes) -> float:
    """Seconds from sending `body` to the last byte of a 200 response."""
    start = time.perf_counter()
    resp = client.post(base_url + ROUTE, content=body, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - start
    if resp.status_code != 200:
        raise CtxfuseError(f"the bench request to {base_url} failed ({resp.status_code}): {resp.text[:300]}")
    return elapsed


def _document_figures(doc: str, tokens: int) -> DocumentFigures:
    data = doc.encode("utf-8")
    pieces = split(data)
    first: dict[bytes, int] = {}
    for p in pieces:
        first.setdefault(digest(p), len(p))
    return DocumentFigures(tokens, len(data), len(pieces), len(first), sum(first.values()) / len(data))


def _wire(r: Rig, client: httpx.Client, doc: str, asked: list[str], tokens: int) -> WireFigures:
    sent = []
    for q in asked:
        body = chat_body(f"{doc}\n\nQuestion: {q}")
        before = r.agent.uplink.uploaded_bytes
        _post(client, r.agent_url, body)
        link = r.agent.uplink.uploaded_bytes - before
        sent.append(RequestBytes(q, len(body), link, 1 - link / len(body)))
    later = [s.fewer for s in sent[1:]]
    return WireFigures(
        document=_document_figures(doc, tokens),
        requests=sent,
        first_compression=sent[0].plain_bytes / sent[0].link_bytes,
        later_fewer_min=min(later),
        later_fewer_mean=sum(later) / len(later),
        aim_met=min(later) >= AIM_FEWER,
    )


def _latency(
    r: Rig, client: httpx.Client, cases: dict[str, list[bytes]], opts: EdgeBenchOptions
) -> list[LatencyCase]:
    """Both paths and all cases in turn, request by request, so that load from anything else on the
    machine falls on all of them alike; which path goes first alternates."""
    paths = [r.gateway_url, r.agent_url]
    times: dict[tuple[str, str], list[float]] = {(c, p): [] for c in cases for p in paths}
    gc.collect()
    for i in range(opts.warmup + opts.latency_requests):
        for case, bodies in cases.items():
            body = bodies[i % len(bodies)]
            for path in paths if i % 2 == 0 else paths[::-1]:
                elapsed = _post(client, path, body)
                if i >= opts.warmup:
                    times[case, path].append(elapsed)
    out = []
    for case, bodies in cases.items():
        direct, agent = spread(times[case, r.gateway_url], 1e3), spread(times[case, r.agent_url], 1e3)
        out.append(
            LatencyCase(
                case, max(map(len, bodies)), direct, agent, agent.p50 - direct.p50, agent.p99 - direct.p99
            )
        )
    return out


def _aims(wire: WireFigures, latency: list[LatencyCase]) -> list[str]:
    added = max(c.added_p50_ms for c in latency)
    cases = ", ".join(f"{c.name} +{c.added_p50_ms:.2f} ms" for c in latency)
    return [
        f"from the second request on, at least {AIM_FEWER:.0%} fewer bytes on the link: "
        f"{'met' if wire.aim_met else 'NOT met'} (least {wire.later_fewer_min:.1%} fewer)",
        f"the agent adds under {AIM_ADDED_P50_MS:g} ms p50: "
        f"{'met' if added < AIM_ADDED_P50_MS else 'NOT met'} ({cases})",
    ]


def run(opts: EdgeBenchOptions) -> Report:
    say("counting tokens with the default model's tokenizer ...")
    tokenizer = Tokenizer.from_gguf(fetch(quiet=True))
    doc = document(tokenizer, opts.tokens, opts.seed)
    tokens = len(tokenizer.encode(doc))
    asked = questions(opts.questions, opts.seed)
    with rig() as r, httpx.Client(timeout=60) as client:
        say(f"bytes: a {tokens}-token document, {len(asked)} questions through the agent ...")
        wire = _wire(r, client, doc, asked, tokens)
        # the document's chunks are now held by the gateway (and known held by the agent)
        cases = {
            "short prompt": [chat_body(q) for q in asked],
            f"{tokens:,}-token document, held by the gateway": [
                chat_body(f"{doc}\n\nQuestion: {q}") for q in asked
            ],
        }
        n = opts.warmup + opts.latency_requests
        say(f"latency: {n} requests per path and case ({opts.warmup} warm-up), interleaved ...")
        latency = _latency(r, client, cases, opts)
    return Report(opts, ENGINE, NETWORK, wire, latency, _aims(wire, latency))
