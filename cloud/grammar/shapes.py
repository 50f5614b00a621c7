"""Shapes real schemas use that xgrammar would misread, rewritten into equivalent ones it reads right.

Each rewrite keeps exactly the set of values the schema accepts (the checker then judges the result,
and the finished output is still checked against the schema as sent):
- object keywords (properties, required, ...) with no "type": they constrain only objects, so the
  node gets every JSON type, which xgrammar applies to the object side alone.
- a property `required` but not listed under `properties`: listed, with the schema
  `additionalProperties` gives it (any value when there is none), because the grammar writes only
  listed properties.
- property dependencies on an object closed to unlisted properties: an anyOf of "absent" and
  "present with what it needs" (_split_dependencies).
- keywords beside an `allOf`, `anyOf` or `oneOf`, which xgrammar drops there: merged into each
  branch (and the branches of an allOf into one schema), where the merge is exact; otherwise the
  node is left for the checker to refuse.
- `not`, rewritten into positive keywords (negation.py) and merged into the node like an allOf
  branch; a property it forbids (`properties: {x: false}`) on an object closed to unlisted ones is
  dropped from `properties`, which says the same in a way xgrammar compiles.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .dialects import to_current
from .negation import negated, strike_listed
from .schema_paths import RefError, follow, reachable

_ALL_TYPES = ["object", "array", "string", "number", "boolean", "null"]
_OBJECT_WORDS = ("properties", "required", "additionalProperties", "minProperties", "maxProperties")
_APPLICATORS = ("anyOf", "oneOf")
# the keywords that constrain a value, in any draft; every other one is an annotation or unknown,
# which merging leaves out and a rewritten node keeps where it stands
_ASSERTING = frozenset(
    {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"}
    | {"maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "contains"}
    | {"maxContains", "minContains", "maxProperties", "minProperties", "required", "dependentRequired"}
    | {"$ref", "$dynamicRef", "$recursiveRef", "allOf", "anyOf", "oneOf", "not", "if", "then", "else"}
    | {"dependentSchemas", "dependencies", "prefixItems", "items", "additionalItems", "properties"}
    | {"patternProperties", "additionalProperties", "propertyNames", "unevaluatedItems"}
    | {"unevaluatedProperties", "contentEncoding", "contentMediaType", "contentSchema"}
)
_MOST_DEPENDENCIES = 3
# bounds on rewriting: $ref targets copied into merged branches, and how much larger the result may be
_MOST_INLINED = 64
_MOST_GROWTH = 8
# with these beside, the branches would need more than the object's own keywords
_DEPENDENCY_BLOCKERS = frozenset({"anyOf", "oneOf", "allOf", "$ref", "patternProperties", "dependentSchemas"})
# patterns that match every property name (search semantics: "" matches anywhere), and those that
# match every name that is not empty and has no line break ("." takes none)
_EVERY_NAME = frozenset({"", ".*", "^.*", ".*$"})
_NAMES_ON_ONE_LINE = frozenset({".+", "^.+", ".+$", "^.+$", "^.*$"})
# keywords that constrain another type than object: a node holding one of them gets no implied types
_OTHER_WORDS = frozenset(
    {"minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum"}
    | {"exclusiveMaximum", "multipleOf", "items", "prefixItems", "minItems", "maxItems"}
)
# keywords that read other keywords of their schema: merged side by side, they would read the union
_CONTEXTUAL = ("unevaluatedProperties", "unevaluatedItems")
# `not not not ...`: each round takes one level off
_MOST_NEGATIONS = 8


def normalized(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the grammar is compiled from it and the checker judges it: rewritten into
    draft 2020-12 (dialects.py), then these shapes rewritten. The input is never changed."""
    current = to_current(schema)
    out = copy.deepcopy(current)
    budget = _Budget()
    try:
        for node, _ in reachable(out):  # each node is rewritten before its subschemas are visited
            # $ref targets are copied from the schema as it came, never from one being rewritten
            _rewrite(current, node, budget)
    except (RefError, _TooBig, RecursionError):
        return current  # the checker reports the $ref, or refuses what could not be rewritten
    if len(json.dumps(out)) > _MOST_GROWTH * len(json.dumps(current)) + 4096:
        return current
    return out


class _TooBig(Exception):
    """Rewriting inlined too many $ref targets: a recursive $ref merged into a branch unrolls one
    level more each time it is met, without end."""


class _Budget:
    def __init__(self) -> None:
        self.inlined = 0

    def inline(self) -> None:
        self.inlined += 1
        if self.inlined > _MOST_INLINED:
            raise _TooBig


