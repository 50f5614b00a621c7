"""Where JSON values sit in text. Python's json module gives values but no positions; callers here
need offsets: the tool-call reader must know where an arguments object ends while it is still being
generated, and per-field confidence must know which characters spell each leaf.

Two scanners, both over `str` offsets (code points, not bytes):
- `ContainerScan`: incremental and structural only (depth, string and escape state). It finds where
  an object or array closes without validating it; callers validate the finished text with `json`.
- `find_leaves`: a strict parser of a whole document that reports each leaf's path and span.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

# The body of a JSON string literal (RFC 8259 section 7): no raw quote, backslash or control
# character; escapes are complete. Shared so every reader in the package agrees on what a string is.
STRING_BODY = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'

_STRING = re.compile(f'"{STRING_BODY}"')
# [0-9] rather than \d: in str patterns \d also matches non-ASCII digits, which JSON does not allow.
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_OUTSIDE_STRING = re.compile(r'[{}\[\]"]')
_INSIDE_STRING = re.compile(r'["\\]')

# Deep enough for any document a model writes for a schema; shallow enough that the recursive
# parser stays far below Python's recursion limit (two frames per level).
MAX_DEPTH = 128


class ContainerScan:
    """Finds the end of one JSON object or array fed in pieces. The first piece must start at the
    opening bracket. Brackets are counted, not matched, so `{]` "closes"; that is acceptable because
    every caller validates the finished text, and a well-formed container always ends exactly where
    this says."""

    __slots__ = ("_depth", "_escaped", "_in_string")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False  # a backslash in a string was read: skip the next character (maybe next piece)

    def feed(self, text: str, start: int = 0) -> int | None:
        """Scans text[start:]. Returns the offset just past the closing bracket if the container
        ends in this piece, else None (the state carries over to the next piece)."""
        if self._depth == 0 and start < len(text) and text[start] not in "{[":
            raise ValueError(f"a container starts with '{{' or '[', not {text[start]!r}")
        i = start
        while i < len(text):
            if self._escaped:
                self._escaped, i = False, i + 1
            elif self._in_string:
                m = _INSIDE_STRING.search(text, i)
                if m is None:
                    return None
                i = m.end()
                self._escaped = m.group() == "\\"
                self._in_string = self._escaped  # a backslash stays in the string, a quote ends it
            else:
                m = _OUTSIDE_STRING.search(text, i)
                if m is None:
                    return None
                i = m.end()
                if self._close(m.group()):
                    return i
        return None

    def _close(self, char: str) -> bool:
        """Applies one structural character outside strings; True when it closes the container."""
        if char == '"':
            self._in_string = True
            return False
        self._depth += 1 if char in "{[" else -1
        return self._depth == 0


def container_end(text: str, start: int) -> int | None:
    """The offset just past the object or array opening at text[start], or None if it is not closed."""
    return ContainerScan().feed(text, start)


LeafKind = Literal["string", "number", "boolean", "null", "object", "array"]
PathPart = str | int


@dataclass(slots=True, frozen=True)
class Leaf:
    """A scalar or an empty container. `path` holds object keys (str) and array indices (int) from
    the root; [start, end) is the literal's span, quotes included for strings."""

    path: tuple[PathPart, ...]
    start: int
    end: int
    kind: LeafKind


class _NotJson(Exception):
    """Raised inside the parser only; `find_leaves` turns it into None."""


def find_leaves(text: str) -> list[Leaf] | None:
    """Every leaf of the single JSON value in `text` (surrounding whitespace allowed), in document
    order; None if `text` is not exactly one valid value or nests deeper than MAX_DEPTH. For a
    repeated key the last occurrence wins, at the first one's position, as with `json.loads`."""
    parser = _LeafParser(text)
    try:
        parser.skip_whitespace()
        parser.value((), 0)
        parser.skip_whitespace()
    except _NotJson:
        return None
    return parser.leaves if parser.pos == len(text) else None


class _LeafParser:
    """Recursive descent over RFC 8259; each method starts at its value's first character."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.leaves: list[Leaf] = []

    def skip_whitespace(self) -> None:
        m = _WHITESPACE.match(self.text, self.pos)
        self.pos = m.end() if m else self.pos

    def expect(self, char: str) -> None:
        if not self.text.startswith(char, self.pos):
            raise _NotJson
        self.pos += 1

    def value(self, path: tuple[PathPart, ...], depth: int) -> None:
        if depth >= MAX_DEPTH and self.text.startswith(("{", "["), self.pos):
            raise _NotJson  # this container would be nesting level depth + 1
        if self.text.startswith("{", self.pos):
            self.object(path, depth)
        elif self.text.startswith("[", self.pos):
            self.array(path, depth)
        else:
            self.scalar(path)

    def scalar(self, path: tuple[PathPart, ...]) -> None:
        start = self.pos
        kind: LeafKind
        if m := _STRING.match(self.text, start):
            kind, end = "string", m.end()
        elif m := _NUMBER.match(self.text, start):
            kind, end = "number", m.end()
        elif word := next((w for w in ("true", "false", "null") if self.text.startswith(w, start)), ""):
            kind, end = ("null" if word == "null" else "boolean"), start + len(word)
        else:
            raise _NotJson
        self.leaves.append(Leaf(path, start, end, kind))
        self.pos = end

    def object(self, path: tuple[PathPart, ...], depth: int) -> None:
        start = self.pos
        self.pos += 1
        self.skip_whitespace()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            self.leaves.append(Leaf(path, start, self.pos, "object"))
            return
        members: dict[str, list[Leaf]] = {}
        while True:
            m = _STRING.match(self.text, self.pos)
            if m is None:
                raise _NotJson
            key = json.loads(m.group())
            self.pos = m.end()
            self.skip_whitespace()
            self.expect(":")
            self.skip_whitespace()
            members[key] = self.child((*path, key), depth)
            if not self.more("}"):
                break
        for leaves in members.values():
            self.leaves.extend(leaves)

    def array(self, path: tuple[PathPart, ...], depth: int) -> None:
        start = self.pos
        self.pos += 1
        self.skip_whitespace()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            self.leaves.append(Leaf(path, start, self.pos, "array"))
            return
        index = 0
        while True:
            self.leaves.extend(self.child((*path, index), depth))
            index += 1
            if not self.more("]"):
                break

    def child(self, path: tuple[PathPart, ...], depth: int) -> list[Leaf]:
        """Parses one member value and takes its leaves back, so the caller decides where they go."""
        mark = len(self.leaves)
        self.value(path, depth + 1)
        taken = self.leaves[mark:]
        del self.leaves[mark:]
        self.skip_whitespace()
        return taken

    def more(self, closer: str) -> bool:
        """After a member: True on ',' (another member follows), False on the closer."""
        if self.text.startswith(",", self.pos):
            self.pos += 1
            self.skip_whitespace()
            return True
        self.expect(closer)
        return False
