"""The locks `make` installs from (requirements/*.lock) match pyproject.toml: every dependency of
every extra is pinned, within its range, with hashes; the edge lock is the full lock's versions, so
a device runs what the cloud was tested with. (`pip check` after install cannot see a missing extra.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)")


def pins(lock: str) -> dict[str, Version]:
    text = (REPO / "requirements" / lock).read_text()
    found = {}
    for entry in re.split(r"\n(?=\S)", text):
        m = PIN.match(entry)
        if m:
            assert "--hash=sha256:" in entry, f"{lock}: {m.group(1)} has no hash"
            found[canonicalize_name(m.group(1))] = Version(m.group(2))
    return found


def requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [
        r
        for r in reqs
        if canonicalize_name(r.name) != "ctxfuse" and (r.marker is None or r.marker.evaluate())
    ]


@pytest.mark.parametrize(
    ("lock", "extras"),
    [
        ("all.lock", ("edge", "cloud", "bench", "test")),
        ("edge.lock", ("edge",)),
        ("router.lock", ("edge", "router")),
    ],
)
def test_every_dependency_is_pinned_within_its_range(lock: str, extras: tuple[str, ...]) -> None:
    pinned = pins(lock)
    for r in requirements(*extras):
        version = pinned.get(canonicalize_name(r.name))
        assert version is not None, f"{r.name} is not in {lock}: run `make lock`"
        assert r.specifier.contains(version, prereleases=True), f"{lock} pins {r.name} {version}, outside {r}"


@pytest.mark.parametrize("lock", ["edge.lock", "router.lock"])
def test_the_edge_and_router_locks_run_the_full_locks_versions_without_the_engine(lock: str) -> None:
    full, part = pins("all.lock"), pins(lock)
    assert {name: v for name, v in part.items() if full.get(name) != v} == {}
    assert not {"torch", "transformers", "xgrammar", "triton", "gguf", "accelerate"} & set(part)
