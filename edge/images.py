"""The agent's side of images: every `image_url` part of an app's chat request becomes an
`image_features` part before the request leaves the device (kilobytes instead of megabytes). The
body stays the app's JSON otherwise: unknown fields travel on untouched."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, get_args

import msgspec

from shared.errors import InvalidRequestError
from shared.image_features import Detail

from .vision.features import ImagePipeline

_DETAILS = get_args(Detail)


async def replace_images(pipeline: ImagePipeline, body: Any) -> int:
    """Replace the image_url parts of a chat body in place; returns how many there were."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return 0  # not a chat body the gateway would take: it answers with the right 400
    jobs: list[Coroutine[Any, Any, None]] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                jobs.append(_replace(pipeline, content, j, part, f"messages[{i}].content[{j}]"))
    await asyncio.gather(*jobs)
    return len(jobs)


async def _replace(
    pipeline: ImagePipeline, parts: list[Any], j: int, part: dict[str, Any], param: str
) -> None:
    image_url = part.get("image_url")
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise InvalidRequestError("an image_url part needs `image_url.url`", param=f"{param}.image_url")
    url: str = image_url["url"]
    detail = image_url.get("detail", "auto")
    if detail not in _DETAILS:
        raise InvalidRequestError(
            f"image_url.detail must be one of {', '.join(_DETAILS)}", param=f"{param}.image_url.detail"
        )
    features = await pipeline.resolve(url, detail, f"{param}.image_url.url")
    # bytes stay bytes: msgpack carries the embedding raw on the edge link
    plain = msgspec.to_builtins(features, builtin_types=(bytes,))
    parts[j] = {"type": "image_features", "image_features": plain}
