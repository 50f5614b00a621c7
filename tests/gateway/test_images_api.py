"""Images on the gateway's OpenAI port: `image_url` parts become features in the gateway itself
(the agent's pipeline), reach the model as a tagged text block, and reuse the prefix cache only for
the same image. Bombs, corrupt images and URLs of hosts nobody allowed are 400s in OpenAI's shape."""

from __future__ import annotations

import base64
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import openai
import pytest

from cloud.serving.in_process import InProcessBackend
from edge.vision.features import VisionOptions
from gateway.bench.edge.pictures import crossword, encoded, photo, traffic_light

from .conftest import GATEWAY, MODEL, Running, run_in_thread

PNG = encoded(traffic_light())


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def bomb_png(side: int = 30_000) -> bytes:
    """A valid PNG header declaring side x side pixels, with a tiny all-zero body."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = zlib.compress(b"\0" * (side + 1) * 64, 9)  # the first rows only: the header is what lies
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def gw(backend: InProcessBackend, image_host: str, vision_files: object) -> Iterator[Running]:
    config = replace(
        GATEWAY, max_body_bytes=8 * 2**20, vision=VisionOptions(allowed_image_hosts=(image_host,))
    )
    running = run_in_thread(backend, config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(gw: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)


def image_message(
    url: str, text: str = "What is in this picture?", detail: str = "auto"
) -> list[dict[str, object]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url, "detail": detail}},
            ],
        }
    ]


def prompt_text(gw: Running, messages: list[dict[str, object]]) -> str:
    r = httpx.post(f"{gw.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    d = httpx.post(f"{gw.url}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=60)
    return str(d.json()["prompt"])


def error_of(gw: Running, messages: list[dict[str, object]]) -> tuple[int, dict[str, object]]:
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 1},
        timeout=60,
    )
    return r.status_code, r.json()["error"]


def test_a_png_reaches_the_model_as_labels_it_can_read(client: openai.OpenAI, gw: Running) -> None:
    messages = image_message(data_url(PNG))
    text = prompt_text(gw, messages)
    assert "<image width=224 height=224>" in text and "traffic light (" in text and "</image>" in text
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.content and r.usage is not None and r.usage.prompt_tokens > 30


def test_a_jpeg_photo_works_and_streams(client: openai.OpenAI) -> None:
    jpeg = encoded(photo(800, 600), "JPEG", quality=85)
    messages = image_message(data_url(jpeg, "image/jpeg"))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_the_same_image_reuses_the_prefix_cache_and_another_does_not(client: openai.OpenAI) -> None:
    preamble = "Describe the picture below in one short sentence, as a museum guide would. " * 6

    def cached(img: bytes) -> int:
        messages = [{"role": "system", "content": preamble}, *image_message(data_url(img))]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    cached(PNG)
    same = cached(PNG)
    other = cached(encoded(crossword()))
    assert same > other > 0  # the preamble is shared; the image's blocks only with the same image


def test_a_decompression_bomb_is_refused_before_decoding(gw: Running) -> None:
    status, err = error_of(gw, image_message(data_url(bomb_png())))
    assert status == 400 and err["code"] == "image_too_many_pixels"
    assert err["param"] == "messages[0].content[1].image_url.url"


def test_a_corrupt_image_is_a_400(gw: Running) -> None:
    status, err = error_of(gw, image_message(data_url(PNG[: len(PNG) // 2])))
    assert status == 400 and err["code"] == "invalid_image"
    status, err = error_of(gw, image_message("data:image/png;base64,not-base64!!"))
    assert status == 400


def test_remote_urls_are_fetched_only_from_allowed_hosts(gw: Running, image_host: str) -> None:
    status, err = error_of(gw, image_message("http://169.254.169.254/latest/meta-data/"))
    assert status == 400 and err["code"] == "image_urls_not_allowed"
    text = prompt_text(gw, image_message(f"http://{image_host}/signal.png"))
    assert "traffic light (" in text


def test_features_sent_by_a_client_are_checked(gw: Running) -> None:
    bad = {
        "sha256": "0" * 64,
        "width": 1,
        "height": 1,
        "labels": [],
        "embedding": base64.b64encode(b"x").decode(),
    }
    bad |= {"embedding_scale": 1.0, "embedding_space": "x"}
    messages = [{"role": "user", "content": [{"type": "image_features", "image_features": bad}]}]
    status, err = error_of(gw, messages)
    assert status == 400 and err["code"] == "invalid_image_features"


def test_high_detail_runs_ocr_on_the_image(gw: Running) -> None:
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new("RGB", (640, 200), "white")
    font = ImageFont.load_default(size=40)
    ImageDraw.Draw(page).text((20, 70), "INVOICE 2041 PAID", fill="black", font=font)
    text = prompt_text(gw, image_message(data_url(encoded(page)), detail="high"))
    assert "Text in the image:" in text and "INVOICE" in text.upper()


def test_an_unknown_part_type_is_still_a_400(gw: Running) -> None:
    messages = [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}
    ]
    status, err = error_of(gw, messages)
    assert status == 400 and err["param"] == "messages[0].content[0]"


def test_the_features_survive_json_both_ways() -> None:
    from shared.image_features import ImageFeatures, ImageLabel

    f = ImageFeatures(
        sha256="a" * 64,
        width=2,
        height=3,
        labels=[ImageLabel(label="x", prob=0.5)],
        embedding=bytes(range(128)),
        embedding_scale=0.5,
        embedding_space="s",
    )
    assert msgspec.json.decode(msgspec.json.encode(f), type=ImageFeatures) == f
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(f), type=ImageFeatures) == f
