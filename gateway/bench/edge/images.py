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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

import httpx
import msgspec
import numpy as np
from PIL import Image

from cloud.bench.structured_results import Spread, say, spread
from cloud.model.registry import fetch
from cloud.model.tokenizer import Tokenizer
from edge.config import EdgeConfig
from edge.vision.document import looks_like_document
from edge.vision.encoder import Encoded, ImageEncoder, Precision, dequantize_embedding
from edge.vision.features import ImagePipeline, VisionOptions
from edge.vision.model_files import ensure
from edge.vision.ocr import OcrReader
from gateway.bench.fake_engine import MODEL_NAME
from shared.batch_protocol import Batch, FileObject
from shared.chunking import chunk_boundaries, reference_boundaries
from shared.errors import CtxfuseError

from .document import document
from .pictures import crossword, document_page, encoded, photo, traffic_light
from .rig import Rig, rig
from .run import ENGINE, MAX_TOKENS, chat_body

THREADS = 1  # onnxruntime intra-op threads: one small device core
PRECISIONS: tuple[Precision, Precision] = ("fp32", "int8")
JPEG_QUALITY = 90
AIM_PHOTO_RATIO = 50.0  # a one-megapixel photo at least this many times smaller on the link
POLL_S, POLL_MAX_S = 0.05, 0.25  # the rig's agent looks at forwarded batches this often (EdgeConfig)
CLIENT_POLL_S = 0.01  # how often the bench asks the agent whether its batches are done
BATCH_TIMEOUT_S = 120.0
_TERMINAL = ("completed", "failed", "expired", "cancelled")
_In = TypeVar("_In")
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
    ocr_reads: int = 3  # timed OCR reads of the document page after the first (which loads the models)
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
    cosine_mean: float  # of the dequantized embeddings, fp32 against int8
    cosine_min: float


@dataclass(frozen=True, slots=True)
class ChunkingFigures:
    tokens: int  # the bench's document (document.py)
    bytes: int  # its UTF-8
    chunks: int
    agree: bool  # chunk_boundaries gave the reference's boundaries
    numpy_ms: Spread  # shared.chunking.chunk_boundaries of the whole document
    reference_ms: Spread  # reference_boundaries, the per-byte loop, on the same bytes
    numpy_mb_s: float  # bytes / p50, in 1e6 bytes per second
    reference_mb_s: float
    speedup: float  # reference p50 / numpy p50


@dataclass(frozen=True, slots=True)
class DocumentTestTime:
    name: str  # one of the pictures sent over the link (_cases)
    width: int
    height: int
    document: bool  # what looks_like_document said
    ms: Spread  # edge.vision.document.looks_like_document of the decoded RGB image


@dataclass(frozen=True, slots=True)
class OcrFigures:
    width: int  # the document page
    height: int
    first_ms: float  # a fresh OcrReader's first read: loads the detector and recogniser, then reads
    warm_ms: Spread  # the reads after it
    chars: int  # of the text read (the same every read)


@dataclass(frozen=True, slots=True)
class CpuCosts:
    chunking: ChunkingFigures
    document_test: list[DocumentTestTime]  # photo, drawing, page
    ocr: OcrFigures


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
    return EncoderFigures(
        threads=THREADS,
        times=times,
        encoder_speedup=fp32.encoder_ms.p50 / int8.encoder_ms.p50,
        pipeline_speedup=fp32.pipeline_ms.p50 / int8.pipeline_ms.p50,
        pictures=len(pairs),
        top1_agreement=sum(a.labels[0].label == b.labels[0].label for a, b in pairs) / len(pairs),
        cosine_mean=sum(cosines) / len(cosines),
        cosine_min=min(cosines),
    )


# --- 2. the agent's other CPU costs: chunking, the document test, OCR -------------------------------


def _timed(fn: Callable[[_In], object], arg: _In) -> float:
    """Seconds of one fn(arg)."""
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


