"""How a `ctxfuse bench` command hands over its figures: the JSON results file, then the markdown
table on stdout with the file's path under it."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def say(msg: str) -> None:
    """A progress line for the person running the bench (stderr: stdout carries the results)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def publish(out: Path, data: object, table: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(table)
    print(f"\nresults: {out}")
