"""`GET /console`: the operator's console and the developers' playground, a small web app the gateway
serves itself (static files in this package: no separate server, no CDN, no build step).

The page and its files hold no data and are open; everything they show comes from the console's API
(api.py, the operator's key only) and, in the playground, from the public OpenAI API with whatever
key the user types. The key stays in the tab (sessionStorage), sent as a Bearer header: never in a
URL or a cookie, so no other site can make the browser use it.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from litestar import Request, Response, get
from litestar.params import FromPath

from gateway.console import api
from shared.errors import NotFoundError

_STATIC = files("gateway.console") / "static"
_JS = "text/javascript; charset=utf-8"
_MODULES = ("console", "util", "charts", "views", "keys", "playground")
_TYPES = {**{f"{m}.js": _JS for m in _MODULES}, "console.css": "text/css; charset=utf-8"}
# the page loads nothing from elsewhere and runs no inline script
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
_HEADERS = {"content-security-policy": _CSP, "x-content-type-options": "nosniff", "cache-control": "no-cache"}


def _file(name: str) -> bytes:
    return (_STATIC / name).read_bytes()


@get(["/console", "/console/"], summary="The operator's console", include_in_schema=False)
async def console_page(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(_file("index.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)


@get("/console/static/{name:str}", summary="The console's script and styles", include_in_schema=False)
async def console_static(name: FromPath[str]) -> Response[bytes]:
    media = _TYPES.get(name)  # only the files listed: nothing else of the package is reachable
    if media is None:
        raise NotFoundError(f"no console file {name!r}")
    return Response(_file(name), media_type=media, headers=_HEADERS)


ROUTES = [console_page, console_static, *api.ROUTES]
