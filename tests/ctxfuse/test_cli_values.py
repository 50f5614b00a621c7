"""The values every command reads the same way (ctxfuse/cli_values.py): counts, amounts and
durations refused at parse time with the option named, and a secret from a flag, a file or the
environment that fails closed. Parse-level only: no server, no model."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from ctxfuse.cli import build_parser
from ctxfuse.cli_values import SecretOption, SecretRefused, duration_s, positive_float, positive_int

ENV = "CTXFUSE_TEST_SECRET"
SECRET = SecretOption("--secret", env=ENV)


def _parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    SECRET.add(p, help="a secret")
    return p.parse_args(argv)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def test_a_secret_file_gives_its_first_line_without_the_newline(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("s3cret\n")
    (tmp_path / "crlf").write_text("  s3cret \r\nsecond line is ignored\n")
    assert SECRET.read(_parsed("--secret-file", str(tmp_path / "key"))) == "s3cret"
    assert SECRET.read(_parsed("--secret-file", str(tmp_path / "crlf"))) == "s3cret"


def test_the_command_line_comes_before_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert SECRET.read(_parsed()) is None
    monkeypatch.setenv(ENV, "")
    assert SECRET.read(_parsed()) is None  # an empty variable counts as unset, as before
    monkeypatch.setenv(ENV, "from-env")
    assert SECRET.read(_parsed()) == "from-env"
    assert SECRET.read(_parsed("--secret", "from-flag")) == "from-flag"
    (tmp_path / "key").write_text("from-file\n")
    assert SECRET.read(_parsed("--secret-file", str(tmp_path / "key"))) == "from-file"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--secret", "k", "--secret-file", "{tmp}/key"), "give --secret or --secret-file, not both"),
        (("--secret", ""), "--secret is empty"),
        (("--secret", "  "), "--secret is empty"),
        (("--secret-file", "{tmp}/empty"), "{tmp}/empty is empty"),
        (("--secret-file", "{tmp}/blank"), "{tmp}/blank is empty"),
        (("--secret-file", "{tmp}/missing"), "{tmp}/missing: cannot be read (No such file or directory)"),
        (("--secret-file", "{tmp}"), "{tmp}: cannot be read (Is a directory)"),
        (("--secret-file", "{tmp}/binary"), "{tmp}/binary: cannot be read"),
    ],
)
def test_a_secret_that_cannot_be_used_is_refused_not_read_as_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], says: str
) -> None:
    monkeypatch.setenv(ENV, "from-env")  # a refusal never falls back to the environment
    (tmp_path / "key").write_text("k\n")
    (tmp_path / "empty").write_text("")
    (tmp_path / "blank").write_text("\n \n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SecretRefused) as refused:
        SECRET.read(_parsed(*(a.format(tmp=tmp_path) for a in argv)))
    assert says.format(tmp=tmp_path) in refused.value.message


@pytest.mark.parametrize(
    ("parse", "text", "says"),
    [
        (positive_int, "0", "must be at least 1, got 0"),
        (positive_int, "-3", "must be at least 1, got -3"),
        (positive_int, "2.5", "expected a whole number, got '2.5'"),
        (positive_float, "0", "must be more than 0, got 0"),
        (positive_float, "-1.5", "must be more than 0, got -1.5"),
        (positive_float, "nan", "expected a number"),
        (positive_float, "inf", "expected a number"),
        (duration_s, "0d", "must be more than 0"),
        (duration_s, "-1h", "must be more than 0"),
        (duration_s, "nand", "expected a number with s, m, h or d"),
        (duration_s, "d", "expected a number with s, m, h or d"),
        (duration_s, "90x", "expected a number with s, m, h or d, e.g. 90d, got '90x'"),
    ],
)
def test_numbers_out_of_range_are_refused_saying_why(
    parse: Callable[[str], float], text: str, says: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says.replace(".", r"\.")):
        parse(text)


def test_durations_take_a_unit() -> None:
    assert [duration_s(t) for t in ("90d", "12h", "30m", "45s", "45", "1.5H")] == [
        90 * 86400,
        12 * 3600,
        30 * 60,
        45,
        45,
        1.5 * 3600,
    ]


def test_keys_create_refuses_a_zero_limit_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(["keys"])
    args = parser.parse_args(["keys", "create", "--tenant", "t", "--rpm", "5", "--expires-in", "90d"])
    assert (args.rpm, args.expires_in) == (5, 90 * 86400)
    for option, value, says in [
        ("--rpm", "0", "must be at least 1, got 0"),
        ("--max-concurrent", "-1", "must be at least 1, got -1"),
        ("--expires-in", "0d", "'0d': must be more than 0"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["keys", "create", "--tenant", "t", option, value])
        assert exited.value.code == 2
        assert f"argument {option}: {says}" in capsys.readouterr().err
