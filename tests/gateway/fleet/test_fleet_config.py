"""The fleet's configuration: `--backend URL` and the fleet file, and clear refusals of bad ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctxfuse.cli import build_parser
from ctxfuse.cli_values import SecretRefused
from ctxfuse.fleet_cli import BACKEND_KEY, fleet_config
from gateway.backends.fleet.config import load

FILE = """
[routing]
policy = "least-load"
max_attempts = 2

[canary]
error_rate = 0.1
min_requests = 5

[[backend]]
name = "a"
url = "http://10.0.0.1:8001/v1"
version = "v1"
weight = 90

[[backend]]
name = "b"
url = "http://10.0.0.2:8001/"
kind = "openai"
version = "v2"
weight = 10
"""


def test_the_fleet_file_gives_backends_versions_weights_and_settings(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FILE)
    config = load(path)
    assert [(b.name, b.url, b.kind, b.version) for b in config.backends] == [
        ("a", "http://10.0.0.1:8001", "auto", "v1"),
        ("b", "http://10.0.0.2:8001", "openai", "v2"),
    ]
    assert config.version_weights == {"v1": 90, "v2": 10}
    assert (config.policy, config.max_attempts, config.canary.error_rate, config.canary.min_requests) == (
        "least-load",
        2,
        0.1,
        5,
    )
    args = build_parser().parse_args(["serve", "--fleet", str(path), "--routing", "random"])
    assert fleet_config(args).policy == "random"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[backend]]\nname='a'\nurl='ftp://x'\n", "http:// or https://"),
        ("[[backend]]\nname='a'\nurl='http://x'\n[[backend]]\nname='a'\nurl='http://y'\n", "unique"),
        ("[[backend]]\nname='a'\nurl='http://x'\ncolour='red'\n", "colour"),
        ("[routing]\npolicy='fastest'\n[[backend]]\nname='a'\nurl='http://x'\n", "policy"),
        ("[[backend]]\nname='a'\nurl='http://x'\nkind='grpc'\n", "kind"),
        ("nothing = 1\n", "[[backend]]"),
        ("[[backend]\n", "cannot read"),
        ("[discovery]\ndns='w'\nport=0\n", "port"),
        ("[discovery]\ndns='http://w'\n", "host name"),
        ("[discovery]\ndns='w'\nrefresh_s=0\n", "refresh_s"),
        ("[discovery]\ndns='w'\nkind='grpc'\n", "kind"),
        ("[discovery]\ndns='w'\nttl=5\n", "ttl"),
    ],
)
def test_a_bad_fleet_file_is_refused_naming_the_problem(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=None) as info:
        load(path)
    assert says in str(info.value)


def test_backend_urls_make_a_one_version_fleet() -> None:
    args = build_parser().parse_args(
        ["serve", "--backend", "http://h1:8001/v1", "--backend", "http://h2:8001"]
    )
    config = fleet_config(args)
    assert config is not None and config.policy == "prefix"
    assert [(b.name, b.url, b.version) for b in config.backends] == [
        ("b0", "http://h1:8001", "default"),
        ("b1", "http://h2:8001", "default"),
    ]
    assert fleet_config(build_parser().parse_args(["serve"])) is None


def test_fleet_file_and_backend_urls_do_not_mix(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--fleet", str(tmp_path / "f.toml"), "--backend", "http://h:1"]
    )
    with pytest.raises(ValueError, match="not both"):
        fleet_config(args)


def test_the_backend_key_file_is_read_like_every_key_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(BACKEND_KEY.env, raising=False)
    (tmp_path / "key").write_text("worker-key\n")
    (tmp_path / "empty").write_text("")
    serve = ["serve", "--backend", "http://h:1"]
    config = fleet_config(build_parser().parse_args([*serve, "--backend-key-file", str(tmp_path / "key")]))
    assert config is not None and config.backend_key == "worker-key"
    for argv, says in [
        (["--backend-key-file", str(tmp_path / "empty")], "is empty"),  # routed with no key before
        (["--backend-key-file", str(tmp_path / "missing")], "cannot be read"),  # a traceback before
        (["--backend-key", "k", "--backend-key-file", str(tmp_path / "key")], "not both"),
    ]:
        with pytest.raises(SecretRefused, match=says):
            fleet_config(build_parser().parse_args([*serve, *argv]))


def test_a_fleet_file_may_find_its_workers_by_dns_alone_or_beside_named_backends(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("[discovery]\ndns = 'ctxfuse-worker'\nrefresh_s = 5\nkind = 'ctxfuse'\nversion = 'v1'\n")
    config = load(path)
    assert config.backends == () and config.discovery is not None
    d = config.discovery
    assert (d.dns, d.port, d.refresh_s, d.kind, d.version, d.weight) == (
        "ctxfuse-worker",
        8001,
        5,
        "ctxfuse",
        "v1",
        1.0,
    )
    assert config.version_weights == {"v1": 1.0} and not config.all_openai
    spec = d.backend("10.1.2.3")
    assert (spec.name, spec.url, spec.kind, spec.version) == (
        "10.1.2.3:8001",
        "http://10.1.2.3:8001",
        "ctxfuse",
        "v1",
    )
    assert d.backend("fd00::7").url == "http://[fd00::7]:8001"
    path.write_text(FILE + "\n[discovery]\ndns = 'w'\nversion = 'v2'\nweight = 30\nkind = 'openai'\n")
    both = load(path)
    assert [b.name for b in both.backends] == ["a", "b"] and both.version_weights == {"v1": 90, "v2": 40}
    assert not both.all_openai  # backend a's kind is auto
