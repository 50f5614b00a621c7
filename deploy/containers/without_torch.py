"""For the CUDA worker image, whose base brings its own torch (and the triton built with it).

`python without_torch.py LOCK` prints the lock without its torch and triton entries, the rest
untouched (hashes included), for `pip install --require-hashes --no-deps`.
`python without_torch.py --check CONSTRAINTS` exits non-zero unless this Python is 3.11 (the lock's
wheels) and the installed torch is the version CONSTRAINTS pins (any local build: +cu128 for +cpu).
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

DROPPED = ("torch", "triton")
_ENTRY = re.compile(r"^([A-Za-z0-9_.-]+)==")


def without(lock: str) -> str:
    """The lock's entries, each a `name==version \\` line and its indented lines, less DROPPED."""
    out: list[str] = []
    keep = True
    for line in lock.splitlines(keepends=True):
        entry = _ENTRY.match(line)
        if entry is not None:
            keep = entry.group(1).lower() not in DROPPED
        elif not line.startswith((" ", "\t")):
            keep = True  # a comment or blank line between entries
        if keep:
            out.append(line)
    return "".join(out)


def check(constraints: str) -> str | None:
    """Why this image cannot take the lock, or None."""
    if sys.version_info[:2] != (3, 11):
        return f"the lock is for Python 3.11, this image has {sys.version.split()[0]}"
    pinned = re.search(r"^torch==([0-9.]+)", constraints, re.MULTILINE)
    if pinned is None:
        return "constraints.txt pins no torch"
    have = version("torch").split("+")[0]
    if have != pinned.group(1):
        return f"the image's torch is {have}, constraints.txt pins {pinned.group(1)}: pick its tag"
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--check":
        why = check(Path(argv[1]).read_text())
        if why is not None:
            print(f"without_torch: {why}", file=sys.stderr)
            return 1
        return 0
    if len(argv) == 1:
        sys.stdout.write(without(Path(argv[0]).read_text()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
