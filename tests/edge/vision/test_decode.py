"""Image decoding for chat requests: real PNG/JPEG/WebP/GIF bytes come out as RGB with their content
hash; oversized, bomb, corrupt and foreign-format inputs are refused with the error code a client
can act on, and size checks happen before any pixel is decoded."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import zlib

import pytest
from PIL import Image

from edge.vision.decode import DecodedImage, ImageLimits, open_image, parse_data_url
from shared.errors import InvalidRequestError

PARAM = "messages[0].content[1].image_url.url"
LIMITS = ImageLimits()


def encoded(image: Image.Image, fmt: str, **params: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return out.getvalue()


def halves(size: tuple[int, int] = (40, 20)) -> Image.Image:
    """Red left half, blue right half: orientation shows in which side is red."""
    image = Image.new("RGB", size, (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, size[0] // 2, size[1]))
    return image


def refusal(data: bytes, limits: ImageLimits = LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        open_image(data, limits, PARAM)
    assert caught.value.param == PARAM
    return caught.value


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def zero_png(width: int, height: int) -> bytes:
    """A valid 1-bit greyscale PNG of all-black pixels: megapixels in a few KB of zlib."""
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then packed zero bits
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
    )


def test_png_decodes_with_its_size_format_and_content_hash() -> None:
    data = encoded(halves(), "PNG")
    decoded = open_image(data, LIMITS, PARAM)
    assert isinstance(decoded, DecodedImage)
    assert (decoded.width, decoded.height, decoded.format) == (40, 20, "PNG")
    assert decoded.rgb.mode == "RGB" and decoded.rgb.size == (40, 20)
    assert decoded.sha256 == hashlib.sha256(data).hexdigest()
    assert decoded.rgb.getpixel((5, 10)) == (255, 0, 0)


def test_jpeg_decodes_with_its_size_format_and_content_hash() -> None:
    data = encoded(halves((64, 32)), "JPEG", quality=95)
    decoded = open_image(data, LIMITS, PARAM)
    assert (decoded.width, decoded.height, decoded.format) == (64, 32, "JPEG")
    assert decoded.sha256 == hashlib.sha256(data).hexdigest()
    red, green, blue = decoded.rgb.getpixel((8, 16))  # type: ignore[misc]
    assert red > 200 and green < 60 and blue < 60


@pytest.mark.parametrize("fmt", ["WEBP", "GIF"])
def test_webp_and_gif_decode(fmt: str) -> None:
    decoded = open_image(encoded(halves(), fmt), LIMITS, PARAM)
    assert (decoded.width, decoded.height, decoded.format) == (40, 20, fmt)
    assert decoded.rgb.mode == "RGB"


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: stored sideways, shown rotated 90 degrees clockwise
    decoded = open_image(encoded(halves(), "JPEG", quality=95, exif=exif), LIMITS, PARAM)
    assert (decoded.width, decoded.height) == (20, 40)
    top = decoded.rgb.getpixel((10, 5))
    bottom = decoded.rgb.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 60  # type: ignore[index]
    assert bottom[2] > 200 and bottom[0] < 60  # type: ignore[index]


def test_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 255, 0))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    decoded = open_image(out.getvalue(), LIMITS, PARAM)
    assert decoded.rgb.getpixel((8, 8)) == (255, 0, 0)


def test_transparent_pixels_become_white() -> None:
    image = Image.new("RGBA", (10, 10), (0, 0, 0, 0))
    image.putpixel((0, 0), (0, 128, 0, 255))
    decoded = open_image(encoded(image, "PNG"), LIMITS, PARAM)
    assert decoded.rgb.getpixel((5, 5)) == (255, 255, 255)
    assert decoded.rgb.getpixel((0, 0)) == (0, 128, 0)


def test_palette_with_a_transparent_index_becomes_white_there() -> None:
    image = Image.new("P", (10, 10), 0)
    image.putpalette([10, 20, 30, 200, 0, 0] + [0] * 762)
    image.putpixel((0, 0), 1)
    decoded = open_image(encoded(image, "PNG", transparency=0), LIMITS, PARAM)
    assert decoded.rgb.getpixel((5, 5)) == (255, 255, 255)
    assert decoded.rgb.getpixel((0, 0)) == (200, 0, 0)


@pytest.mark.parametrize(
    ("mode", "fill", "fmt", "expected"),
    [
        ("L", 100, "PNG", (100, 100, 100)),
        ("1", 1, "PNG", (255, 255, 255)),
        ("LA", (50, 255), "PNG", (50, 50, 50)),
        ("I;16", 40000, "PNG", (156, 156, 156)),  # 16-bit grey is scaled, not clipped to white
        ("CMYK", (0, 0, 0, 0), "JPEG", (255, 255, 255)),
    ],
)
def test_other_modes_convert_to_rgb(
    mode: str, fill: object, fmt: str, expected: tuple[int, int, int]
) -> None:
    decoded = open_image(encoded(Image.new(mode, (8, 8), fill), fmt), LIMITS, PARAM)  # type: ignore[arg-type]
    assert decoded.rgb.mode == "RGB"
    pixel = decoded.rgb.getpixel((4, 4))
    assert all(abs(a - b) <= 2 for a, b in zip(pixel, expected, strict=True))  # type: ignore[arg-type]


def test_header_with_too_many_pixels_is_refused_before_any_pixel_is_decoded() -> None:
    # A real 1x1 PNG whose IHDR now declares 6000x6000 (36 MP: past our cap, below Pillow's own
    # guard). Decoding would allocate 36 MB and then fail as truncated (invalid_image), so
    # image_too_many_pixels shows the refusal came from the header alone.
    data = bytearray(encoded(Image.new("L", (1, 1)), "PNG"))
    ihdr = struct.pack(">IIBBBBB", 6000, 6000, 8, 0, 0, 0, 0)
    data[8:33] = png_chunk(b"IHDR", ihdr)
    assert refusal(bytes(data)).code == "image_too_many_pixels"


@pytest.mark.parametrize(("width", "height"), [(8000, 8000), (20000, 20000)])
def test_decompression_bomb_is_refused(width: int, height: int) -> None:
    data = zero_png(width, height)
    assert len(data) < 100_000  # the point of a bomb: small on the wire
    error = refusal(data)
    assert error.code == "image_too_many_pixels"
    assert "too many pixels" in error.message


def test_side_longer_than_the_cap_is_refused() -> None:
    assert refusal(zero_png(17000, 1)).code == "image_too_many_pixels"


def test_pixel_cap_is_configurable() -> None:
    data = encoded(Image.new("RGB", (40, 30)), "PNG")
    assert refusal(data, ImageLimits(max_pixels=1000)).code == "image_too_many_pixels"
    assert refusal(data, ImageLimits(max_side=39)).code == "image_too_many_pixels"


def test_bytes_over_the_cap_are_refused() -> None:
    data = encoded(halves(), "PNG")
    assert refusal(data, ImageLimits(max_bytes=len(data) - 1)).code == "image_too_large"


def test_truncated_jpeg_is_invalid() -> None:
    data = encoded(halves((256, 256)), "JPEG", quality=90)
    error = refusal(data[: len(data) // 2])
    assert error.code == "invalid_image"


def test_truncated_png_is_invalid() -> None:
    data = encoded(Image.effect_noise((128, 128), 64), "PNG")
    assert refusal(data[: len(data) // 2]).code == "invalid_image"


def test_random_bytes_are_invalid() -> None:
    assert refusal(bytes(range(256)) * 8).code == "invalid_image"


@pytest.mark.parametrize("fmt", ["TIFF", "BMP"])
def test_other_formats_are_unsupported(fmt: str) -> None:
    error = refusal(encoded(halves(), fmt))
    assert error.code == "unsupported_image_format"
    assert fmt in error.message


@pytest.mark.parametrize("media", ["png", "jpeg", "jpg", "webp", "gif", "PNG"])
def test_data_url_gives_its_bytes(media: str) -> None:
    data = encoded(halves(), "PNG")
    url = f"data:image/{media};base64,{base64.b64encode(data).decode()}"
    assert parse_data_url(url, LIMITS, PARAM) == data


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "data:image/tiff;base64,AAAA",
        "data:image/png,rawbytes",
        "data:text/plain;base64,AAAA",
        "data:image/png;base64,AA!A",  # not base64 alphabet
        "data:image/png;base64,AAA",  # bad padding
        "data:image/png;base64,AA\nAA",  # strict: no whitespace
    ],
)
def test_data_url_that_is_not_base64_image_is_invalid(url: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_data_url(url, LIMITS, PARAM)
    assert (caught.value.code, caught.value.param) == ("invalid_image_url", PARAM)


def test_data_url_over_the_cap_is_refused_before_decoding() -> None:
    # Not valid base64 at all: a decode would have failed with invalid_image_url, so
    # image_too_large shows the length alone decided.
    url = "data:image/png;base64," + "!" * 2000
    with pytest.raises(InvalidRequestError) as caught:
        parse_data_url(url, ImageLimits(max_bytes=1000), PARAM)
    assert caught.value.code == "image_too_large"


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ImageLimits(max_pixels=0)


def test_a_drafted_jpeg_decodes_smaller_but_reports_its_real_size() -> None:
    data = encoded(halves((1000, 700)), "JPEG", quality=90)
    drafted = open_image(data, LIMITS, PARAM, draft_side=320)
    assert drafted.rgb.size == (500, 350)  # 1/2: the smallest scale keeping both sides >= 320
    assert (drafted.width, drafted.height) == (1000, 700)
    assert drafted.sha256 == open_image(data, LIMITS, PARAM).sha256
    exif = Image.Exif()
    exif[0x0112] = 6
    turned = open_image(encoded(halves((1000, 700)), "JPEG", exif=exif), LIMITS, PARAM, draft_side=320)
    assert turned.rgb.size == (350, 500) and (turned.width, turned.height) == (700, 1000)


def test_only_jpeg_is_drafted() -> None:
    decoded = open_image(encoded(halves((1000, 700)), "PNG"), LIMITS, PARAM, draft_side=320)
    assert decoded.rgb.size == (1000, 700)
