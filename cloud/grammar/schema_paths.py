"""Finding one's way around a JSON Schema: how a place in it is written in messages, which
subschemas each keyword holds, where a local `$ref` leads, and every schema reachable from the root.

A path is the tuple of keys and indices from the root, e.g. `("properties", "first name", "items")`,
written `$.properties["first name"].items` the way JSONPath readers expect.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

Path = tuple[str | int, ...]

# JavaScript identifiers, `$` included, so `$defs` reads as `$.$defs.node`
_IDENTIFIER = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")

# the keywords whose values are schemas, by shape: one schema, a name -> schema map, a list of schemas
_ONE = ("additionalProperties", "items", "unevaluatedProperties", "unevaluatedItems")
_MAP = ("properties", "$defs", "definitions")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")


class RefError(Exception):
    """A $ref that cannot be followed: `remote` (a URI or an anchor, not a pointer into this
    document), or one that points at nothing or loops back to itself."""

    def __init__(self, ref: str, path: Path, *, remote: bool, detail: str) -> None:
        super().__init__(detail)
        self.ref = ref
        self.path = path
        self.remote = remote
        self.detail = detail


def format_path(path: Path) -> str:
    parts = ["$"]
    for step in path:
        if isinstance(step, int):
            parts.append(f"[{step}]")
        elif _IDENTIFIER.fullmatch(step):
            parts.append(f".{step}")
        else:
            parts.append(f"[{json.dumps(step, ensure_ascii=False)}]")
    return "".join(parts)


def subschemas(node: dict[str, Any], path: Path) -> Iterator[tuple[str, Any, Path]]:
    """(keyword, subschema, its path) for each subschema `node` holds, in document order. Shapes are
    checked because `$defs` and `definitions` are mere annotations in some drafts."""
    for key, value in node.items():
        if key in _ONE and isinstance(value, dict | bool):
            yield key, value, (*path, key)
        elif key in _MAP and isinstance(value, dict):
            yield from ((key, sub, (*path, key, name)) for name, sub in value.items())
        elif key in _LIST and isinstance(value, list):
            yield from ((key, sub, (*path, key, i)) for i, sub in enumerate(value))


def follow(root: Any, node: Any, path: Path) -> tuple[Any, Path]:
    """Where a chain of $refs starting at `node` ends (`node` itself when it is no $ref)."""
    seen: set[str] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        if ref != "#" and not ref.startswith("#/"):
            raise RefError(ref, path, remote=True, detail='only refs into this schema ("#/...") resolve')
        if ref in seen:
            raise RefError(ref, path, remote=False, detail="loops back to itself without reaching a schema")
        seen.add(ref)
        node, path = _resolve(root, ref, path)
    return node, path


def reachable(root: dict[str, Any]) -> Iterator[tuple[dict[str, Any], Path]]:
    """Every object schema reachable from `root`, once, depth first: through the keywords that
    hold schemas and through $refs (whose targets may sit anywhere, even under an unknown keyword)."""
    stack: list[tuple[Any, Path]] = [(root, ())]
    seen: set[int] = set()  # schemas reached twice through $refs are yielded once
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node, path
        if isinstance(node.get("$ref"), str):
            follow(root, node, path)  # the whole chain must resolve, not just its first step
            stack.append(_resolve(root, node["$ref"], path))
        stack.extend(reversed([(sub, sub_path) for _, sub, sub_path in subschemas(node, path)]))


def _resolve(root: Any, ref: str, path: Path) -> tuple[Any, Path]:
    """One step: the value the JSON pointer in a local `ref` (found at `path`) names, and its path."""
    node = root
    steps: list[str | int] = []
    for token in unquote(ref[1:]).split("/")[1:]:  # RFC 6901 in a URI fragment: percent-decode first
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
            steps.append(key)
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
            steps.append(int(key))
        else:
            raise RefError(ref, path, remote=False, detail="points at nothing")
    return node, tuple(steps)
