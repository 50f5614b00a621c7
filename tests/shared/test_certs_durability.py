"""The CA survives a crash at any step: a command cut short between two file writes never un-revokes a
device, and a certificate that reached the disk can always be revoked by name. A crash is simulated by
making the Nth rename (os.replace, the step that publishes each file) fail."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from shared import certs

Replace = Callable[[Any, Any], None]


def _crash_at(monkeypatch: pytest.MonkeyPatch, nth: int) -> list[str]:
    """Make the `nth` os.replace from now raise, as if the process died there; the names it renamed."""
    real: Replace = os.replace
    done: list[str] = []

    def replace(src: Any, dst: Any) -> None:
        if len(done) + 1 == nth:
            done.append(f"crash before {Path(dst).name}")
            raise OSError("simulated crash")
        real(src, dst)
        done.append(Path(dst).name)

    monkeypatch.setattr(os, "replace", replace)
    return done


def _revoke_a_cut_short(
    root: Path, monkeypatch: pytest.MonkeyPatch, nth: int
) -> tuple[certs.Issued, certs.Issued, list[str]]:
    """A CA with devices a and b, then a revoke of a that crashes at its `nth` write."""
    certs.init_ca(root)
    a = certs.issue_device(root, "a")
    b = certs.issue_device(root, "b")
    with monkeypatch.context() as m:
        steps = _crash_at(m, nth)
        with pytest.raises(OSError, match="simulated crash"):
            certs.revoke_device(root, "a")
    return a, b, steps


def _revoked(root: Path) -> set[int]:
    crl = x509.load_pem_x509_crl(certs.TLSDir(root).crl.read_bytes())
    return {r.serial_number for r in crl}


@pytest.mark.parametrize("nth", [1, 2])
def test_a_revoke_cut_short_at_any_write_never_unrevokes_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    a, b, steps = _revoke_a_cut_short(tmp_path, monkeypatch, nth)
    assert len(steps) == nth  # the crash happened at the step asked for (the revoke writes two files)
    # the operator saw the revoke fail and runs it again; the CRL then lists the device either way
    with contextlib.suppress(certs.AlreadyExistsError):  # the index had it: the retry republished first
        certs.revoke_device(tmp_path, "a")
    assert a.serial in _revoked(tmp_path)
    # a later revoke of another device rebuilds the CRL from the index: it still lists the first
    certs.revoke_device(tmp_path, "b")
    assert _revoked(tmp_path) == {a.serial, b.serial}


@pytest.mark.parametrize("nth", [1, 2])
def test_a_revoke_cut_short_is_published_by_the_next_revoke_of_another_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    a, b, _ = _revoke_a_cut_short(tmp_path, monkeypatch, nth)
    listed = _revoked(tmp_path)
    revoked_a = next(d for d in certs.list_devices(tmp_path) if d.name == "a").revoked_at is not None
    certs.revoke_device(tmp_path, "b")  # no retry of "a": the next revoke is of someone else
    # what the index calls revoked, the CRL lists; nothing the CRL once listed is dropped
    assert listed <= _revoked(tmp_path) == ({a.serial} if revoked_a else set()) | {b.serial}
    assert revoked_a or nth == 1  # a crash before the index was written leaves "a" valid, else revoked


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_certificate_that_reached_the_disk_can_be_revoked_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    certs.init_ca(tmp_path)
    d = certs.TLSDir(tmp_path)
    with monkeypatch.context() as m:
        _crash_at(m, nth)
        with pytest.raises(OSError):
            certs.issue_device(tmp_path, "a")
    if d.device_cert("a").exists():
        serial = x509.load_pem_x509_certificate(d.device_cert("a").read_bytes()).serial_number
        certs.revoke_device(tmp_path, "a")
        assert serial in _revoked(tmp_path)
    else:
        # nothing handed out: the name is either free or revocable, never stuck
        if any(r.name == "a" for r in certs.list_devices(tmp_path)):
            certs.revoke_device(tmp_path, "a")
        certs.issue_device(tmp_path, "a")
    assert not list(tmp_path.glob("**/.*.tmp"))  # no half-written file left behind


def test_every_published_file_is_followed_by_a_sync_of_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        events.append(f"replace {Path(dst).parent}")

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(f"sync dir {os.readlink(f'/proc/self/fd/{fd}')}")

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    certs.init_ca(tmp_path)
    certs.issue_device(tmp_path, "a")
    certs.revoke_device(tmp_path, "a")
    replaces = [i for i, e in enumerate(events) if e.startswith("replace")]
    assert (
        len(replaces) == 4 + 3 + 2
    )  # init: key, cert, index, CRL; issue: index, key, cert; revoke: index, CRL
    for i in replaces:
        assert events[i + 1] == events[i].replace("replace", "sync dir", 1)
