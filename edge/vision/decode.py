"""Client image bytes -> one RGB picture, refusing anything over our size caps before it costs memory.

Invariant: no pixel buffer is allocated until the format and the header's dimensions have passed
the caps, so a few KB of compressed zeros declaring 30000x30000 is refused at the cost of parsing a
header. Every refusal is an `InvalidRequestError` naming the offending request field (`param`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import struct
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from shared.errors import InvalidRequestError

# Pillow format names we decode; the rest (TIFF, BMP, ICO, PSD...) widen the parser surface for
# formats no chat client sends.
SUPPORTED_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF"})

_DATA_URL = re.compile(r"data:image/(?:png|jpeg|jpg|webp|gif);base64,", re.IGNORECASE)

# What Pillow raises on corrupt, truncated or hostile input. DecompressionBombWarning can arrive as
# an exception when warnings are errors; the header check below refuses those sizes anyway.
_PILLOW_FAILURES = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    struct.error,
    Image.DecompressionBombError,
    Image.DecompressionBombWarning,
)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 25_000_000  # width * height
    max_side: int = 16384

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_pixels, self.max_side) <= 0:
            raise ValueError(f"image limits must be positive: {self}")


@dataclass(frozen=True, slots=True)
class DecodedImage:
    rgb: Image.Image  # mode "RGB", EXIF orientation applied; smaller than width x height if drafted
    width: int  # of the image as sent (EXIF orientation applied)
    height: int
    format: str  # Pillow's name: "PNG", "JPEG", "WEBP" or "GIF"
    sha256: str  # hex digest of the encoded bytes as the client sent them


def parse_data_url(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes of a `data:image/<png|jpeg|jpg|webp|gif>;base64,` URL.

    The declared media type is not trusted for anything: `open_image` sniffs the real format.
    """
    match = _DATA_URL.match(url)
    if match is None:
        raise InvalidRequestError(
            "image_url must be a data:image/(png|jpeg|webp|gif);base64,... URL",
            param=param,
            code="invalid_image_url",
        )
    text = url[match.end() :]
    # Refuse on length alone so an oversized upload never gets a decoded copy in memory.
    if len(text) * 3 // 4 > limits.max_bytes:
        raise image_too_large(param, limits)
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise InvalidRequestError(
            f"image_url data is not valid base64: {exc}", param=param, code="invalid_image_url"
        ) from exc


def open_image(
    data: bytes,
    limits: ImageLimits,
    param: str,
    *,
    draft_side: int | None = None,
    sha256: str | None = None,
) -> DecodedImage:
    """Decode the first frame of `data` into RGB, checking size caps from the header first.

    `draft_side`: a JPEG may be decoded at a reduced scale (1/2, 1/4, 1/8) as long as both sides stay
    at least this long; the decoder then skips most of its work (a one-megapixel photo decodes about
    four times faster at 1/2). Other formats decode whole.
    """
    if len(data) > limits.max_bytes:
        raise image_too_large(param, limits)
    try:
        with Image.open(io.BytesIO(data)) as image:
            _check_header(image, limits, param)
            width, height = image.size
            image.seek(0)  # first frame of an animated GIF/WebP
            if draft_side is not None and image.format == "JPEG":
                image.draft("RGB", (draft_side, draft_side))
            image.load()
            oriented = ImageOps.exif_transpose(image)
            if (oriented.width > oriented.height) != (image.width > image.height):
                width, height = height, width  # EXIF turned it a quarter
            rgb = _to_rgb(oriented)
            fmt = str(image.format)
    except UnidentifiedImageError as exc:
        raise _invalid(param, "the data is not a recognised image") from exc
    except Image.DecompressionBombError as exc:
        # Pillow's own guard fires inside Image.open for sizes far past ours.
        raise _too_many_pixels(param, limits, str(exc)) from exc
    except _PILLOW_FAILURES as exc:
        raise _invalid(param, f"the image could not be decoded ({type(exc).__name__}: {exc})") from exc
    return DecodedImage(
        rgb=rgb,
        width=width,
        height=height,
        format=fmt,
        sha256=sha256 or hashlib.sha256(data).hexdigest(),  # a caller that hashed first passes it
    )


def _check_header(image: Image.Image, limits: ImageLimits, param: str) -> None:
    if image.format not in SUPPORTED_FORMATS:
        raise InvalidRequestError(
            f"image format {image.format} is not supported; send PNG, JPEG, WEBP or GIF",
            param=param,
            code="unsupported_image_format",
        )
    width, height = image.size
    if width > limits.max_side or height > limits.max_side or width * height > limits.max_pixels:
        raise _too_many_pixels(param, limits, f"the image is {width}x{height}")


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB with transparency composited onto white (what a viewer shows on a light page)."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit greyscale: a plain convert would clip every value above 255 to white.
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def image_too_large(param: str, limits: ImageLimits) -> InvalidRequestError:
    """The one refusal for too many bytes, whether they came inline, fetched or raw."""
    return InvalidRequestError(
        f"image is larger than the {limits.max_bytes} byte limit",
        param=param,
        code="image_too_large",
    )


def _too_many_pixels(param: str, limits: ImageLimits, detail: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"image has too many pixels: {detail}; the limit is {limits.max_pixels} pixels "
        f"and {limits.max_side} per side",
        param=param,
        code="image_too_many_pixels",
    )


def _invalid(param: str, detail: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid image: {detail}", param=param, code="invalid_image")