def _rewrite(source: dict[str, Any], node: dict[str, Any], budget: _Budget) -> None:
    _eliminate_not(source, node, budget)
    _split_dependencies(node)
    if "allOf" in node:
        _merge_all_of(source, node, budget)
        _eliminate_not(source, node, budget)  # one the merge brought in
    applicator = next((word for word in _APPLICATORS if isinstance(node.get(word), list)), None)
    if applicator is not None:
        _distribute(source, node, applicator, budget)
    _fold_pattern_properties(node)
    if _composed(node):
        return
    if "type" not in node and any(word in node for word in _OBJECT_WORDS) and not _OTHER_WORDS & set(node):
        node["type"] = list(_ALL_TYPES)
    _list_required(node)
    _drop_forbidden(node)


def _eliminate_not(source: dict[str, Any], node: dict[str, Any], budget: _Budget) -> None:
    """`not` as positive keywords merged into `node`; where that is not exact, `node` is left as it
    was, for the checker to refuse naming `not`."""
    for _ in range(_MOST_NEGATIONS):
        if "not" not in node:
            return
        if "enum" in node or "const" in node:
            if not strike_listed(node):
                return
            continue
        positive = negated(node["not"])
        before = copy.deepcopy(node)
        if positive is None or not isinstance(node.get("allOf", []), list):
            return
        del node["not"]
        node["allOf"] = [*node.get("allOf", []), positive]
        _merge_all_of(source, node, budget)
        if len(node.get("allOf", [])) > 1:  # the merge was not exact
            node.clear()
            node.update(before)
            return


def _drop_forbidden(node: dict[str, Any]) -> None:
    """On an object closed to unlisted properties, a property whose schema is `false` is as absent
    unlisted as listed; unlisted, xgrammar compiles it."""
    properties = node.get("properties")
    if node.get("additionalProperties") is not False or not isinstance(properties, dict):
        return
    required = node.get("required", [])
    if any(sub is False and name not in required for name, sub in properties.items()):
        node["properties"] = {
            name: sub for name, sub in properties.items() if sub is not False or name in required
        }


def _split_dependencies(node: dict[str, Any]) -> None:
    """Property dependencies (`dependencies` with lists, or `dependentRequired`) on an object that
    takes no unlisted properties: for each dependency, either its property is absent (dropped from
    the listed ones, so forbidden) or it and every property it needs are required. An anyOf of
    those branches (at most 2**_MOST_DEPENDENCIES) is exactly the schema."""
    word = next((w for w in ("dependentRequired", "dependencies") if w in node), None)
    if word is None:
        return
    deps = node[word]
    if not isinstance(deps, dict) or not deps or len(deps) > _MOST_DEPENDENCIES:
        return
    if not all(isinstance(needs, list) for needs in deps.values()) or set(node) & _DEPENDENCY_BLOCKERS:
        return
    properties = node.get("properties", {})
    if node.get("additionalProperties") is not False or not isinstance(properties, dict):
        return  # "absent" could be said only with `not`
    base = {key: value for key, value in _own(node).items() if key != word}
    branches = [base]
    for name, needs in deps.items():
        split = []
        for branch in branches:
            if name not in branch.get("required", []):
                absent = {
                    **branch,
                    "properties": {k: v for k, v in branch.get("properties", {}).items() if k != name},
                }
                split.append(absent)
            present = {**branch, "required": list(dict.fromkeys([*branch.get("required", []), name, *needs]))}
            split.append(present)
        branches = split
    for key in base:
        del node[key]
    del node[word]
    node["anyOf"] = [copy.deepcopy(branch) for branch in branches]


def _fold_pattern_properties(node: dict[str, Any]) -> None:
    """A patternProperties whose one pattern matches every name (or, where other names are free
    anyway, every name without a line break) is what additionalProperties says, plus a constraint
    on each listed property. Patterns that pick names are left for the checker to refuse: the grammar
    cannot constrain a name."""
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict) or len(patterns) != 1:
        return
    ((pattern, sub),) = patterns.items()
    free = node.get("additionalProperties", True) is True
    if not (pattern in _EVERY_NAME or (free and pattern in _NAMES_ON_ONE_LINE)):
        return
    properties = node.get("properties", {})
    if not isinstance(properties, dict) or not isinstance(sub, dict | bool):
        return
    folded = {}
    for name, prop in properties.items():
        merged = _both(prop, sub)
        if merged is None:
            return
        folded[name] = merged
    del node["patternProperties"]
    node["additionalProperties"] = sub
    if folded:
        node["properties"] = folded


def _both(a: Any, b: Any) -> Any:
    """One schema for `a` and `b` (either may be a boolean), or None."""
    if a is True or b is True:
        return b if a is True else a
    if a is False or b is False:
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        if _same(a, b):
            return a
        if "$ref" in a or "$ref" in b:
            return None  # merged, the $ref would stand beside other keywords
        merged = merge(_own(a), _own(b))
        notes = {key: value for key, value in a.items() if key not in _ASSERTING}
        return None if merged is None else {**notes, **merged}
    return None


