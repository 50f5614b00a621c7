"""Fetching `image_url` parts that point at http(s) URLs, only from hosts the operator allowed.

Off by default: a gateway that fetches whatever URL a client names can be steered at its own
network (server-side request forgery). So every hop, redirects included, must match an entry given
with --allow-image-urls; redirects are followed by hand so each target is checked before it is
contacted, and the body is streamed so a large answer is cut off at the byte cap, not buffered.
Host names are matched as written; the allow list is trusted to name hosts the operator controls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

from edge.vision.decode import ImageLimits, image_too_large
from shared.errors import InvalidRequestError

MAX_REDIRECTS = 3
FETCH_TIMEOUT_S = 10.0  # for the whole fetch, every hop and the body together
_DEFAULT_PORTS = {"http": 80, "https": 443}
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True, slots=True)
class AllowedHost:
    host: str  # lower-case ASCII (IDNA) form, IPv6 without brackets
    port: int | None  # None: the URL scheme's default port only

    @classmethod
    def parse(cls, entry: str) -> AllowedHost:
        """`"host"`, `"host:port"` or `"[v6]:port"`; anything with a scheme, path or userinfo is refused."""
        try:
            url = httpx.URL(f"http://{entry.strip()}")
        except httpx.InvalidURL as exc:
            raise ValueError(f"--allow-image-urls entry {entry!r} is not a host[:port]: {exc}") from exc
        if not url.raw_host or url.userinfo or url.raw_path not in (b"", b"/") or "/" in entry:
            raise ValueError(f"--allow-image-urls entry {entry!r} is not a host[:port]")
        return cls(host=url.raw_host.decode("ascii").lower(), port=url.port)

    def matches(self, url: httpx.URL) -> bool:
        port = url.port if url.port is not None else _DEFAULT_PORTS.get(url.scheme)
        wanted = self.port if self.port is not None else _DEFAULT_PORTS.get(url.scheme)
        return url.raw_host.decode("ascii").lower() == self.host and port == wanted


class ImageUrlPolicy:
    """Which remote image URLs may be fetched; the empty policy (the default) allows none."""

    __slots__ = ("_allowed",)

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        self._allowed = tuple(AllowedHost.parse(entry) for entry in allowed)

    @property
    def enabled(self) -> bool:
        return bool(self._allowed)

    def allows(self, url: httpx.URL) -> bool:
        return url.scheme in _DEFAULT_PORTS and any(entry.matches(url) for entry in self._allowed)


async def fetch_image(
    url: str,
    policy: ImageUrlPolicy,
    limits: ImageLimits,
    client: httpx.AsyncClient,
    param: str,
    *,
    timeout_s: float = FETCH_TIMEOUT_S,
) -> bytes:
    """The body of `url` after at most MAX_REDIRECTS allowed redirects, at most `limits.max_bytes` long."""
    target = _checked(_parse(url, param), policy, param)
    try:
        async with asyncio.timeout(timeout_s):
            for _ in range(MAX_REDIRECTS + 1):
                body, location = await _get_once(target, limits, client, param)
                if location is None:
                    return body
                target = _checked(target.join(location), policy, param, redirected_from=target)
    except TimeoutError as exc:
        raise _fetch_failed(param, f"fetching {url} took longer than {timeout_s:g} s") from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise _fetch_failed(param, f"fetching {url} failed: {type(exc).__name__}: {exc}") from exc
    raise _fetch_failed(param, f"fetching {url} was redirected more than {MAX_REDIRECTS} times")


async def _get_once(
    target: httpx.URL, limits: ImageLimits, client: httpx.AsyncClient, param: str
) -> tuple[bytes, str | None]:
    """One request: the body, or (b"", Location) for a redirect."""
    # identity: so the byte cap counts what reaches memory without a decompression step in between
    headers = {"Accept-Encoding": "identity", "Accept": "image/*"}
    async with client.stream("GET", target, headers=headers, follow_redirects=False) as response:
        location = response.headers.get("location")
        if response.status_code in _REDIRECT_STATUSES and location:
            return b"", location
        if not response.is_success:
            raise _fetch_failed(param, f"fetching {target} answered HTTP {response.status_code}")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_bytes:
            raise image_too_large(param, limits)
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limits.max_bytes:
                raise image_too_large(param, limits)
        return bytes(body), None


def _parse(url: str, param: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise InvalidRequestError(
            f"image_url is not a valid URL: {exc}", param=param, code="invalid_image_url"
        ) from exc
    return parsed


def _checked(
    url: httpx.URL, policy: ImageUrlPolicy, param: str, *, redirected_from: httpx.URL | None = None
) -> httpx.URL:
    if url.scheme not in _DEFAULT_PORTS or not url.raw_host:
        raise InvalidRequestError(
            "image_url must be an http(s) URL or a data:image/...;base64 URL",
            param=param,
            code="invalid_image_url",
        )
    if url.userinfo:
        raise InvalidRequestError(
            "image_url must not carry credentials (user:password@)", param=param, code="invalid_image_url"
        )
    if not policy.allows(url):
        via = f" (redirected from {redirected_from})" if redirected_from is not None else ""
        raise InvalidRequestError(
            f"image URL {url}{via} is not fetched: the server was not started with "
            f"--allow-image-urls {_host_port(url)}; send the image inline as a data: URL instead",
            param=param,
            code="image_urls_not_allowed",
        )
    return url


def _host_port(url: httpx.URL) -> str:
    host = url.raw_host.decode("ascii")
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{url.port}" if url.port is not None else host


def _fetch_failed(param: str, detail: str) -> InvalidRequestError:
    return InvalidRequestError(detail, param=param, code="image_fetch_failed")
