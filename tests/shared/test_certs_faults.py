"""The CA on a disk that fails it: a full or read-only disk refuses the command with nothing changed
(and the same command works once there is room), a damaged file is named with its fix and never
replaced, and a write torn by a power cut leaves the previous state. Real small filesystems
(tests/storage_rig.py) and real damaged files; no mocks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509

from ctxfuse.cli import main
from shared import certs
from shared.ca_files import DamagedCAFile
from shared.durable_file import STALE_TEMP_S
from shared.errors import CtxfuseError
from shared.storage_faults import StorageFault
from shared.tls import RevocationWatcher, client_context, server_context
from tests.storage_rig import fill, make_room, remount, small_fs

Files = dict[str, bytes]


def _files(root: Path) -> Files:
    """Every file under `root` (temp files included) by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _revoked(root: Path) -> set[int]:
    return {r.serial_number for r in x509.load_pem_x509_crl(certs.TLSDir(root).crl.read_bytes())}


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with small_fs(tmp_path / "fs", 1024) as mounted:
        yield mounted


@pytest.fixture
def ca(fs: Path) -> Path:
    """A CA on the small filesystem with device "a" issued."""
    root = fs / "tls"
    certs.init_ca(root)
    certs.issue_device(root, "a")
    return root


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("ctxfuse: "), err
    return err


# leave=4096: room for the first file written aside (the index), not for the next (the key)
@pytest.mark.parametrize("leave", [0, 4096])
def test_a_full_disk_refuses_an_issue_with_nothing_changed_and_it_works_once_there_is_room(
    ca: Path, fs: Path, leave: int
) -> None:
    before = _files(ca)
    fill(fs, leave)
    with pytest.raises(StorageFault) as refused:
        certs.issue_device(ca, "b")
    assert (refused.value.store, refused.value.kind, refused.value.status) == ("ca", "full", 507)
    assert _files(ca) == before  # no temp file, no index entry for a certificate that is not there
    make_room(fs)
    issued = certs.issue_device(ca, "b")  # the same command, no restart, no repair
    assert issued.cert.exists() and {d.name for d in certs.list_devices(ca)} == {"a", "b"}


def test_a_full_disk_refuses_a_revoke_with_nothing_changed_and_it_works_once_there_is_room(
    ca: Path, fs: Path
) -> None:
    a = certs.TLSDir(ca).device_cert("a")
    serial = x509.load_pem_x509_certificate(a.read_bytes()).serial_number
    fill(fs, 4096)  # room for the index written aside, not for the CRL beside it
    before = _files(ca)
    with pytest.raises(StorageFault) as refused:
        certs.revoke_device(ca, "a")
    assert refused.value.kind == "full"
    assert _files(ca) == before  # the index does not call "a" revoked while the CRL does not list it
    make_room(fs)
    certs.revoke_device(ca, "a")
    assert _revoked(ca) == {serial}


