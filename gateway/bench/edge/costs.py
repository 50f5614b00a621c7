"""The agent's CPU costs besides the encoder, for the image bench (`ctxfuse bench edge --images`):
content-defined chunking (the numpy path against its per-byte reference), the document test that
gates OCR, and OCR itself. Each is timed side by side in this process; nothing here is asserted on
time (tests hold the behaviour: tests/shared/test_chunking.py, tests/edge/vision/test_ocr.py)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from cloud.bench.report import say
from cloud.bench.structured_results import Spread, spread
from cloud.model.registry import fetch
from cloud.model.tokenizer import Tokenizer
from edge.vision.document import looks_like_document
from edge.vision.ocr import OcrReader
from gateway.bench.edge.document import document
from gateway.bench.edge.pictures import document_page, link_pictures
from shared.chunking import chunk_boundaries, reference_boundaries

_In = TypeVar("_In")


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
    cases = link_pictures(seed)
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
    start = time.perf_counter()
    text = reader.read(page)
    first = time.perf_counter() - start
    warm = [_timed(reader.read, page) for _ in range(reads)]
    return OcrFigures(*page.size, first_ms=first * 1e3, warm_ms=spread(warm, 1e3), chars=len(text))


def cpu_costs(tokens: int, repeats: int, ocr_reads: int, seed: int) -> CpuCosts:
    say("chunking: counting the document's tokens with the default model's tokenizer ...")
    tokenizer = Tokenizer.from_gguf(fetch(quiet=True))
    doc = document(tokenizer, tokens, seed)
    data = doc.encode("utf-8")
    say(f"chunking: {repeats} rounds of numpy and reference on {len(data):,} bytes ...")
    chunking = _chunking(data, len(tokenizer.encode(doc)), repeats)
    say(f"document test: {repeats} rounds over a photo, a drawing and a page ...")
    tested = _document_test(repeats, seed)
    say(f"OCR: the document page, a first read (loads the models) and {ocr_reads} more ...")
    return CpuCosts(chunking, tested, _ocr(ocr_reads, seed))
