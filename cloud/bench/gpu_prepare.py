"""What the GPU check needs on a GPU machine that has no internet (docs/gpu-check.md), written to one
folder that travels with the command (64 MiB in all, the repository included):

- `model.gguf`: the default model's first 8 layers (embeddings, tokenizer and chat template whole);
- `wheels/`: the engine's Python packages that machine lacks, for its Python 3.12, at the versions
  this checkout's lock installs here.

    python -m cloud.bench.gpu_prepare --out .gpu        (or: make gpu-check-prep)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from cloud.model.registry import fetch

from .gpu_model import write_model_subset

SUBSET_LAYERS = 8  # 50 MB: with the wheels and the repository, under the 64 MiB a command carries
# the engine's imports the GPU image lacks (torch, triton, numpy, transformers, tokenizers, jinja2
# are there), by their distribution names
MISSING_THERE = (
    "xgrammar",
    "apache-tvm-ffi",
    "pydantic",
    "pydantic_core",
    "annotated-types",
    "typing-inspection",
    "gguf",
    "msgspec",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
)


def download_wheels(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in MISSING_THERE]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *pins]
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def prepare(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model = write_model_subset(fetch(quiet=True), out / "model.gguf", SUBSET_LAYERS)
    wheels = download_wheels(out / "wheels")
    size = model.stat().st_size + sum(w.stat().st_size for w in wheels)
    mib = model.stat().st_size / 2**20
    print(f"{out}: model subset {mib:.1f} MiB, {len(wheels)} wheels; {size / 2**20:.1f} MiB in all")
    return size


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m cloud.bench.gpu_prepare", description=__doc__)
    p.add_argument("--out", default=".gpu", help="the folder to fill (default .gpu, ignored by git)")
    prepare(Path(p.parse_args().out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
