"""An image as compact features: what the edge agent sends in place of the image's bytes, and what
the gateway makes of an image that reaches it raw. Both give the model the same input.

On the wire it is a content part of a chat message, beside OpenAI's `text` and `image_url` parts:
`{"type": "image_features", "image_features": {...}}`. The embedding is 128 int8 values (bytes;
base64 in JSON); multiplied by `embedding_scale` they give the projected 1280-d pooled feature of
the encoder named by `embedding_space`.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from msgspec import Struct

from .errors import InvalidRequestError

EMBED_DIM = 128
MAX_LABELS = 10
MAX_LABEL_CHARS = 100
MAX_OCR_CHARS = 16_000
_SHA256 = re.compile(r"[0-9a-f]{64}")

Detail = Literal["auto", "low", "high"]


class ImageLabel(Struct, kw_only=True):
    label: str
    prob: float


class ImageFeatures(Struct, kw_only=True, omit_defaults=True):
    sha256: str  # hex digest of the image as encoded (PNG/JPEG bytes): its content hash
    width: int
    height: int
    labels: list[ImageLabel]  # the classifier's top classes, most probable first
    embedding: bytes  # EMBED_DIM int8 values
    embedding_scale: float
    embedding_space: str  # encoder and projection: equal spaces give comparable embeddings
    ocr_text: str | None = None  # None: OCR did not run; "": it ran and found no text
    detail: Detail = "auto"


class ImageUrl(Struct, kw_only=True, forbid_unknown_fields=True):
    url: str
    detail: Detail = "auto"


def check_features(f: ImageFeatures, param: str) -> None:
    """Refuse features no encoder of ours could have produced (they reach the model as text)."""

    def bad(msg: str) -> InvalidRequestError:
        return InvalidRequestError(msg, param=f"{param}.image_features", code="invalid_image_features")

    if not _SHA256.fullmatch(f.sha256):
        raise bad("sha256 must be 64 lowercase hex digits")
    if len(f.embedding) != EMBED_DIM:
        raise bad(f"embedding must hold {EMBED_DIM} int8 values, not {len(f.embedding)}")
    if not (math.isfinite(f.embedding_scale) and f.embedding_scale > 0):
        raise bad("embedding_scale must be a positive number")
    if f.width < 1 or f.height < 1:
        raise bad("width and height must be positive")
    if len(f.labels) > MAX_LABELS:
        raise bad(f"at most {MAX_LABELS} labels")
    for lab in f.labels:
        if not 0.0 <= lab.prob <= 1.0 or not 0 < len(lab.label) <= MAX_LABEL_CHARS:
            raise bad(f"each label needs 1-{MAX_LABEL_CHARS} characters and a probability in [0, 1]")
    if f.ocr_text is not None and len(f.ocr_text) > MAX_OCR_CHARS:
        raise bad(f"ocr_text is longer than {MAX_OCR_CHARS} characters")