def test_the_cli_names_a_full_disk_in_one_line(
    ca: Path, fs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(fs)
    err = _one_line_error(capsys, ["certs", "revoke", str(ca), "a"])
    assert str(ca) in err and "space left" in err and "free space" in err


def test_a_read_only_directory_is_refused_in_one_line_naming_it_and_the_fix(
    ca: Path, fs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _files(ca)
    remount(fs, "ro")
    try:
        err = _one_line_error(capsys, ["certs", "issue", str(ca), "b"])
    finally:
        remount(fs, "rw")
    assert str(ca) in err and "read-only" in err and "make the directory writable" in err
    assert _files(ca) == before


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip(data: bytes) -> bytes:
    """One character in the middle of a PEM's base64 body changed to another base64 character."""
    lines = data.split(b"\n")
    line = len(lines) // 2
    text = bytearray(lines[line])
    i = len(text) // 2
    text[i] = ord("B") if text[i] != ord("B") else ord("C")
    lines[line] = bytes(text)
    return b"\n".join(lines)


DAMAGE = {"truncated": _truncate, "flipped": _flip}


def _damage(path: Path, how: Callable[[bytes], bytes]) -> bytes:
    damaged = how(path.read_bytes())
    path.write_bytes(damaged)
    return damaged


def _issue(root: Path) -> None:
    certs.issue_device(root, "b")


def _gateway_start(root: Path) -> None:
    server_context(root)


def _agent_start(root: Path) -> None:
    client_context(root, "a")


# where each file is read: a CA command, the gateway's start, the agent's start
READERS: dict[str, Callable[[Path], None]] = {
    "ca.pem": _issue,
    "ca.key": _issue,
    "crl.pem": _issue,
    "server.pem": _gateway_start,
    "server.key": _gateway_start,
    "devices/a.pem": _agent_start,
    "devices/a.key": _agent_start,
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", READERS)
def test_a_damaged_file_is_named_with_its_fix_and_left_as_it_is(
    tmp_path: Path, name: str, damage: str
) -> None:
    certs.init_ca(tmp_path)
    certs.issue_server(tmp_path)
    certs.issue_device(tmp_path, "a")
    damaged = _damage(tmp_path / name, DAMAGE[damage])
    before = _files(tmp_path)
    with pytest.raises(DamagedCAFile) as refused:
        READERS[name](tmp_path)
    assert (refused.value.store, refused.value.kind) == ("ca", "damaged")
    message = refused.value.operator_message
    assert str(tmp_path / name) in message and "\n" not in message
    assert "backup" in message or "ctxfuse certs" in message or "copy" in message
    assert _files(tmp_path) == before and (tmp_path / name).read_bytes() == damaged


@pytest.mark.parametrize(
    "alter",
    [
        pytest.param(_truncate, id="truncated"),
        pytest.param(lambda b: b.replace(b'"devices"', b'"devicez"'), id="field-name-altered"),
        pytest.param(lambda b: b.replace(b'"serial": "', b'"serial": "x'), id="serial-not-hex"),
        pytest.param(lambda b: b"{}\n", id="emptied"),
    ],
)
def test_a_damaged_index_is_refused_not_rebuilt_from_nothing(
    tmp_path: Path, alter: Callable[[bytes], bytes]
) -> None:
    certs.init_ca(tmp_path)
    certs.issue_device(tmp_path, "a")
    certs.revoke_device(tmp_path, "a")
    d = certs.TLSDir(tmp_path)
    _damage(d.index, alter)
    before = _files(tmp_path)
    with pytest.raises(DamagedCAFile) as refused:
        certs.issue_device(tmp_path, "b")  # a CRL from this index would forget that "a" is revoked
    assert f"{d.index} is damaged" in refused.value.operator_message
    assert "backup" in refused.value.operator_message
    assert _files(tmp_path) == before


def test_a_lost_index_is_refused_while_the_crl_revokes_devices(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    certs.issue_device(tmp_path, "a")
    certs.revoke_device(tmp_path, "a")
    certs.TLSDir(tmp_path).index.unlink()
    with pytest.raises(DamagedCAFile) as refused:
        certs.revoke_device(tmp_path, "a")
    assert "index.json is damaged (missing" in refused.value.operator_message


def test_a_damaged_crl_is_rebuilt_by_certs_crl_with_every_revocation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    certs.init_ca(tmp_path)
    a = certs.issue_device(tmp_path, "a")
    certs.revoke_device(tmp_path, "a")
    _damage(certs.TLSDir(tmp_path).crl, _flip)
    err = _one_line_error(capsys, ["certs", "issue", str(tmp_path), "b"])
    assert f"ctxfuse certs crl {tmp_path}" in err
    assert main(["certs", "crl", str(tmp_path)]) == 0
    assert _revoked(tmp_path) == {a.serial}
    certs.issue_device(tmp_path, "b")  # commands work again


def test_init_refuses_a_directory_whose_ca_is_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    certs.init_ca(tmp_path)
    d = certs.TLSDir(tmp_path)
    _damage(d.ca_key, _truncate)
    d.ca_cert.unlink()
    before = _files(tmp_path)
    err = _one_line_error(capsys, ["certs", "init", str(tmp_path)])
    assert "already holds a CA" in err
    assert _files(tmp_path) == before


def test_the_gateway_start_names_a_damaged_file_as_one_error_not_a_traceback(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    certs.issue_server(tmp_path)
    _damage(certs.TLSDir(tmp_path).server_key, _truncate)
    # what `ctxfuse serve --edge-port` meets at start: a CtxfuseError, printed by ctxfuse.cli.main
    with pytest.raises(CtxfuseError) as refused:
        server_context(tmp_path)
    assert "server.key is damaged" in getattr(refused.value, "operator_message", "")


def test_a_write_torn_by_a_power_cut_leaves_the_previous_state(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    certs.issue_server(tmp_path)
    a = certs.issue_device(tmp_path, "a")
    certs.revoke_device(tmp_path, "a")
    d = certs.TLSDir(tmp_path)
    # a power cut between write and rename: half-written files aside, the old ones in place
    torn = [tmp_path / ".crl.pem.0123abcd.tmp", tmp_path / ".index.json.89abcdef.tmp"]
    torn[0].write_bytes(_truncate(d.crl.read_bytes()))
    torn[1].write_bytes(_truncate(d.index.read_bytes()))
    old = time.time() - STALE_TEMP_S - 1
    for path in torn:
        os.utime(path, (old, old))
    live = tmp_path / ".index.json.fedcba98.tmp"  # a write that may still be running
    live.write_bytes(b"{")

    server_context(tmp_path)
    watcher = RevocationWatcher(server_context(tmp_path), tmp_path)
    watcher.refresh()
    assert watcher.revoked == {a.serial}
    assert [r.name for r in certs.list_devices(tmp_path) if r.revoked_at is not None] == ["a"]

    b = certs.issue_device(tmp_path, "b")
    certs.revoke_device(tmp_path, "b")  # writes the index and the CRL: their stale temps go
    assert _revoked(tmp_path) == {a.serial, b.serial}
    assert not any(p.exists() for p in torn) and live.exists()


def test_a_damaged_crl_at_reload_keeps_the_revocations_already_in_force(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    certs.issue_server(tmp_path)
    a = certs.issue_device(tmp_path, "a")
    certs.revoke_device(tmp_path, "a")
    watcher = RevocationWatcher(server_context(tmp_path), tmp_path)
    assert watcher.refresh() and watcher.revoked == {a.serial}
    crl = certs.TLSDir(tmp_path).crl
    damaged = tmp_path / "damaged.pem"
    damaged.write_bytes(_flip(crl.read_bytes()))
    os.replace(damaged, crl)  # a new inode: the watcher reads it
    with pytest.raises(DamagedCAFile):
        watcher.refresh()
    assert watcher.is_revoked(a.serial)  # logged, and the loaded list stays in force
