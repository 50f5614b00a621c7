"""The calibration set for static INT8 quantization: seeded synthetic images spanning what devices
send (photo-like gradients with noise and blobs, drawn shapes, text pages, grids), so that each
activation's observed range covers real inputs. Generated, never downloaded: the same seed gives the
same set, so the quantized model is reproducible."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SIZE = 256
CALIBRATION_COUNT = 48
CALIBRATION_SEED = 7


def _photo(rng: np.random.Generator) -> Image.Image:
    """Smooth colour fields with blobs and sensor-like noise."""
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    img = np.zeros((SIZE, SIZE, 3), np.float32)
    for c in range(3):
        a, b, ph = rng.uniform(-1.5, 1.5, 3)
        img[..., c] = 0.5 + 0.35 * np.sin(3 * (a * xx + b * yy) + ph)
    for _ in range(rng.integers(2, 7)):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        mask = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))[..., None]
        img = img * (1 - mask) + mask * rng.uniform(0, 1, 3)
    img += rng.normal(0, 0.04, img.shape)
    return Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(0.7))


def _shapes(rng: np.random.Generator) -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE), tuple(int(v) for v in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(3, 12)):
        x0, y0 = (int(v) for v in rng.integers(0, SIZE - 20, 2))
        x1, y1 = x0 + int(rng.integers(10, 120)), y0 + int(rng.integers(10, 120))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        [draw.rectangle, draw.ellipse][int(rng.integers(2))]([x0, y0, x1, y1], fill=fill)
    return img


def _page(rng: np.random.Generator) -> Image.Image:
    """Dark strokes in lines on a light page: text as the encoder sees a scanned document."""
    img = Image.new("RGB", (SIZE, SIZE), (int(rng.integers(225, 256)),) * 3)
    draw = ImageDraw.Draw(img)
    for y in range(12, SIZE - 12, int(rng.integers(12, 22))):
        x = 12
        while x < SIZE - 30:
            w = int(rng.integers(8, 40))
            draw.text(
                (x, y), "".join(chr(int(c)) for c in rng.integers(97, 123, w // 6 + 1)), fill=(20, 20, 20)
            )
            x += w + 8
    return img


def _grid(rng: np.random.Generator) -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE), "white")
    draw = ImageDraw.Draw(img)
    step = int(rng.integers(12, 40))
    for i in range(0, SIZE, step):
        for j in range(0, SIZE, step):
            if rng.random() < 0.4:
                draw.rectangle([i, j, i + step - 1, j + step - 1], fill="black")
    return img


def calibration_images(count: int = CALIBRATION_COUNT, seed: int = CALIBRATION_SEED) -> Iterator[Image.Image]:
    rng = np.random.default_rng(seed)
    makers = (_photo, _photo, _shapes, _page, _grid)  # photos weigh double: they are most of the traffic
    for i in range(count):
        yield makers[i % len(makers)](rng)
