"""OCR and the document test that gates it: rendered text is read back in reading order, capped on
a row boundary; pages of text are told apart from photos, flat colour and coloured drawings."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from edge.vision import document
from edge.vision.document import looks_like_document
from edge.vision.ocr import OcrLine, OcrReader, reading_order

FONT_CANDIDATES = [
    Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"),
    # matplotlib (the bench extra) ships the same font wherever its environment lives
    Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf",
]


def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    for path in FONT_CANDIDATES:
        if path.exists():
            return ImageFont.truetype(str(path), size)
    return ImageFont.load_default(size)


def text_image(lines: list[str], size: tuple[int, int], font_px: int) -> Image.Image:
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    face = font(font_px)
    for row, line in enumerate(lines):
        draw.text((12, 10 + row * int(font_px * 1.6)), line, fill="black", font=face)
    return image


def page(size: tuple[int, int] = (1000, 1000)) -> Image.Image:
    lines = [f"Section {n}: the quick brown fox jumps over the lazy dog" for n in range(14)]
    return text_image(lines, size, 24)


def photo_like(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:600, 0:800] / 800.0
    channels = [
        120 + 100 * np.sin(3 * x + seed),
        140 + 80 * np.cos(2 * y + x),
        90 + 60 * np.sin(4 * y + seed),
    ]
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 12, (600, 800, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def coloured_shapes() -> Image.Image:
    image = Image.new("RGB", (800, 600), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((50, 50, 350, 250), fill=(220, 40, 40))
    draw.ellipse((400, 80, 750, 420), fill=(40, 90, 220))
    draw.polygon([(80, 560), (250, 300), (420, 580)], fill=(30, 170, 60))
    return image


@pytest.fixture(scope="module")
def reader() -> OcrReader:
    return OcrReader()


def test_reads_rendered_text_in_reading_order(reader: OcrReader) -> None:
    image = text_image(["Invoice total due", "Pay by Friday"], (360, 120), 24)
    rows = reader.read(image).lower().split("\n")
    assert len(rows) == 2
    # rows top to bottom, words left to right (found as substrings: the order is the point here)
    assert -1 < rows[0].find("invoice") < rows[0].find("total") < rows[0].find("due")
    assert -1 < rows[1].find("pay") < rows[1].find("friday")


def test_blank_image_reads_as_empty(reader: OcrReader) -> None:
    assert reader.read(Image.new("RGB", (200, 200), "white")) == ""


def test_output_is_capped_on_a_row_boundary(reader: OcrReader) -> None:
    image = text_image(["Invoice total due", "Pay by Friday"], (360, 120), 24)
    first = reader.read(image).split("\n")[0]
    capped = OcrReader(max_chars=len(first) + 3).read(image)
    assert capped == first


def line(text: str, top: float, bottom: float, left: float) -> OcrLine:
    return OcrLine(text=text, top=top, bottom=bottom, left=left)


def test_reading_order_joins_vertically_overlapping_lines_into_one_row() -> None:
    lines = [
        line("right", 12, 32, 300),
        line("second", 50, 70, 10),
        line("left", 10, 30, 10),
    ]
    assert reading_order(lines) == ["left right", "second"]


def test_reading_order_does_not_chain_a_slanted_row_into_the_next() -> None:
    lines = [line("a", 0, 20, 0), line("b", 8, 28, 100), line("c", 18, 38, 200)]
    # b overlaps a by more than half a line; c overlaps a by only 2 px, so it starts a row.
    assert reading_order(lines) == ["a b", "c"]


@pytest.mark.parametrize("size", [(1000, 1000), (600, 300), (1240, 1754)])
def test_page_of_text_looks_like_a_document(size: tuple[int, int]) -> None:
    assert looks_like_document(page(size))


@pytest.mark.parametrize(
    "image",
    [
        photo_like(0),
        photo_like(3),
        Image.new("RGB", (800, 600), "white"),
        Image.new("RGB", (800, 600), (200, 60, 60)),
        Image.new("RGB", (800, 600), (128, 128, 128)),
        coloured_shapes(),
    ],
    ids=["photo", "photo2", "white", "red", "grey", "shapes"],
)
def test_other_pictures_do_not_look_like_documents(image: Image.Image) -> None:
    assert not looks_like_document(image)


def test_a_large_black_area_is_not_text() -> None:
    image = Image.new("RGB", (800, 600), "white")
    ImageDraw.Draw(image).rectangle((200, 150, 500, 400), fill="black")
    assert not looks_like_document(image)


@pytest.mark.parametrize("size", [(1000, 1000), (1240, 1754), (4000, 3000)])
def test_document_check_measures_a_small_copy_whatever_the_image_size(
    size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What keeps the check cheap, held as a count: it reads one copy of at most ANALYSIS_SIDE px a
    # side, so its work does not grow with the image (and it never runs OCR). Its speed is a timing,
    # measured by the edge bench, not here.
    real = document._downscaled
    measured: list[tuple[int, int]] = []

    def recording(rgb: Image.Image) -> Image.Image:
        small = real(rgb)
        measured.append(small.size)
        return small

    monkeypatch.setattr(document, "_downscaled", recording)
    monkeypatch.setattr(OcrReader, "read", _no_ocr)
    assert looks_like_document(page(size))
    [(width, height)] = measured
    assert max(width, height) <= document.ANALYSIS_SIDE


def _no_ocr(self: OcrReader, rgb: Image.Image) -> str:
    raise AssertionError("the document check ran OCR")


def test_one_reader_serves_several_threads(reader: OcrReader) -> None:
    image = text_image(["Pay by Friday"], (300, 80), 24)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(reader.read, [image] * 3))
    assert len(set(results)) == 1 and "friday" in results[0].lower()
