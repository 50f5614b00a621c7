"""String formats the grammar does not check exactly, rewritten as patterns it does; and patterns
made to match the way JSON Schema means them (anywhere in the string), where xgrammar matches whole.

xgrammar 0.2.9 shapes `date`, `time`, `date-time` and `ipv4` loosely (it writes 2024-02-30,
22:59:60Z and 01.2.3.4), and a format it does not enforce would have to be refused. These patterns
accept exactly the valid values, leap years included, or a subset of them (no leap seconds), so the
grammar compiled from the rewritten schema never lets an invalid value through. The finished output
is still checked against the schema as sent. llguidance's own `date` and `date-time` take 2023-02-29,
so it is handed these patterns too (llg_schema).
"""

from __future__ import annotations

import copy
from typing import Any

from .schema_paths import reachable
from .shapes import normalized

_DAY_31 = "(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
_DAY_30 = "(0[469]|11)-(0[1-9]|[12][0-9]|30)"
_DAY_FEB = "02-(0[1-9]|1[0-9]|2[0-8])"
# Gregorian leap years: divisible by 4 but not by 100, or by 400
_LEAP_DAY = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29"
DATE = f"([0-9]{{4}}-({_DAY_31}|{_DAY_30}|{_DAY_FEB})|{_LEAP_DAY})"
# RFC 3339 (section 5.6, its note) lets "T" and "Z" be written in lower case, as jsonschema_rs does
TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"

FORMAT_PATTERNS = {
    "date": DATE,
    "time": TIME,
    "date-time": f"{DATE}[Tt]{TIME}",
    "ipv4": f"{_OCTET}(\\.{_OCTET}){{3}}",
}
# the formats llg_schema rewrites
LLG_PATTERNED = frozenset({"date", "date-time"})


def grammar_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a checked schema (schema_support.check_schema) with each of these formats replaced
    by its pattern; the checker allows neither a pattern nor a length beside a format. It starts
    from the schema as the checker read it: in draft 2020-12, its shapes rewritten (shapes.py)."""
    out = copy.deepcopy(normalized(schema))
    for node, _ in reachable(out):
        if isinstance(node.get("pattern"), str) and "string" in _types(node):
            node["pattern"] = full_match(node["pattern"])
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "string" in _types(node):
            del node["format"]
            node["pattern"] = FORMAT_PATTERNS[fmt]
    return out


def llg_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a schema checked for llguidance with `date` and `date-time` replaced by their
    patterns, anchored (llguidance matches a pattern anywhere, as JSON Schema means it). Where a
    pattern stands beside the format the checker refuses the format: one node holds one pattern."""
    out = copy.deepcopy(normalized(schema))
    for node, _ in reachable(out):
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in LLG_PATTERNED and "pattern" not in node:
            del node["format"]
            node["pattern"] = f"^{FORMAT_PATTERNS[fmt]}$"
    return out


def full_match(pattern: str) -> str:
    """A JSON Schema pattern matches anywhere in the string unless anchored; xgrammar matches a
    pattern against the whole string. So an unanchored side gets `.*`: the grammar then accepts
    every string with a match in it that has no line break around the match (xgrammar's `.` takes
    none), a subset of what the pattern accepts. The checker allows anchors only at the ends."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not _escaped(pattern, len(pattern) - 1)
    if start and end:
        return pattern
    body = pattern[1 if start else 0 : len(pattern) - 1 if end else len(pattern)]
    return f"{'^' if start else '.*'}({body}){'$' if end else '.*'}"


def _escaped(text: str, i: int) -> bool:
    """Whether the character at `i` follows an odd run of backslashes."""
    run = len(text[:i]) - len(text[:i].rstrip("\\"))
    return run % 2 == 1


def _types(node: dict[str, Any]) -> list[str]:
    t = node.get("type")
    return [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []
