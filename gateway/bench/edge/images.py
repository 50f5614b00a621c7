"""The edge bench's image mode (`ctxfuse bench edge --images`): the encoder's latency on the device in
fp32 and INT8 side by side, the agent's other CPU costs (content-defined chunking, numpy against its
per-byte reference; the document test; OCR), the bytes an image costs on the link against the image
itself, and the batch outbox's throughput. Prints nothing but progress; returns the figures
(images_cli.py prints them).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import httpx
import msgspec
import numpy as np

from cloud.bench.report import say
from cloud.bench.structured_results import Spread, spread
from edge.config import EdgeConfig
from edge.vision.document import looks_like_document
from edge.vision.encoder import Encoded, ImageEncoder, Precision, dequantize_embedding
from edge.vision.features import ImagePipeline, VisionOptions
from edge.vision.model_files import ensure
from gateway.bench.edge.costs import CpuCosts, cpu_costs
from gateway.bench.edge.pictures import JPEG_QUALITY, crossword, encoded, link_pictures, photo, traffic_light
from gateway.bench.edge.rig import Rig, rig
from gateway.bench.edge.run import ENGINE, MAX_TOKENS, chat_body
from gateway.bench.fake_engine import MODEL_NAME
from shared.batch_protocol import Batch, FileObject
from shared.errors import CtxfuseError

THREADS = 1  # onnxruntime intra-op threads: one small device core
PRECISIONS: tuple[Precision, Precision] = ("fp32", "int8")
CLEAR_RATIO = 1.65  # a logit gap of 0.5 between fp32's first and second class
AIM_PHOTO_RATIO = 50.0  # a one-megapixel photo at least this many times smaller on the link
POLL_S, POLL_MAX_S = 0.05, 0.25  # the rig's agent looks at forwarded batches this often (EdgeConfig)
CLIENT_POLL_S = 0.01  # how often the bench asks the agent whether its batches are done
BATCH_TIMEOUT_S = 120.0
_TERMINAL = ("completed", "failed", "expired", "cancelled")
NETWORK = (
    "the encoder and CPU-cost timings run in this process alone, before the rig starts; link bytes "
    "and batches go over loopback: the gateway in its own process, the agent and the client in this "
    "one, mutual TLS between them"
)


@dataclass(frozen=True, slots=True)
class ImageBenchOptions:
    image_requests: int = 200  # timed encodes per precision and case
    warmup: int = 20  # untimed encodes per precision and case first
    batches: int = 50  # batches put through the agent's outbox
    batch_requests: int = 10  # chat requests in each batch's input file
    tokens: int = 16_384  # the chunked document, as the text bench's (counted by the same tokenizer)
    cost_repeats: int = 20  # timed rounds of chunking and of the document test, after one untimed
    # timed OCR reads of the page after the first (which loads the models); a second or more each on
    # a small CPU, so few
    ocr_reads: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.image_requests < 1 or self.warmup < 0:
            raise ValueError("--image-requests must be at least 1 and --warmup at least 0")
        if self.tokens < 1024 or self.cost_repeats < 1 or self.ocr_reads < 1:
            raise ValueError("--tokens must be at least 1024, --cost-repeats and --ocr-reads at least 1")
        if self.batches < 1 or self.batch_requests < 1:
            raise ValueError("--batches and --batch-requests must be at least 1")


@dataclass(frozen=True, slots=True)
class PrecisionTimes:
    precision: str
    encoder_ms: Spread  # ImageEncoder.encode of a 224x224 picture: resize, crop, model, projection
    pipeline_ms: Spread  # a one-megapixel JPEG's bytes to features: decode, encode, document test


@dataclass(frozen=True, slots=True)
class EncoderFigures:
    threads: int
    times: list[PrecisionTimes]  # fp32, then int8
    encoder_speedup: float  # fp32 p50 / int8 p50 of the encoder alone
    pipeline_speedup: float  # the same for the whole pipeline
    pictures: int  # distinct pictures the two precisions are compared on
    top1_agreement: float  # share of them given the same top label
    # fp32 near-ties (two classes within a few percent) may flip under any rounding; a clear answer may not
    clear_pictures: int  # those whose fp32 top-1 is at least CLEAR_RATIO times its runner-up
    clear_top1_agreement: float  # share of those given the same top label
    top1_in_fp32_top5: float  # share of all whose int8 top label is among fp32's top five
    cosine_mean: float  # of the dequantized embeddings, fp32 against int8
    cosine_min: float


@dataclass(frozen=True, slots=True)
class ImageBytes:
    name: str
    width: int
    height: int
    format: str
    ocr: bool  # the picture looks like a document, so its features carry OCR text
    raw_bytes: int  # the image file
    plain_bytes: int  # the OpenAI JSON body with the image as a base64 data URL
    link_bytes: int  # the agent's msgpack body on the link, features in place of the image
    ratio: float  # raw / link


@dataclass(frozen=True, slots=True)
class OutboxFigures:
    batches: int
    requests_per_batch: int
    file_bytes: int  # one batch's JSONL input
    accept_ms: Spread  # one batch: file upload and batch create, answered by the agent
    accepted_per_s: float  # batches / wall time of accepting them all, one after another
    end_to_end_s: float  # first upload to the last batch read completed at the agent, results held
    completed: int  # batches that ended "completed"
    result_lines: int  # output lines read back from the agent, all batches
    poll_s: float  # the agent's EdgeConfig.poll_s / poll_max_s for this run
    poll_max_s: float


@dataclass(frozen=True, slots=True)
class ImageReport:
    options: ImageBenchOptions
    engine: str
    network: str
    encoder: EncoderFigures
    costs: CpuCosts
    link: list[ImageBytes]
    outbox: OutboxFigures
    aims: list[str]


def image_body(data: bytes, fmt: str) -> bytes:
    """An app's chat request asking about one image, sent as a base64 data URL."""
    url = f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    messages = [{"role": "user", "content": content}]
    return msgspec.json.encode({"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS})


# --- 1. the encoder in fp32 and INT8 ---------------------------------------------------------------


@contextmanager
def _pipelines() -> Iterator[dict[Precision, ImagePipeline]]:
    """A pipeline per precision, each over an encoder with THREADS threads. No cache entries, so
    every call decodes and encodes."""
    files = ensure(quiet=True)
    made: dict[Precision, ImagePipeline] = {}
    for p in PRECISIONS:
        made[p] = ImagePipeline(VisionOptions(precision=p, workers=1, cache_entries=0), files)
        made[p].encoder = ImageEncoder(files, p, THREADS)
    try:
        yield made
    finally:
        for pipeline in made.values():
            asyncio.run(pipeline.close())


def _cosine(a: Encoded, b: Encoded) -> float:
    x, y = dequantize_embedding(a.embedding, a.scale), dequantize_embedding(b.embedding, b.scale)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def _agreement(pairs: list[tuple[Encoded, Encoded]]) -> float:
    """Share of (fp32, int8) pairs with the same top label (1.0 for none)."""
    return sum(a.labels[0].label == b.labels[0].label for a, b in pairs) / len(pairs) if pairs else 1.0


def _encoder(opts: ImageBenchOptions) -> EncoderFigures:
    small = [traffic_light(), crossword(), *(photo(224, 224, opts.seed + k) for k in range(4))]
    photos = [photo(1000, 1000, opts.seed + k) for k in range(4)]
    jpegs = [encoded(p, "JPEG", quality=JPEG_QUALITY) for p in photos]
    enc_t: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    pipe_t: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    with _pipelines() as pipes:
        gc.collect()
        # image by image, both precisions in turn (the first alternating), so that load from anything
        # else on the machine falls on both alike
        for i in range(opts.warmup + opts.image_requests):
            order = PRECISIONS if i % 2 == 0 else PRECISIONS[::-1]
            for p in order:
                start = time.perf_counter()
                pipes[p].encoder.encode(small[i % len(small)])
                enc_t[p].append(time.perf_counter() - start)
            for p in order:
                start = time.perf_counter()
                pipes[p].features(jpegs[i % len(jpegs)], "auto", "bench")
                pipe_t[p].append(time.perf_counter() - start)
        pairs = [
            (pipes["fp32"].encoder.encode(im), pipes["int8"].encoder.encode(im)) for im in small + photos
        ]
    times = [
        PrecisionTimes(p, spread(enc_t[p][opts.warmup :], 1e3), spread(pipe_t[p][opts.warmup :], 1e3))
        for p in PRECISIONS
    ]
    fp32, int8 = times
    cosines = [_cosine(a, b) for a, b in pairs]
    clear = [(a, b) for a, b in pairs if a.labels[0].prob >= CLEAR_RATIO * a.labels[1].prob]
    return EncoderFigures(
        threads=THREADS,
        times=times,
        encoder_speedup=fp32.encoder_ms.p50 / int8.encoder_ms.p50,
        pipeline_speedup=fp32.pipeline_ms.p50 / int8.pipeline_ms.p50,
        pictures=len(pairs),
        top1_agreement=_agreement(pairs),
        clear_pictures=len(clear),
        clear_top1_agreement=_agreement(clear),
        top1_in_fp32_top5=sum(b.labels[0].label in {x.label for x in a.labels} for a, b in pairs)
        / len(pairs),
        cosine_mean=sum(cosines) / len(cosines),
        cosine_min=min(cosines),
    )


# --- 2. bytes on the link (the agent's other CPU costs are in costs.py) -----------------------------------


def _link(r: Rig, client: httpx.Client, seed: int) -> list[ImageBytes]:
    if r.agent.images is None:  # loaded by the agent app's startup; without it images travel whole
        raise CtxfuseError("the rig's agent started without its image pipeline")
    out = []
    for name, img, fmt, kw in link_pictures(seed):
        data = encoded(img, fmt, **kw)
        body = image_body(data, fmt)
        before = r.agent.uplink.uploaded_bytes
        resp = client.post(
            r.agent_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        _checked(resp, f"the chat request with the {name}")
        link = r.agent.uplink.uploaded_bytes - before
        ocr = looks_like_document(img)
        out.append(ImageBytes(name, *img.size, fmt, ocr, len(data), len(body), link, len(data) / link))
    return out


# --- 4. the batch outbox -------------------------------------------------------------------------------


def _jsonl(batch: int, n: int) -> bytes:
    """One batch's input file: n short chat requests, as an app would write them."""
    lines = [
        msgspec.json.encode(
            {
                "custom_id": f"b{batch}-r{k}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": msgspec.Raw(chat_body(f"Batch {batch}, request {k}: say hello.")),
            }
        )
        for k in range(n)
    ]
    return b"\n".join(lines) + b"\n"


def _checked(resp: httpx.Response, what: str) -> bytes:
    if resp.status_code != 200:
        raise CtxfuseError(f"{what} at the agent failed ({resp.status_code}): {resp.text[:300]}")
    return resp.content


def _accept(client: httpx.Client, url: str, content: bytes, k: int) -> str:
    """Upload one batch's input file and create the batch; the agent's batch id."""
    up = client.post(
        url + "/v1/files",
        files={"file": (f"bench-{k}.jsonl", content, "application/jsonl")},
        data={"purpose": "batch"},
    )
    file_id = msgspec.json.decode(_checked(up, "the file upload"), type=FileObject).id
    req = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    made = client.post(url + "/v1/batches", json=req)
    return msgspec.json.decode(_checked(made, "the batch create"), type=Batch).id


def _until_done(client: httpx.Client, url: str, ids: list[str]) -> dict[str, Batch]:
    done: dict[str, Batch] = {}
    deadline = time.monotonic() + BATCH_TIMEOUT_S
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            raise CtxfuseError(f"{len(ids) - len(done)} batches not done after {BATCH_TIMEOUT_S:.0f} s")
        for i in ids:
            if i not in done:
                b = msgspec.json.decode(
                    _checked(client.get(f"{url}/v1/batches/{i}"), "a batch look"), type=Batch
                )
                if b.status in _TERMINAL:
                    done[i] = b
        time.sleep(CLIENT_POLL_S)
    return done


def _outbox(r: Rig, client: httpx.Client, opts: ImageBenchOptions) -> OutboxFigures:
    files = [_jsonl(k, opts.batch_requests) for k in range(opts.batches)]
    accept: list[float] = []
    start = time.perf_counter()
    ids = []
    for k, content in enumerate(files):
        t = time.perf_counter()
        ids.append(_accept(client, r.agent_url, content, k))
        accept.append(time.perf_counter() - t)
    accepted = time.perf_counter() - start
    done = _until_done(client, r.agent_url, ids)
    end_to_end = time.perf_counter() - start
    lines = 0
    for b in done.values():
        if b.output_file_id is not None:
            out = client.get(f"{r.agent_url}/v1/files/{b.output_file_id}/content")
            lines += len(_checked(out, "a result file").splitlines())
    return OutboxFigures(
        batches=opts.batches,
        requests_per_batch=opts.batch_requests,
        file_bytes=len(files[0]),
        accept_ms=spread(accept, 1e3),
        accepted_per_s=opts.batches / accepted,
        end_to_end_s=end_to_end,
        completed=sum(b.status == "completed" for b in done.values()),
        result_lines=lines,
        poll_s=POLL_S,
        poll_max_s=POLL_MAX_S,
    )


# --- the run -------------------------------------------------------------------------------------------


def _fast_polls(config: EdgeConfig) -> EdgeConfig:
    return replace(config, poll_s=POLL_S, poll_max_s=POLL_MAX_S)


def _aims(link: list[ImageBytes]) -> list[str]:
    ph = link[0]
    met = "met" if ph.ratio >= AIM_PHOTO_RATIO else "NOT met"
    return [
        f"a one-megapixel photo at least {AIM_PHOTO_RATIO:g}x smaller on the link than the image: "
        f"{met} ({ph.raw_bytes:,} -> {ph.link_bytes:,} bytes, {ph.ratio:.0f}x)"
    ]


def run(opts: ImageBenchOptions) -> ImageReport:
    n = opts.warmup + opts.image_requests
    say(f"encoder: {n} images per precision and case ({opts.warmup} warm-up), {THREADS} thread ...")
    enc = _encoder(opts)
    costs = cpu_costs(opts.tokens, opts.cost_repeats, opts.ocr_reads, opts.seed)
    say("starting the rig (the agent loads its image pipeline) ...")
    with rig(_fast_polls) as r, httpx.Client(timeout=120) as client:
        say("bytes: a photo, a drawing and a document page (OCR) through the agent ...")
        link = _link(r, client, opts.seed)
        say(f"outbox: {opts.batches} batches of {opts.batch_requests} requests through the agent ...")
        box = _outbox(r, client, opts)
    return ImageReport(opts, ENGINE, NETWORK, enc, costs, link, box, _aims(link))
