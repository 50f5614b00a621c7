"""The encoder's files are rebuilt when the inputs recorded in their manifest differ from this
machine's (a package version, the recipe number), when the set is half-written, and not otherwise;
a machine that cannot build says so instead of failing on an import. The build itself is replaced by
a stub that writes small files: these tests hold `ensure()`'s decisions, not the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge.vision import model_files
from edge.vision.model_files import VisionFiles, VisionFilesUnavailableError, build_inputs, ensure


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Each stub build appends the directory it built into."""
    done: list[Path] = []

    def stub(files: VisionFiles, work: Path, quiet: bool) -> None:
        for path in (files.fp32, files.int8):
            path.write_bytes(b"onnx")
        np.save(files.projection, np.zeros((2, 2), np.float32))
        files.labels.write_text("a\n")
        done.append(files.root)

    monkeypatch.setattr(model_files, "_build_into", stub)
    monkeypatch.setattr(model_files, "missing_build_modules", list)
    return done


def _rewrite_inputs(files: VisionFiles, **changes: object) -> None:
    manifest = json.loads(files.manifest.read_text())
    for key, value in changes.items():
        if key in manifest["inputs"]["packages"]:
            manifest["inputs"]["packages"][key] = value
        else:
            manifest["inputs"][key] = value
    files.manifest.write_text(json.dumps(manifest))


def test_a_missing_set_is_built_and_records_what_it_was_built_from(
    tmp_path: Path, builds: list[Path]
) -> None:
    files = ensure(VisionFiles(tmp_path / "enc"), quiet=True)
    assert len(builds) == 1 and files.recorded_inputs() == build_inputs()
    packages = build_inputs()["packages"]
    assert {"torch", "onnx", "onnxruntime", "numpy", "pillow"} <= set(packages)
    assert packages["onnxruntime"] is not None and build_inputs()["recipe"] == model_files.RECIPE
    assert [p.name for p in tmp_path.iterdir()] == ["enc"]  # the build's sibling directory is gone


def test_a_set_built_from_the_current_inputs_is_not_rebuilt(tmp_path: Path, builds: list[Path]) -> None:
    files = ensure(VisionFiles(tmp_path / "enc"), quiet=True)
    ensure(files, quiet=True)
    assert len(builds) == 1


@pytest.mark.parametrize(
    "change", [{"onnxruntime": "1.0.0"}, {"numpy": "1.26.0"}, {"recipe": 0}, {"calibration": {"count": 1}}]
)
def test_a_set_built_from_other_inputs_is_rebuilt(
    tmp_path: Path, builds: list[Path], change: dict[str, object]
) -> None:
    files = ensure(VisionFiles(tmp_path / "enc"), quiet=True)
    _rewrite_inputs(files, **change)
    ensure(files, quiet=True)
    assert len(builds) == 2 and files.recorded_inputs() == build_inputs()


def test_a_package_not_installed_here_is_no_reason_to_rebuild(
    tmp_path: Path, builds: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = ensure(VisionFiles(tmp_path / "enc"), quiet=True)
    without_torch = {**model_files.package_versions(), "torch": None}
    monkeypatch.setattr(model_files, "package_versions", lambda: without_torch)
    ensure(files, quiet=True)
    assert len(builds) == 1


@pytest.mark.parametrize("damage", ["no manifest", "bad manifest", "old manifest", "a file missing"])
def test_a_half_written_or_older_set_is_rebuilt(tmp_path: Path, builds: list[Path], damage: str) -> None:
    files = ensure(VisionFiles(tmp_path / "enc"), quiet=True)
    if damage == "no manifest":
        files.manifest.unlink()
    elif damage == "bad manifest":
        files.manifest.write_text("{")
    elif damage == "old manifest":
        files.manifest.write_text(json.dumps({"format": 1, "projection_sha256": "0" * 64}))
    else:
        files.int8.unlink()
    ensure(files, quiet=True)
    assert len(builds) == 2 and files.recorded_inputs() == build_inputs()


def test_a_machine_that_cannot_build_names_the_way_out(
    tmp_path: Path, builds: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = ensure(VisionFiles(tmp_path / "enc"), quiet=True)
    _rewrite_inputs(files, recipe=0)
    monkeypatch.setattr(model_files, "missing_build_modules", lambda: ["torch"])
    with pytest.raises(VisionFilesUnavailableError) as err:
        ensure(files, quiet=True)
    assert "ctxfuse models fetch" in err.value.message and "ctxfuse[cloud]" in err.value.message
    assert "recipe" in err.value.message and len(builds) == 1
    with pytest.raises(VisionFilesUnavailableError, match="missing"):
        ensure(VisionFiles(tmp_path / "none"), quiet=True)


def test_a_machine_that_cannot_build_uses_a_copied_set_made_with_other_package_versions(
    tmp_path: Path, builds: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device given the cloud's set keeps its images on the device even if its onnxruntime or numpy
    differ from the builder's: the recipe, and so the files' meaning, is the same."""
    files = ensure(VisionFiles(tmp_path / "enc"), quiet=True)
    _rewrite_inputs(files, onnxruntime="0.0.1", numpy="0.0.2")
    monkeypatch.setattr(model_files, "missing_build_modules", lambda: ["torch"])
    assert ensure(files, quiet=True) == files and len(builds) == 1
