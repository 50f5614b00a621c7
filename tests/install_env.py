"""A fresh virtual environment holding one lock and ctxfuse itself (a wheel built from a copy of this
checkout, not the checkout): how the edge agent and the router are installed where they run."""

from __future__ import annotations

import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*cmd: str | Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def installed_env(tmp_path_factory: pytest.TempPathFactory, lock: str) -> Path:
    """The environment's root (its bin/ holds python and ctxfuse), installed from requirements/`lock`."""
    root = tmp_path_factory.mktemp(f"{Path(lock).stem}-venv")
    venv.create(root, with_pip=True)
    py = root / "bin" / "python"
    pip = (py, "-m", "pip", "install", "-q", "--disable-pip-version-check")
    run(
        *pip,
        "--require-hashes",
        "--no-deps",
        "-c",
        REPO / "constraints.txt",
        "-r",
        REPO / "requirements" / lock,
    )
    # built from a copy of what the package holds: pip builds in the source tree, and this one stays clean
    source = tmp_path_factory.mktemp(f"{Path(lock).stem}-source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("ctxfuse", "gateway", "edge", "cloud", "kernels", "shared"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    run(*pip, "--no-deps", source)
    run(py, "-m", "pip", "check", "--disable-pip-version-check")
    return root


def imported_modules(importtime_log: str) -> set[str]:
    """Every module `python -X importtime` reported importing, by its full name."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_log.splitlines()
        if line.startswith("import time:") and "|" in line
    }
