"""Images that reach the gateway raw (`image_url` parts on its OpenAI port, or from an agent that
sent them as they were) become `image_features` parts here, through the agent's own pipeline
(edge/vision), so the model gets the same input whichever way an image arrived. Features an agent
already made are checked and kept."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from edge.vision.features import ImagePipeline, VisionOptions
from shared.errors import InvalidRequestError
from shared.image_features import check_features
from shared.protocol import ChatMessage, ContentPart


class Images:
    """The gateway's image pipeline, built on the first image: a text-only deployment never loads
    the encoder, and a process that sees no image pays nothing at start."""

    def __init__(self, options: VisionOptions) -> None:
        self.options = options
        self._pipeline: ImagePipeline | None = None
        self._lock = asyncio.Lock()

    async def pipeline(self) -> ImagePipeline:
        async with self._lock:
            if self._pipeline is None:
                self._pipeline = await asyncio.to_thread(ImagePipeline, self.options)
            return self._pipeline

    async def close(self) -> None:
        if self._pipeline is not None:
            await self._pipeline.close()

    async def resolve(self, messages: list[ChatMessage]) -> int:
        """Replace every image_url part with its features, in place; returns how many were made."""
        jobs: list[Coroutine[Any, Any, None]] = []
        for i, m in enumerate(messages):
            if not isinstance(m.content, list):
                continue
            for j, part in enumerate(m.content):
                param = f"messages[{i}].content[{j}]"
                if part.type == "image_features":
                    if part.image_features is None:
                        raise InvalidRequestError("an image_features part needs its features", param=param)
                    check_features(part.image_features, param)
                elif part.type == "image_url":
                    jobs.append(self._resolve_part(m.content, j, part, param))
        await asyncio.gather(*jobs)
        return len(jobs)

    async def _resolve_part(self, parts: list[ContentPart], j: int, part: ContentPart, param: str) -> None:
        if part.image_url is None:
            raise InvalidRequestError("an image_url part needs `image_url.url`", param=f"{param}.image_url")
        pipeline = await self.pipeline()
        features = await pipeline.resolve(part.image_url.url, part.image_url.detail, f"{param}.image_url.url")
        parts[j] = ContentPart(type="image_features", image_features=features)
