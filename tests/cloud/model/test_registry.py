"""The model cache knows where each file came from: a file made from another source (a new pin)
is fetched again, also in a user's existing cache."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from cloud.model.registry import ModelSource, _is_current, source_record_path


def _file(tmp_path: Path, data: bytes = b"gguf bytes") -> tuple[Path, ModelSource]:
    target = tmp_path / "model.gguf"
    target.write_bytes(data)
    source = ModelSource("m", "pkg==1.0", "pkg/model.gguf", hashlib.sha256(data).hexdigest(), len(data))
    return target, source


def test_a_file_from_before_records_is_checked_by_digest_once_and_given_its_record(tmp_path: Path) -> None:
    target, source = _file(tmp_path)
    assert not source_record_path(target).exists()
    assert _is_current(target, source)
    assert source_record_path(target).is_file()
    assert _is_current(target, source)


def test_a_file_whose_digest_differs_is_not_current(tmp_path: Path) -> None:
    target, source = _file(tmp_path)
    other = dataclasses.replace(source, sha256="0" * 64)
    assert not _is_current(target, other)
    assert not source_record_path(target).exists()


def test_a_new_pin_makes_the_cached_file_stale(tmp_path: Path) -> None:
    target, source = _file(tmp_path)
    assert _is_current(target, source)
    assert not _is_current(target, dataclasses.replace(source, package="pkg==1.1"))
    assert not _is_current(target, dataclasses.replace(source, size=source.size + 1))


def test_a_missing_file_is_not_current(tmp_path: Path) -> None:
    target, source = _file(tmp_path)
    target.unlink()
    assert not _is_current(target, source)
