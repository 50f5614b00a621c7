"""How a `ctxfuse bench` command hands over its figures: the JSON results file, then the markdown
table on stdout with the file's path under it."""

from __future__ import annotations

import json
from pathlib import Path


def publish(out: Path, data: object, table: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(table)
    print(f"\nresults: {out}")
