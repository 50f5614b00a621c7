"""`not`, which no grammar engine enforces, rewritten into positive keywords where that is exact.

Real schemas use `not` for a few things: a property that must be absent (`not {required: [x]}`),
types left out (`not {type: T}`), a bound turned round (`not {maxItems: 2}`), a value struck from a
list (`not {enum: [...]}` beside an enum), and double negation. Each is rewritten into a schema that
accepts exactly what `not` accepts:
- De Morgan: `not` of several keywords is an anyOf of each one's negation, `not anyOf` an allOf of
  negations, `not allOf` an anyOf of them; `not not X` is X.
- a keyword constrains one type only (maxLength strings, required objects, ...), so its negation
  takes that type and the bound turned round: `not {maxLength: 2}` is `{type: string, minLength: 3}`.
- `not {required: [x]}`: an object with `properties: {x: false}` (x absent), which llguidance
  enforces; on an object closed to unlisted properties x is dropped from `properties` instead, which
  xgrammar reads the same.
- beside an `enum` or `const`, `not` anything (no $ref in it) strikes the listed values it accepts.
Anything else (a pattern, multipleOf, a $ref, `not {enum}` on an open type) is left for the checker
to refuse, naming `not`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema_rs

ALL_TYPES = ("object", "array", "string", "number", "boolean", "null")
_TYPE_OF = {  # bound -> (the type it constrains, its negation as (keyword, value shift))
    "minLength": ("string", "maxLength", -1),
    "maxLength": ("string", "minLength", +1),
    "minItems": ("array", "maxItems", -1),
    "maxItems": ("array", "minItems", +1),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", +1),
}
_NUMERIC = {  # number bound -> its negation, the same value
    "minimum": "exclusiveMaximum",
    "maximum": "exclusiveMinimum",
    "exclusiveMinimum": "maximum",
    "exclusiveMaximum": "minimum",
}
# keywords that change nothing a value must satisfy: left out before negating
_NOTES = frozenset({"title", "description", "default", "examples", "$comment", "$id", "$schema"})


def strike_listed(node: dict[str, Any]) -> bool:
    """Beside an enum or const, apply `not` by striking the values it accepts. False when `not`
    holds a $ref (it would need the whole schema to be read) or `not` is no schema."""
    sub = node["not"]
    if not isinstance(sub, dict | bool) or _holds_ref(sub):
        return False
    try:
        rejects = jsonschema_rs.validator_for(sub)
    except (jsonschema_rs.ValidationError, ValueError):
        return False
    listing = "enum" if "enum" in node else "const"
    values = node["enum"] if listing == "enum" else [node["const"]]
    if not isinstance(values, list):
        return False
    kept = [value for value in values if not rejects.is_valid(value)]
    del node["not"]
    if listing == "const" and not kept:
        del node["const"]
        node["enum"] = []  # matches nothing: the compiler reports the schema as matching nothing
    elif listing == "enum":
        node["enum"] = kept
    return True


def negated(sub: Any) -> dict[str, Any] | None:
    """A schema without `not` at its top that accepts exactly the values `sub` rejects, or None."""
    if sub is False:
        return {}
    if not isinstance(sub, dict):
        return None  # `not true` (or `not {}`) matches nothing: no schema here says that
    own = {key: value for key, value in sub.items() if key not in _NOTES and not _inert(key, value)}
    if not own:
        return None
    if "not" in own and len(own) == 1:
        inner = own["not"]
        return {} if inner is True else copy.deepcopy(inner) if isinstance(inner, dict) else None
    parts = [_negated_word(key, value) for key, value in own.items()]
    if any(part is None for part in parts):
        return None
    return _any_of([part for part in parts if part is not None])


def _negated_word(key: str, value: Any) -> dict[str, Any] | None:
    """The values that break keyword `key` of a schema (every other keyword left aside)."""
    if key == "type":
        named = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
        if named is None or ("integer" in named and "number" not in named):
            return None  # "a number with a fraction" is no type
        rest = [t for t in ALL_TYPES if t not in named]
        return {"type": rest} if rest else None
    if key in _TYPE_OF and isinstance(value, int) and not isinstance(value, bool):
        kind, other, shift = _TYPE_OF[key]
        if value + shift < 0:
            return None  # minLength 0 holds for every string: its negation matches nothing
        return {"type": kind, other: value + shift}
    if key in _NUMERIC and isinstance(value, int | float) and not isinstance(value, bool):
        return {"type": "number", _NUMERIC[key]: value}
    if key == "required" and isinstance(value, list) and value and all(isinstance(n, str) for n in value):
        return _any_of([{"type": "object", "properties": {name: False}} for name in dict.fromkeys(value)])
    if key == "properties" and isinstance(value, dict):
        # broken by an object that has one of them, with a value that breaks its schema
        branches = []
        for name, schema in value.items():
            inner = negated(schema)
            if inner is None:
                return None
            branches.append({"type": "object", "required": [name], "properties": {name: inner}})
        return _any_of(branches)
    if key in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
        return _negated_composition(key, value)
    return None


def _negated_composition(key: str, branches: list[Any]) -> dict[str, Any] | None:
    if key == "oneOf":
        live = [branch for branch in branches if branch is not False]
        if len(live) > 1:
            return None  # "none or several" is no keyword
        key, branches = "anyOf", live
    if not branches:
        return {}  # anyOf (or oneOf) of nothing matches nothing: its negation everything
    parts = [negated(branch) for branch in branches]
    if any(part is None for part in parts):
        return None
    kept = [part for part in parts if part is not None]
    return _any_of(kept) if key == "allOf" else {"allOf": kept} if len(kept) > 1 else kept[0]


def _any_of(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _inert(key: str, value: Any) -> bool:
    """A keyword that holds for every value: `properties` whose schemas all take anything."""
    return (
        key == "properties" and isinstance(value, dict) and all(s is True or s == {} for s in value.values())
    )


def _holds_ref(node: Any) -> bool:
    return '"$ref"' in json.dumps(node)
