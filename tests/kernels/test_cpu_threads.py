"""The OpenMP wait policy ctxfuse hands its engine process (kernels/cpu/threads.py)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from kernels.cpu.threads import quiet_openmp_for_children


def _policy(conn: multiprocessing.connection.Connection) -> None:
    conn.send(os.environ.get("OMP_WAIT_POLICY"))


def _spawned_policy() -> str | None:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    with quiet_openmp_for_children():
        p = ctx.Process(target=_policy, args=(theirs,))
        p.start()
    got = ours.recv()
    p.join(30)
    return got


def test_spawned_children_get_passive_and_the_parent_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _spawned_policy() == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ


def test_a_policy_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _spawned_policy() == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_cli_sets_it_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = (
        "import os, sys\n"
        "from ctxfuse.cli import main\n"
        "assert 'torch' not in sys.modules, 'importing the CLI loaded torch'\n"
        "try:\n    main(['certs', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "PASSIVE"
