"""Values every `ctxfuse` command reads the same way: argparse types for counts, amounts and
durations, and a secret given as a flag, as a file or in the environment.

Standard library and shared/ only: `ctxfuse edge` imports this on a device that has no torch."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from shared.errors import CtxfuseError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def positive_int(text: str) -> int:
    """A count of at least 1 (connections, batches, requests per minute)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A count where 0 means none or off (days to keep a file, chunked-prefill tokens)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """An amount above 0 (seconds, KiB). nan and inf are refused: a comparison with nan is always
    false, so a nan bound would never be reached, and every bound these options set is finite."""
    value = _finite(text, "a number, e.g. 15 or 2.5")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An amount of 0 or more (MiB), finite."""
    value = _finite(text, "a number, e.g. 64 or 0.5")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def duration_s(text: str) -> float:
    """Seconds from `90d`, `12h`, `30m`, `45s` or a bare number of seconds; above 0."""
    unit = text[-1:].lower()
    number, scale = (text[:-1], _UNITS[unit]) if unit in _UNITS else (text, 1)
    value = _finite(number, "a number with s, m, h or d, e.g. 90d", shown=text) * scale
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _finite(text: str, expected: str, shown: str | None = None) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {shown or text!r}")
    return value


class SecretRefused(CtxfuseError):
    """A secret option that cannot be used as given; `ctxfuse` prints it and exits with status 2."""


@dataclass(frozen=True, slots=True)
class SecretOption:
    """A secret (an API key) given as FLAG, as FLAG-file (the file's first line, which keeps it out
    of the process list) or in the environment variable `env`, the command line before the
    environment. Fails closed: a flag and its file together, an empty value and an unreadable or
    empty file are refused rather than read as "no key"."""

    flag: str  # e.g. "--api-key"; its file is "--api-key-file"
    env: str  # e.g. "CTXFUSE_API_KEY"; empty counts as unset

    @property
    def file_flag(self) -> str:
        return f"{self.flag}-file"

    def add(self, group: argparse._ActionsContainer, help: str, file_help: str | None = None) -> None:
        group.add_argument(self.flag, default=None, help=help)
        group.add_argument(
            self.file_flag,
            type=Path,
            default=None,
            metavar="FILE",
            help=file_help
            or f"read {self.flag} from this file's first line (keeps it out of the process list)",
        )

    def read(self, args: argparse.Namespace) -> str | None:
        """The secret, or None where none was given anywhere."""
        value: str | None = getattr(args, _dest(self.flag))
        path: Path | None = getattr(args, _dest(self.file_flag))
        if value is not None and path is not None:
            raise SecretRefused(f"give {self.flag} or {self.file_flag}, not both")
        if value is not None:
            if not value.strip():
                raise SecretRefused(f"{self.flag} is empty (leave it out to run without one)")
            return value
        if path is not None:
            return self._from_file(path)
        return os.environ.get(self.env) or None

    def _from_file(self, path: Path) -> str:
        try:
            lines = path.read_text(encoding="utf-8").strip().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SecretRefused(f"{self.file_flag} {path}: cannot be read ({why})") from exc
        key = lines[0].strip() if lines else ""
        if not key:
            raise SecretRefused(f"{self.file_flag} {path} is empty")
        return key


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")  # argparse's own rule for an option's attribute
