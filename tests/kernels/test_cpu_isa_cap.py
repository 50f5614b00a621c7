"""CTXFUSE_CPU_ISA caps the C++ kernels' vector path (to measure what an AVX2-only CPU runs on a
wider one); a value that names no path is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import gguf_matmul, norm_rope, paged_attention

REPO = Path(__file__).resolve().parents[2]
PROBE = (
    "from kernels.cpu import gguf_matmul, norm_rope, paged_attention\n"
    "print(gguf_matmul.isa(), paged_attention._isa_level(None), norm_rope.isa())\n"
)


def _probe(cap: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CTXFUSE_CPU_ISA": cap}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True)


@pytest.mark.skipif(
    not (gguf_matmul.available() and paged_attention.available() and norm_rope.available()),
    reason="the C++ kernels cannot be built here",
)
def test_the_cap_selects_a_narrower_path_in_every_extension() -> None:
    out = _probe("scalar")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["scalar", "1", "scalar"]
    if "avx2" in gguf_matmul.supported_isas():
        assert _probe("AVX2").stdout.split() == ["avx2", "2", "avx2"]


def test_an_unknown_cap_is_refused() -> None:
    out = _probe("avx1024")
    assert out.returncode != 0
    assert "CTXFUSE_CPU_ISA='avx1024'" in out.stderr
