"""Pictures drawn with Pillow for the image bench and the tests: clear synthetic images the encoder
recognises, a photo-like camera frame, a page of text, and a way to encode them."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

_PHRASES = (
    "the invoice total",
    "payment due within thirty days",
    "of receipt",
    "delivery address and account number",
    "unit price per item",
    "tax net and gross amount",
    "order shipped to the supplier",
    "reference as above",
)


def traffic_light(size: int = 224) -> Image.Image:
    """A three-lamp signal on a sky: EfficientNet-Lite0 calls it "traffic light"."""
    img = Image.new("RGB", (224, 224), (135, 190, 235))
    draw = ImageDraw.Draw(img)
    draw.rectangle([80, 20, 144, 204], fill=(30, 30, 30))
    for k, colour in enumerate([(230, 20, 20), (240, 200, 0), (20, 200, 60)]):
        draw.ellipse([90, 28 + 60 * k, 134, 72 + 60 * k], fill=colour)
    return img.resize((size, size), Image.Resampling.BICUBIC) if size != 224 else img


def crossword(size: int = 224) -> Image.Image:
    img = Image.new("RGB", (224, 224), "white")
    draw = ImageDraw.Draw(img)
    for i in range(0, 224, 28):
        for j in range(0, 224, 28):
            if (i // 28 + j // 28) % 2 == 0 or (i * j) % 3 == 0:
                draw.rectangle([i, j, i + 27, j + 27], fill="black")
    return img.resize((size, size), Image.Resampling.NEAREST) if size != 224 else img


def photo(width: int = 1000, height: int = 1000, seed: int = 0) -> Image.Image:
    """A photo-like image (smooth colour fields, blobs, sensor noise): a one-megapixel JPEG of it is
    a few hundred KB, as a camera frame is."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32) / max(width, height)
    img = np.stack(
        [0.5 + 0.35 * np.sin(3 * (a * xx + b * yy) + c) for a, b, c in rng.uniform(-2, 2, (3, 3))], -1
    )
    for _ in range(6):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.25)
        mask = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))[..., None]
        img = img * (1 - mask) + mask * rng.uniform(0, 1, 3)
    img += rng.normal(0, 0.05, img.shape)
    return Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8))


def document_page(width: int = 1240, height: int = 1754, seed: int = 0) -> Image.Image:
    """A scanned-page look: black lines of words on white (A4 at 150 dpi by default), which the
    agent's document test sends to OCR."""
    rng = np.random.default_rng(seed)
    font_px = max(12, width // 50)  # ~25 px at 1240 wide: 12 pt text at 150 dpi
    font = _font(font_px)
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    margin, step = width // 12, font_px * 2
    draw.text((margin, margin), f"Invoice {int(rng.integers(1000, 9999))}", fill="black", font=font)
    for n, top in enumerate(range(margin + 2 * step, height - margin, step)):
        line = f"{n + 1}."
        for phrase in rng.choice(_PHRASES, int(rng.integers(2, 5))):
            if draw.textlength(f"{line} {phrase}", font=font) > width - 2 * margin:
                break  # the line is full: nothing runs off the page
            line = f"{line} {phrase}"
        draw.text((margin, top), line, fill="black", font=font)
    return img


def _font(px: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """DejaVu Sans from matplotlib (the bench extra) when installed, else Pillow's own font. Found
    without importing matplotlib, which takes a while."""
    spec = importlib.util.find_spec("matplotlib")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"
        if path.is_file():
            return ImageFont.truetype(str(path), px)
    return ImageFont.load_default(size=px)


def encoded(img: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


JPEG_QUALITY = 90  # a camera's JPEG


def link_pictures(seed: int) -> list[tuple[str, Image.Image, str, dict[str, object]]]:
    """The pictures the bench sends over the link: name, image, format and its save options."""
    return [
        ("1-megapixel photo, JPEG q90", photo(1000, 1000, seed), "JPEG", {"quality": JPEG_QUALITY}),
        ("640x480 drawing, PNG", traffic_light(480).resize((640, 480)), "PNG", {}),
        ("document page 1240x1754, PNG", document_page(seed=seed), "PNG", {}),
    ]