def _chunking(data: bytes, tokens: int, repeats: int) -> ChunkingFigures:
    """The numpy fast path and its per-byte reference in turn (which goes first alternating), one
    untimed round first."""
    paths: dict[str, Callable[[bytes], list[int]]] = {
        "numpy": chunk_boundaries,
        "reference": reference_boundaries,
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    gc.collect()
    for i in range(1 + repeats):
        for name in paths if i % 2 == 0 else list(paths)[::-1]:
            elapsed = _timed(paths[name], data)
            if i > 0:
                times[name].append(elapsed)
    cuts = chunk_boundaries(data)
    fast, ref = spread(times["numpy"], 1e3), spread(times["reference"], 1e3)
    return ChunkingFigures(
        tokens=tokens,
        bytes=len(data),
        chunks=len(cuts),
        agree=cuts == reference_boundaries(data),
        numpy_ms=fast,
        reference_ms=ref,
        numpy_mb_s=len(data) / fast.p50 / 1e3,  # bytes per ms / 1e3 = 1e6 bytes per second
        reference_mb_s=len(data) / ref.p50 / 1e3,
        speedup=ref.p50 / fast.p50,
    )


def _document_test(repeats: int, seed: int) -> list[DocumentTestTime]:
    """looks_like_document on each picture of the link cases, picture by picture in turn."""
    cases = _cases(seed)
    times: list[list[float]] = [[] for _ in cases]
    gc.collect()
    for i in range(1 + repeats):
        for k, (_, img, _, _) in enumerate(cases):
            elapsed = _timed(looks_like_document, img)
            if i > 0:
                times[k].append(elapsed)
    return [
        DocumentTestTime(name, *img.size, looks_like_document(img), spread(t, 1e3))
        for (name, img, _, _), t in zip(cases, times, strict=True)
    ]


def _ocr(reads: int, seed: int) -> OcrFigures:
    page = document_page(seed=seed)
    reader = OcrReader()  # as the agent's pipeline makes it
    gc.collect()
    first = _timed(reader.read, page)
    warm = [_timed(reader.read, page) for _ in range(reads)]
    chars = len(reader.read(page))  # untimed
    return OcrFigures(*page.size, first_ms=first * 1e3, warm_ms=spread(warm, 1e3), chars=chars)


def _costs(opts: ImageBenchOptions) -> CpuCosts:
    say("chunking: counting the document's tokens with the default model's tokenizer ...")
    tokenizer = Tokenizer.from_gguf(fetch(quiet=True))
    doc = document(tokenizer, opts.tokens, opts.seed)
    data = doc.encode("utf-8")
    say(f"chunking: {opts.cost_repeats} rounds of numpy and reference on {len(data):,} bytes ...")
    chunking = _chunking(data, len(tokenizer.encode(doc)), opts.cost_repeats)
    say(f"document test: {opts.cost_repeats} rounds over a photo, a drawing and a page ...")
    tested = _document_test(opts.cost_repeats, opts.seed)
    say(f"OCR: the document page, a first read (loads the models) and {opts.ocr_reads} more ...")
    return CpuCosts(chunking, tested, _ocr(opts.ocr_reads, opts.seed))


# --- 3. bytes on the link ----------------------------------------------------------------------------


def _cases(seed: int) -> list[tuple[str, Image.Image, str, dict[str, object]]]:
    return [
        ("1-megapixel photo, JPEG q90", photo(1000, 1000, seed), "JPEG", {"quality": JPEG_QUALITY}),
        ("640x480 drawing, PNG", traffic_light(480).resize((640, 480)), "PNG", {}),
        ("document page 1240x1754, PNG", document_page(seed=seed), "PNG", {}),
    ]


def _link(r: Rig, client: httpx.Client, seed: int) -> list[ImageBytes]:
    if r.agent.images is None:  # loaded by the agent app's startup; without it images travel whole
        raise CtxfuseError("the rig's agent started without its image pipeline")
    out = []
    for name, img, fmt, kw in _cases(seed):
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
    costs = _costs(opts)
    say("starting the rig (the agent loads its image pipeline) ...")
    with rig(_fast_polls) as r, httpx.Client(timeout=120) as client:
        say("bytes: a photo, a drawing and a document page (OCR) through the agent ...")
        link = _link(r, client, opts.seed)
        say(f"outbox: {opts.batches} batches of {opts.batch_requests} requests through the agent ...")
        box = _outbox(r, client, opts)
    return ImageReport(opts, ENGINE, NETWORK, enc, costs, link, box, _aims(link))
