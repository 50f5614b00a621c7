"""Images for a text-only model: each `image_features` part becomes a tagged text block the model
can read (its labels with probabilities, and the text OCR found), and the blocks are located in the
prompt's tokens so the image's content hash can enter those blocks' prefix-cache hashes.

The embedding is not rendered: it is for models with a vision adapter.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from shared.engine_types import ImageSpan
from shared.image_features import ImageFeatures


def render_image(f: ImageFeatures) -> str:
    labels = ", ".join(f"{lab.label} ({lab.prob:.0%})" for lab in f.labels)
    lines = [f"<image width={f.width} height={f.height}>", f"It shows: {labels}."]
    if f.ocr_text:
        lines += ["Text in the image:", f.ocr_text]
    lines.append("</image>")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class RenderedImage:
    text: str
    digest: bytes


def flatten_content(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[RenderedImage]]:
    """Messages whose content is a list of parts (text and image_features) with that content as one
    string, parts joined by newlines; and the rendered images in prompt order."""
    images: list[RenderedImage] = []
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        texts = []
        for part in content:
            if part["type"] == "image_features":
                f: ImageFeatures = part["image_features"]
                rendered = RenderedImage(render_image(f), bytes.fromhex(f.sha256))
                images.append(rendered)
                texts.append(rendered.text)
            else:
                texts.append(part["text"])
        out.append({**m, "content": "\n".join(texts)})
    return out, images


def locate_images(
    prompt: str, offsets: list[tuple[int, int]], images: list[RenderedImage]
) -> list[ImageSpan]:
    """Token spans of the rendered images in `prompt` (`offsets`: each token's character span). An
    image the template altered past finding is taken to span the whole prompt: less sharing, never
    a wrong one."""
    ends = [end for _, end in offsets]
    starts = [start for start, _ in offsets]
    spans, pos = [], 0
    for image in images:
        at = prompt.find(image.text, pos)
        if at < 0:
            spans.append(ImageSpan(0, len(offsets), image.digest))
            continue
        pos = at + len(image.text)
        first = bisect.bisect_right(ends, at)  # the first token ending after the block starts
        last = bisect.bisect_left(starts, pos)  # the first token starting at or after its end
        spans.append(ImageSpan(first, max(last, first + 1), image.digest))
    return spans
