"""Remote image URLs against a real HTTP server on loopback: off unless the host is allowed, every
redirect hop re-checked, bodies cut off at the byte cap, failures named with a code."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from PIL import Image

from edge.vision.decode import ImageLimits
from edge.vision.fetch import ImageUrlPolicy, fetch_image
from shared.errors import InvalidRequestError

PARAM = "messages[0].content[0].image_url.url"
LIMITS = ImageLimits(max_bytes=64 * 1024)


def png_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 128, 255)).save(out, format="PNG")
    return out.getvalue()


IMAGE = png_bytes()
SLOW_ANSWER = threading.Event()  # set: /slow may answer
HANG_GUARD_S = 60.0  # liveness only: /slow answers after this even if never told to


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        port = int(self.connection.getsockname()[1])
        routes = {
            "/cat.png": lambda: self.send(200, IMAGE, {"Content-Type": "image/png"}),
            "/to-cat": lambda: self.send(302, b"", {"Location": "/cat.png"}),
            "/to-other-host": lambda: self.send(302, b"", {"Location": "http://images.invalid/cat.png"}),
            "/to-other-port": lambda: self.send(302, b"", {"Location": f"http://127.0.0.1:{port + 1}/x"}),
            "/to-file": lambda: self.send(307, b"", {"Location": "file:///etc/passwd"}),
            "/loop": lambda: self.send(301, b"", {"Location": "/loop"}),
            "/declared-big": lambda: self.send(200, b"x" * (LIMITS.max_bytes + 1)),
            "/undeclared-big": self.endless,
            "/slow": self.slow,
        }
        routes.get(self.path, lambda: self.send(404, b"not here"))()

    def send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def endless(self) -> None:
        # No Content-Length: HTTP/1.0 delimits the body by closing, so only streaming can cut it off.
        self.send_response(200)
        self.end_headers()
        try:
            for _ in range(1000):
                self.wfile.write(b"y" * 8192)
        except OSError:
            pass  # the client hung up once it had enough

    def slow(self) -> None:
        # answers only once the test has seen the client give up (or after a hang guard)
        SLOW_ANSWER.wait(HANG_GUARD_S)
        self.send(200, IMAGE)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def fetch(url: str, policy: ImageUrlPolicy, timeout_s: float = 10.0) -> bytes:
    async def run() -> bytes:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await fetch_image(url, policy, LIMITS, client, PARAM, timeout_s=timeout_s)

    return asyncio.run(run())


def refusal(url: str, policy: ImageUrlPolicy, timeout_s: float = 10.0) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        fetch(url, policy, timeout_s)
    assert caught.value.param == PARAM
    return caught.value


def test_allowed_host_serves_the_image(server: str) -> None:
    assert fetch(f"http://{server}/cat.png", ImageUrlPolicy([server])) == IMAGE


def test_default_policy_refuses_every_url_and_names_the_flag(server: str) -> None:
    error = refusal(f"http://{server}/cat.png", ImageUrlPolicy())
    assert error.code == "image_urls_not_allowed"
    assert f"--allow-image-urls {server}" in error.message


def test_redirect_to_an_allowed_url_is_followed(server: str) -> None:
    assert fetch(f"http://{server}/to-cat", ImageUrlPolicy([server])) == IMAGE


@pytest.mark.parametrize("path", ["/to-other-host", "/to-other-port"])
def test_redirect_to_a_disallowed_host_is_refused(server: str, path: str) -> None:
    error = refusal(f"http://{server}{path}", ImageUrlPolicy([server]))
    assert error.code == "image_urls_not_allowed"
    assert "redirected from" in error.message


def test_redirect_to_another_scheme_is_refused(server: str) -> None:
    assert refusal(f"http://{server}/to-file", ImageUrlPolicy([server])).code == "invalid_image_url"


def test_more_than_three_redirects_fail(server: str) -> None:
    error = refusal(f"http://{server}/loop", ImageUrlPolicy([server]))
    assert error.code == "image_fetch_failed"
    assert "redirected more than 3 times" in error.message


def test_not_found_fails_naming_the_status(server: str) -> None:
    error = refusal(f"http://{server}/missing.png", ImageUrlPolicy([server]))
    assert error.code == "image_fetch_failed"
    assert "404" in error.message


@pytest.mark.parametrize("path", ["/declared-big", "/undeclared-big"])
def test_body_over_the_cap_is_refused(server: str, path: str) -> None:
    assert refusal(f"http://{server}{path}", ImageUrlPolicy([server])).code == "image_too_large"


def test_slow_server_times_out(server: str) -> None:
    try:
        error = refusal(f"http://{server}/slow", ImageUrlPolicy([server]), timeout_s=0.3)
        assert not SLOW_ANSWER.is_set()  # the fetch gave up while the server had not answered yet
    finally:
        SLOW_ANSWER.set()
    assert error.code == "image_fetch_failed"
    assert "took longer than 0.3 s" in error.message


def test_url_with_credentials_is_refused(server: str) -> None:
    assert refusal(f"http://user:pw@{server}/cat.png", ImageUrlPolicy([server])).code == "invalid_image_url"


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/cat.png", "file:///etc/passwd", "not a url"])
def test_non_http_urls_are_invalid(url: str) -> None:
    assert refusal(url, ImageUrlPolicy(["127.0.0.1"])).code == "invalid_image_url"


@pytest.mark.parametrize(
    ("entry", "url", "allowed"),
    [
        ("images.example.com", "https://images.example.com/a.png", True),
        ("images.example.com", "http://IMAGES.example.com/a.png", True),
        ("images.example.com", "https://images.example.com:443/a.png", True),
        ("images.example.com", "https://images.example.com:8443/a.png", False),
        ("images.example.com", "https://evil.images.example.com/a.png", False),
        ("cdn.example.com:8443", "https://cdn.example.com:8443/a.png", True),
        ("cdn.example.com:8443", "https://cdn.example.com/a.png", False),
        ("127.0.0.1:9999", "http://127.0.0.1:9999/a.png", True),
        ("127.0.0.1:9999", "http://127.0.0.1:9998/a.png", False),
        ("[::1]:8080", "http://[::1]:8080/a.png", True),
    ],
)
def test_policy_matches_host_and_port(entry: str, url: str, allowed: bool) -> None:
    assert ImageUrlPolicy([entry]).allows(httpx.URL(url)) is allowed


@pytest.mark.parametrize("entry", ["https://images.example.com", "images.example.com/path", "user@host", ""])
def test_policy_refuses_entries_that_are_not_host_and_port(entry: str) -> None:
    with pytest.raises(ValueError):
        ImageUrlPolicy([entry])