def _composed(node: dict[str, Any]) -> bool:
    return any(word in node for word in ("$ref", "allOf", "anyOf", "oneOf", "enum", "const"))


def _list_required(node: dict[str, Any]) -> None:
    required = node.get("required")
    properties = node.get("properties", {})
    extra = node.get("additionalProperties", True)
    if not isinstance(required, list) or not isinstance(properties, dict):
        return
    if extra is False or "patternProperties" in node:  # unsatisfiable, or refused anyway
        return
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    if missing:
        listed = {name: copy.deepcopy(extra) if isinstance(extra, dict) else {} for name in missing}
        node["properties"] = {**properties, **listed}


def _merge_all_of(source: dict[str, Any], node: dict[str, Any], budget: _Budget) -> None:
    """An allOf of several schemas (and what stands beside it) becomes their one merged schema."""
    branches = node["allOf"]
    if not isinstance(branches, list) or (len(branches) < 2 and len(_own(node)) == 1):
        return
    merged: dict[str, Any] | None = {key: value for key, value in _own(node).items() if key != "allOf"}
    for branch in branches:
        resolved = _resolved(source, branch, budget)
        merged = None if merged is None or resolved is None else merge(merged, resolved)
    if merged is None:
        return
    for key in list(_own(node)):
        del node[key]
    node.update(merged)


def _distribute(source: dict[str, Any], node: dict[str, Any], applicator: str, budget: _Budget) -> None:
    """Keywords beside an anyOf/oneOf go into each branch: A and (B1 or B2) = (A and B1) or (A and
    B2); for oneOf too, since every branch gets the same A."""
    beside = {key: value for key, value in _own(node).items() if key != applicator}
    if not beside or "enum" in beside or "const" in beside:
        return  # the grammar writes listed values verbatim: the checker judges them beside the branches
    branches = []
    for branch in node[applicator]:
        resolved = _resolved(source, branch, budget)
        if resolved is not None and _excluded_by_type(beside, resolved):
            continue  # A and B matches nothing: for anyOf and oneOf alike, the branch is as good as gone
        merged = None if resolved is None else merge(beside, resolved)
        if merged is None:
            return
        branches.append(merged)
    if not branches:
        return
    for key in beside:
        del node[key]
    node[applicator] = branches


def _excluded_by_type(a: dict[str, Any], b: dict[str, Any]) -> bool:
    both = _type_set(a["type"]) & _type_set(b["type"]) if "type" in a and "type" in b else True
    return not both


def _own(node: dict[str, Any]) -> dict[str, Any]:
    """The keywords of `node` that constrain (annotations and definitions left out)."""
    return {key: value for key, value in node.items() if key in _ASSERTING}


def _resolved(source: dict[str, Any], branch: Any, budget: _Budget) -> dict[str, Any] | None:
    if isinstance(branch, dict) and "$ref" in branch:
        budget.inline()
    try:
        target, _ = follow(source, branch, ())
    except RefError:
        return None
    if target is True:
        return {}
    return _own(copy.deepcopy(target)) if isinstance(target, dict) else None


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """One schema that accepts exactly what both `a` and `b` accept, or None when that takes more
    than putting their keywords side by side."""
    if not _objects_merge(a, b) or not _objects_merge(b, a):
        return None
    if any(word in a or word in b for word in _CONTEXTUAL):
        return None
    if ("items" in a and "prefixItems" in b) or ("prefixItems" in a and "items" in b):
        return None  # items applies after the prefixItems of its own schema only
    out = dict(a)
    for key, value in b.items():
        if key not in out or _same(out[key], value):
            out[key] = value
        elif key == "type":
            types = _type_set(out[key]) & _type_set(value)
            if not types:
                return None
            out[key] = sorted(types - {"integer"} if "number" in types else types)
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            properties = dict(out[key])
            for name, sub in value.items():
                both = _both(properties[name], sub) if name in properties else sub
                if both is None:
                    return None
                properties[name] = both
            out[key] = properties
        else:
            return None  # two different values of one keyword: an allOf of them is not expressible here
    return out


def _objects_merge(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether `a`'s additionalProperties (which applies to what `a` does not list) still means the
    same beside `b`'s properties: only if `b` lists nothing `a` does not."""
    if a.get("additionalProperties", True) is True and "unevaluatedProperties" not in a:
        return True
    listed = set(a.get("properties") or {})
    return set(b.get("properties") or {}) <= listed and "patternProperties" not in b


def _type_set(value: Any) -> set[str]:
    """The types named, with "integer" for "number" (every integer is a number)."""
    types = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else set()
    return types | {"integer"} if "number" in types else types


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
