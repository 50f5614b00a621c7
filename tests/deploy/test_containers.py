"""deploy/containers: every container file passes hadolint (the real binary), installs the lock its
tier needs (the router and the edge agent without torch), runs as a non-root user with a health
check, starts a command ctxfuse's own parser takes, and copies every package pyproject.toml ships."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ctxfuse.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = ROOT / "deploy" / "containers"
FILES = {
    "router": "requirements/router.lock",
    "worker-cpu": "requirements/all.lock",
    "worker-cuda": "requirements/all.lock",
    "edge": "requirements/edge.lock",
}
HADOLINT = Path(sys.executable).parent / "hadolint"

sys.path.insert(0, str(CONTAINERS))
from without_torch import without  # noqa: E402


def _text(name: str) -> str:
    return (CONTAINERS / f"{name}.Dockerfile").read_text()


def _hadolint(path: Path) -> list[dict[str, object]]:
    proc = subprocess.run(
        [str(HADOLINT), "--format", "json", str(path)], capture_output=True, text=True, timeout=60
    )
    return list(json.loads(proc.stdout or "[]"))


def test_every_container_file_passes_hadolint() -> None:
    found = sorted(p.stem for p in CONTAINERS.glob("*.Dockerfile"))
    assert found == sorted(FILES)
    for name in FILES:
        assert _hadolint(CONTAINERS / f"{name}.Dockerfile") == [], name


def test_hadolint_flags_a_careless_file(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install ctxfuse\nRUN cd /src && make\n")
    codes = {str(f["code"]) for f in _hadolint(bad)}
    assert {"DL3007", "DL3013", "DL3003"} <= codes


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_image_installs_its_lock_hash_checked_runs_as_non_root_with_a_health_check(name: str) -> None:
    text = _text(name)
    lock = FILES[name]
    installs = [line for line in text.splitlines() if "pip install" in line or line.strip().startswith("-c ")]
    assert any("--require-hashes" in line and "--no-deps" in line for line in installs)
    assert lock in text and "pip install --no-cache-dir --no-deps ." in text
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert "HEALTHCHECK" in text and "/health" in text
    for package in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]["include"]:
        assert f"COPY {package.rstrip('*')} " in text, package  # every package pyproject.toml ships


def test_the_router_and_edge_locks_hold_no_torch_and_the_cpu_worker_takes_torch_from_its_cpu_index() -> None:
    for lock in ("requirements/router.lock", "requirements/edge.lock"):
        assert not re.search(r"^(torch|triton)==", (ROOT / lock).read_text(), re.MULTILINE)
    for name in ("router", "edge"):
        assert not [line for line in _text(name).splitlines() if "torch" in line and not line.startswith("#")]
    cpu = _text("worker-cpu")
    assert "-c constraints.txt" in cpu and "download.pytorch.org/whl/cpu" in cpu
    assert "+cpu" in (ROOT / "requirements/all.lock").read_text()  # what that index is there for
    assert re.search(
        r"^FROM pytorch/pytorch:|^ARG TORCH_IMAGE=pytorch/pytorch:[0-9.]+-cuda[0-9.]+-cudnn9-runtime$",
        _text("worker-cuda"),
        re.MULTILINE,
    )


def test_the_cuda_image_keeps_its_own_torch_and_installs_the_rest_of_the_lock() -> None:
    lock = (ROOT / "requirements/all.lock").read_text()
    rest = without(lock)
    names = {m.group(1).lower() for m in re.finditer(r"^([A-Za-z0-9_.-]+)==", lock, re.MULTILINE)}
    kept = {m.group(1).lower() for m in re.finditer(r"^([A-Za-z0-9_.-]+)==", rest, re.MULTILINE)}
    assert names - kept == {"torch", "triton"}
    assert rest.count("--hash=") == lock.count("--hash=") - sum(
        len(re.findall("--hash=", block))
        for block in re.findall(r"^(?:torch|triton)==.*?(?=^\S)", lock, re.MULTILINE | re.DOTALL)
    )


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_image_starts_a_command_ctxfuse_parses(name: str) -> None:
    text = _text(name)
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert entry[0] == "ctxfuse"
    argv = entry[1:] + cmd
    if name == "edge":  # the device's own options come at run time
        argv = [a for a in argv if a != "--help"] + ["--gateway", "https://gw:8443", "--name", "dev1"]
    args = build_parser().parse_args(argv)
    assert args.command == {"router": "serve", "edge": "edge"}.get(name, "worker")
    assert args.host == "0.0.0.0"
