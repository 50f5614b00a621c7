"""The image pipeline: an image part's URL in, `ImageFeatures` out.

bytes (data: URL, or an allowed http(s) host) -> decoded under byte and pixel caps -> encoder
(labels, int8 embedding) -> OCR when the part asks for `detail: "high"` or the image looks like a
document. Results are kept by content hash and detail, since a conversation resends its images
with every turn. The agent and the gateway run this same code, so an image gives the model the
same input whichever way it arrived.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from shared.image_features import Detail, ImageFeatures

from .decode import ImageLimits, open_image, parse_data_url
from .document import looks_like_document
from .encoder import ImageEncoder, Precision
from .fetch import ImageUrlPolicy, fetch_image
from .model_files import VisionFiles, ensure
from .ocr import OcrReader

DRAFT_SIDE = 320  # px: JPEGs decode at the smallest 1/2^k scale keeping both sides at least this


@dataclass(frozen=True, slots=True)
class VisionOptions:
    max_image_bytes: int = 20 * 1024 * 1024  # as OpenAI's per-image limit
    max_image_pixels: int = 25_000_000
    allowed_image_hosts: tuple[str, ...] = ()  # http(s) image URLs are fetched only from these
    precision: Precision = "int8"
    workers: int = 2  # threads encoding images; each is one onnxruntime run at a time
    cache_entries: int = 256


class ImagePipeline:
    def __init__(self, options: VisionOptions | None = None, files: VisionFiles | None = None) -> None:
        self.options = options or VisionOptions()
        self.limits = ImageLimits(
            max_bytes=self.options.max_image_bytes, max_pixels=self.options.max_image_pixels
        )
        self.policy = ImageUrlPolicy(list(self.options.allowed_image_hosts))
        self.encoder = ImageEncoder(ensure(files, quiet=True), self.options.precision)
        self.ocr = OcrReader()
        self._pool = ThreadPoolExecutor(self.options.workers, thread_name_prefix="vision")
        self._cache: OrderedDict[tuple[str, Detail], ImageFeatures] = OrderedDict()
        self._lock = threading.Lock()
        self._client: httpx.AsyncClient | None = None

    def features(self, data: bytes, detail: Detail, param: str) -> ImageFeatures:
        """CPU work: call from a worker thread (`resolve` does)."""
        digest = hashlib.sha256(data).hexdigest()  # the image's content hash, computed once
        key = (digest, detail)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:  # checked and encoded before: no second decode
                self._cache.move_to_end(key)
                return hit
        # the encoder needs 224 px and the document check 256: a JPEG decodes at a reduced scale
        # unless OCR will read it, at full size
        draft = None if detail == "high" else DRAFT_SIDE
        image = open_image(data, self.limits, param, draft_side=draft, sha256=digest)
        enc = self.encoder.encode(image.rgb)
        ocr_text = None
        if detail == "high" or looks_like_document(image.rgb):
            if image.rgb.size != (image.width, image.height):
                image = open_image(data, self.limits, param, sha256=digest)
            ocr_text = self.ocr.read(image.rgb)
        out = ImageFeatures(
            sha256=image.sha256,
            width=image.width,
            height=image.height,
            labels=enc.labels,
            embedding=enc.embedding,
            embedding_scale=enc.scale,
            embedding_space=self.encoder.space,
            ocr_text=ocr_text,
            detail=detail,
        )
        with self._lock:
            self._cache[key] = out
            while len(self._cache) > self.options.cache_entries:
                self._cache.popitem(last=False)
        return out

    async def resolve(self, url: str, detail: Detail, param: str) -> ImageFeatures:
        """The features of the image at `url` (a data: URL, or an allowed http(s) one)."""
        if url.startswith("data:"):
            data = parse_data_url(url, self.limits, param)
        else:
            if self._client is None:
                # trust_env off: proxy variables must not reroute what the allow-list vetted
                self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False)
            data = await fetch_image(url, self.policy, self.limits, self._client, param)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.features, data, detail, param)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        self._pool.shutdown(wait=False, cancel_futures=True)
