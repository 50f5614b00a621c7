"""Issue 17, finding 4: who may use the agent's local port. A real agent on loopback in front of a real
edge listener: a page that rebinds its DNS name to 127.0.0.1 (a foreign Host), a cross-origin page
(an Origin header) and a body a page can send without a CORS preflight (text/plain, multipart to a
JSON route) are refused before anything reaches the gateway; with a key set, the key is required; an
app using the official client with the key works as before, uploads included; binding off loopback
warns. The CLI takes the key from the flag, a file or the environment."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from ctxfuse.cli_values import SecretRefused
from ctxfuse.edge_cli import AGENT_KEY, add_edge_parser
from edge.local_guard import host_name, is_loopback
from edge.server import agent_server

from .agent_stack import Gatewayside, gatewayside, running_agent

KEY = "agent-test-key"
PAGE = "http://localhost:3000"  # the one web page allowed
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Side:
    gateway: Gatewayside
    url: str  # an agent with KEY and PAGE allowed, and the extra Host name device.lan
    open_url: str  # an agent with the defaults: no key, loopback names only, no page allowed

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)

    def seen(self) -> tuple[float, int]:
        """What reached the gateway: its request count, and the chat bodies its backend got."""
        return self.gateway.gateway_requests(), len(self.gateway.stub.behaviour.seen)


@pytest.fixture(scope="module")
def side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    tmp = tmp_path_factory.mktemp("guard")
    with gatewayside(tmp) as gw:
        keyed = gw.agent_config(
            tmp / "keyed", api_key=KEY, allowed_hosts=("Device.LAN:8100",), allowed_origins=(PAGE,)
        )
        with running_agent(keyed) as url, running_agent(gw.agent_config(tmp / "open")) as open_url:
            yield Side(gw, url, open_url)


def _auth(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _refused(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == code


def test_the_official_client_with_the_key_works_as_before(side: Side) -> None:
    client = side.client()
    reply = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "a"
    streamed = client.chat.completions.create(
        model="stub", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "a"
    assert "stub" in [m.id for m in client.models.list().data]
    uploaded = client.files.create(file=("in.jsonl", b'{"custom_id": "x"}\n'), purpose="batch")
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"  # multipart still takes the upload


def test_the_key_is_required_when_set(side: Side) -> None:
    before = side.seen()
    with pytest.raises(openai.AuthenticationError):
        side.client(api_key="wrong").chat.completions.create(
            model="stub", messages=[{"role": "user", "content": "hi"}]
        )
    resp = httpx.post(f"{side.url}/v1/chat/completions", json=CHAT)
    _refused(resp, 401, "invalid_api_key")
    assert resp.headers["www-authenticate"] == "Bearer"
    _refused(httpx.get(f"{side.url}/v1/models", headers=_auth(KEY + "x")), 401, "invalid_api_key")
    assert side.seen() == before
    assert httpx.get(f"{side.url}/health").status_code == 200  # probes stay open, as the gateway's


def test_without_a_key_configured_none_is_asked(side: Side) -> None:
    reply = httpx.post(f"{side.open_url}/v1/chat/completions", json=CHAT, timeout=30)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "a"


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:8100", "127.0.0.1.nip.io", "localhost."]
)
def test_a_rebound_host_is_refused_key_or_not(side: Side, host: str) -> None:
    before = side.seen()
    for url, headers in ((side.url, _auth()), (side.open_url, {})):
        resp = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={**headers, "host": host})
        _refused(resp, 403, "host_not_allowed")
        _refused(httpx.get(f"{url}/v1/models", headers={**headers, "host": host}), 403, "host_not_allowed")
    assert side.seen() == before


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1", "127.0.0.1:9", "[::1]:8100", "device.lan"])
def test_the_listed_host_names_are_answered_whatever_the_port(side: Side, host: str) -> None:
    resp = httpx.get(f"{side.url}/v1/models", headers={**_auth(), "host": host})
    assert resp.status_code == 200, resp.text


def test_device_lan_is_only_answered_where_it_was_listed(side: Side) -> None:
    _refused(httpx.get(f"{side.open_url}/v1/models", headers={"host": "device.lan"}), 403, "host_not_allowed")


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://localhost:3001"])
def test_a_cross_origin_request_is_refused(side: Side, origin: str) -> None:
    before = side.seen()
    for url, headers in ((side.url, _auth()), (side.open_url, {})):
        resp = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={**headers, "origin": origin})
        _refused(resp, 403, "origin_not_allowed")
        form = {"purpose": (None, "batch"), "file": ("x.jsonl", b"{}\n")}  # a page's form post
        resp = httpx.post(f"{url}/v1/files", files=form, headers={**headers, "origin": origin})
        _refused(resp, 403, "origin_not_allowed")
        preflight = httpx.options(
            f"{url}/v1/chat/completions",
            headers={"origin": origin, "access-control-request-method": "POST"},
        )
        _refused(preflight, 403, "origin_not_allowed")
    assert side.seen() == before


def test_the_allowed_page_gets_cors_answers(side: Side) -> None:
    preflight = httpx.options(
        f"{side.url}/v1/chat/completions",
        headers={
            "origin": PAGE,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    resp = httpx.post(f"{side.url}/v1/chat/completions", json=CHAT, headers={**_auth(), "origin": PAGE})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == PAGE
    no_key = httpx.post(f"{side.url}/v1/chat/completions", json=CHAT, headers={"origin": PAGE})
    _refused(no_key, 401, "invalid_api_key")  # an allowed page still needs the key


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", b'{"model": "stub", "messages": [{"role": "user", "content": "hi"}]}'),
        ("application/x-www-form-urlencoded", b"model=stub"),
        (
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n--x--\r\n',
        ),
        (None, b'{"model": "stub", "messages": [{"role": "user", "content": "hi"}]}'),
    ],
)
def test_a_json_route_refuses_bodies_a_page_could_send_without_preflight(
    side: Side, content_type: str | None, body: bytes
) -> None:
    before = side.seen()
    for url, headers in ((side.url, _auth()), (side.open_url, {})):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/batches"):
            sent = {**headers, "content-type": content_type} if content_type else headers
            _refused(httpx.post(f"{url}{path}", content=body, headers=sent), 415, "unsupported_media_type")
    assert side.seen() == before


def test_json_with_a_charset_is_json(side: Side) -> None:
    resp = httpx.post(
        f"{side.url}/v1/chat/completions",
        content=b'{"model": "stub", "messages": [{"role": "user", "content": "hi"}]}',
        headers={**_auth(), "content-type": "Application/JSON; charset=utf-8"},
    )
    assert resp.status_code == 200, resp.text


def test_host_names_compare_without_their_port() -> None:
    assert host_name("LocalHost:8100") == "localhost"
    assert host_name("[::1]:8100") == host_name("::1") == "[::1]"
    assert host_name("127.0.0.1") == "127.0.0.1"
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::", "192.168.1.5")] == [
        True, True, True, False, False, False,
    ]  # fmt: skip


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("192.168.1.5", True), ("127.0.0.1", False)])
def test_binding_off_loopback_warns(side: Side, tmp_path: Path, host: str, warned: bool) -> None:
    config = side.gateway.agent_config(tmp_path / "state", host=host)
    with capture_logs() as logs:
        server = agent_server(config)
    agent = server.config.app.app.state.agent  # the guard, then the app: closed, never started
    agent.outbox.close()
    agent.acked.close()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == (
        ["agent_port_exposed"] if warned else []
    )
    assert server.config.host == host  # built, not started: the warning comes before any bind


def _cli(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_edge_parser(p)
    return p.parse_args(["--gateway", "https://gw:8443", "--tls-dir", "/tls", "--name", "dev1", *argv])


def test_the_cli_takes_the_key_from_the_flag_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(AGENT_KEY.env, raising=False)
    assert AGENT_KEY.read(_cli()) is None
    key_file = tmp_path / "key"
    key_file.write_text("k2\nignored\n")
    monkeypatch.setenv(AGENT_KEY.env, "k3")
    assert AGENT_KEY.read(_cli("--api-key", "k1")) == "k1"
    assert AGENT_KEY.read(_cli("--api-key-file", str(key_file))) == "k2"  # given on the line: before the env
    assert AGENT_KEY.read(_cli()) == "k3"
    (tmp_path / "empty").write_text("\n")
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(SecretRefused, match=str(bad)):
            AGENT_KEY.read(_cli("--api-key-file", str(bad)))
    with pytest.raises(SecretRefused, match="not both"):  # which one was meant? neither is guessed
        AGENT_KEY.read(_cli("--api-key", "k1", "--api-key-file", str(key_file)))
    args = _cli("--allowed-host", "a.lan", "--allowed-host", "b.lan", "--allowed-origin", PAGE)
    assert (args.allowed_host, args.allowed_origin) == (["a.lan", "b.lan"], [PAGE])
