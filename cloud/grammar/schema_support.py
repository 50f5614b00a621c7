"""Refusing JSON Schemas that constrained decoding cannot enforce, before anything is queued.

Never fail open: xgrammar compiles many keywords and then ignores them (uniqueItems, not, if/then, a
lookahead inside a pattern, maxLength beside a pattern, any keyword beside a $ref, an anyOf or an
enum), and a grammar that ignores a keyword lets the model write output that breaks the schema. So a
schema passes only if every keyword in it was shown to be enforced; anything else is refused (400,
code unsupported_schema_feature) naming the keyword and the JSON path of the schema that holds it. A
malformed schema (not JSON Schema, or a $ref that points nowhere) is refused too (code invalid_schema).
Schemas that are well formed but match nothing (minItems above maxItems, an empty enum) pass here and
fail to compile, which the grammar compiler also reports as invalid_schema.

What is judged is the schema the grammar is compiled from: an older draft rewritten into 2020-12
(dialects.py) and shapes xgrammar would misread rewritten into equivalent ones (shapes.py).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema_rs

from shared.errors import InvalidRequestError

from .dialects import KNOWN
from .formats import FORMAT_PATTERNS, LLG_PATTERNED
from .llg_engine import llg_grammar_text, llg_refusal
from .schema_paths import Path, RefError, follow, format_path, reachable
from .shapes import normalized

# Measured against xgrammar 0.2.9 (compile_json_schema with any_whitespace=False, strict_mode=True) by
# the probes in tests/cloud/grammar/test_schema_support.py: a keyword is supported when the grammar
# rejects every probe instance that violates it. Re-run those probes before upgrading xgrammar.
# Several hold only in some company (a "type" beside them, nothing beside an enum or a $ref, one of
# pattern/format/lengths, multipleOf within limits); the _Checker methods hold those rules.
# Keywords in neither set are annotations (title, description, default, examples, x-anything).
SUPPORTED_KEYWORDS = frozenset(
    {"type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf"}
    | {"properties", "required", "additionalProperties", "unevaluatedProperties", "minProperties"}
    | {"maxProperties", "items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"}
    | {"minLength", "maxLength", "pattern", "format"}
    | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
# compiled and then ignored by the grammar ($dynamicAnchor and $recursiveAnchor do nothing without these)
REFUSED_KEYWORDS = frozenset(
    {"uniqueItems", "contains", "minContains", "maxContains", "patternProperties", "propertyNames"}
    | {"dependentRequired", "dependentSchemas", "dependencies", "not", "if", "then", "else"}
    | {"$dynamicRef", "$recursiveRef", "contentEncoding", "contentMediaType", "contentSchema"}
    | {"additionalItems"}  # only acts beside an items array, which xgrammar cannot compile
)
# Every other value is refused: hostname (labels over 63 characters), idn-*, iri*, regex, and the
# rest unchecked. xgrammar's own date, time, date-time and ipv4 are loose (it takes 2024-02-30,
# 22:59:60Z, 01.2.3.4); those four are compiled as exact patterns instead (formats.py).
SUPPORTED_FORMATS = frozenset(
    {"duration", "email", "ipv6", "uri", "uri-reference", "uri-template", "uuid", "json-pointer"}
    | {"relative-json-pointer"}
    | FORMAT_PATTERNS.keys()
)
# llguidance (llg_engine.py), for schemas the rules below refuse for xgrammar: measured by the probes
# in tests/cloud/grammar/test_llg_support.py through its matcher. It applies keywords in any company
# (beside an enum, a $ref or a composition, a pattern beside lengths or a format, no "type") and
# refuses by itself what it cannot enforce (an unimplemented keyword, a oneOf it cannot show
# exclusive, min/maxProperties beside optional properties), so here only what it would read
# differently from the schema is refused: the keywords below, formats not probed, patterns.
# (llguidance's "date" and "date-time" take 2023-02-29: it gets our patterns for them, formats.py)
LLG_ENFORCED = frozenset({"patternProperties"})
LLG_FORMATS = frozenset({"time", "email", "uuid", "uri", "ipv4"})
Engine = Literal["xgrammar", "llguidance"]
# Drafts read by rewriting them into 2020-12 (dialects.py). Checked before jsonschema_rs reads the
# schema: it would fetch an unknown $schema URL.
DIALECTS = KNOWN

_ENFORCE = "constrained decoding cannot enforce it"
_TYPED = {  # keyword -> the "type" it constrains; without "type" xgrammar ignores several of them
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "number"),
    **dict.fromkeys(("items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"), "array"),
    **dict.fromkeys(("properties", "required", "additionalProperties", "unevaluatedProperties"), "object"),
    **dict.fromkeys(("minProperties", "maxProperties"), "object"),
}
_COMPOSITION = ("$ref", "anyOf", "oneOf", "allOf")  # each is applied alone: keywords beside it are dropped
_INT64 = 2**63  # xgrammar holds integers as int64: a larger const or enum value is written rounded
_GROUP = re.compile(r"\(\?(:|P?<(?![=!]))")  # (?:...) and named groups; not (?=, (?!, (?<=, (?<!, (?i)


def check_schema(
    schema: object, param: str, engines: tuple[Engine, ...] = ("xgrammar", "llguidance")
) -> Engine:
    """The grammar engine that enforces every keyword of `schema`: xgrammar where it can, else
    llguidance. Raise InvalidRequestError (400) when `schema` is no JSON Schema object or neither
    engine enforces it, naming the keyword xgrammar cannot enforce. `param` names the request field;
    `engines` narrows the choice (xgrammar's own verdict: its probes)."""
    try:
        _check(schema, _Checker(schema, param))
        return "xgrammar"
    except InvalidRequestError as exc:
        if (
            exc.code != "unsupported_schema_feature"
            or not isinstance(schema, dict)
            or "llguidance" not in engines
        ):
            raise
        refusal = exc
    _check(schema, _LlgChecker(schema, param))
    reason = llg_refusal(llg_grammar_text(schema))
    if reason is not None:
        message = f"{refusal.message}; nor can llguidance ({reason})"
        raise InvalidRequestError(message, param=param, code="unsupported_schema_feature")
    return "llguidance"


def _check(schema: object, checker: _Checker) -> None:
    if not isinstance(schema, dict):
        raise checker.invalid((), f"a schema must be a JSON object, not {_json_type(schema)}")
    checker.check_identity(schema, ())
    try:
        jsonschema_rs.meta.validate(schema)  # in the schema's own draft
        current = checker.root = normalized(schema)  # as the grammar is compiled from it
        for node, path in reachable(current):
            checker.check_node(node, path)
        # only now, with remote $refs refused (it would fetch them): what the meta-schema leaves out,
        # such as a pattern that is no regex
        jsonschema_rs.validator_for(current)
    except jsonschema_rs.ValidationError as exc:
        raise checker.invalid(tuple(exc.instance_path), exc.message) from None
    except jsonschema_rs.ReferencingError as exc:
        raise checker.invalid((), str(exc)) from None
    except (RecursionError, ValueError) as exc:  # jsonschema_rs: ValueError("Recursion limit reached")
        deep = isinstance(exc, RecursionError) or "recursion" in str(exc).lower()
        raise checker.invalid((), "the schema nests too deeply to be read" if deep else str(exc)) from None
    except RefError as exc:
        what = f"$ref {json.dumps(exc.ref)}"
        if exc.remote:
            raise checker.unsupported(what, exc.path, exc.detail) from None
        raise checker.invalid(exc.path, f"{what} {exc.detail}") from None


class _Checker:
    def __init__(self, root: Any, param: str) -> None:
        self.root = root
        self.param = param

    def invalid(self, path: Path, detail: str) -> InvalidRequestError:
        message = f"{self.param} is not a valid JSON Schema: at {format_path(path)}: {detail}"
        return InvalidRequestError(message, param=self.param, code="invalid_schema")

    def unsupported(self, what: str, path: Path, why: str = "") -> InvalidRequestError:
        message = f"{what} at {format_path(path)} is not supported: {_ENFORCE}" + (f" ({why})" if why else "")
        return InvalidRequestError(message, param=self.param, code="unsupported_schema_feature")

    def check_identity(self, node: dict[str, Any], path: Path) -> None:
        dialect = node.get("$schema")  # one that is not a string is left to the meta-schema
        if isinstance(dialect, str) and (path or dialect not in DIALECTS):
            raise self.unsupported("$schema", path, "only draft 2020-12, 2019-09, 7, 6 or 4, at the root")
        # a nested $id with no $ref under it changes nothing the grammar reads (generated draft 4
        # schemas put one on every node)
        if "$id" in node and path and _holds_ref(node):
            raise self.unsupported("$id", path, "a nested $id moves where the $refs under it resolve")

    def check_node(self, node: dict[str, Any], path: Path) -> None:
        for key, value in node.items():
            if key in REFUSED_KEYWORDS and not (key == "uniqueItems" and value is False):
                raise self.unsupported(key, path)
        self.check_identity(node, path)
        words = SUPPORTED_KEYWORDS.intersection(node)
        if "enum" in words or "const" in words:
            self.check_listed(node, path, words)
        elif words.intersection(_COMPOSITION):
            self.check_composition(node, path, words)
        else:
            self.check_typed(node, path, words)

    def check_listed(self, node: dict[str, Any], path: Path, words: frozenset[str]) -> None:
        """The grammar writes the enum (or const) values verbatim and drops every other keyword."""
        listing = "enum" if "enum" in node else "const"
        extra = sorted(words - {listing, "type"})
        if extra:
            raise self.unsupported(extra[0], path, f"beside {listing}, which xgrammar applies alone")
        of_type = jsonschema_rs.validator_for({"type": node["type"]}) if "type" in node else None
        for value in node["enum"] if listing == "enum" else [node["const"]]:
            if of_type is not None and not of_type.is_valid(value):
                raise self.unsupported(listing, path, f'{json.dumps(value)} is not of the "type" given')
            if _has_huge_int(value):
                raise self.unsupported(listing, path, f"{json.dumps(value)} holds an integer beyond 64 bits")

    def check_composition(self, node: dict[str, Any], path: Path, words: frozenset[str]) -> None:
        kind = next(word for word in _COMPOSITION if word in words)
        extra = sorted(words - {kind})
        if extra:
            raise self.unsupported(extra[0], path, f"beside {kind}, which xgrammar applies alone")
        if kind == "allOf" and len(node["allOf"]) > 1:
            raise self.unsupported("allOf", path, "with more than one schema")
        if kind == "oneOf" and not self.exclusive(node["oneOf"], path):
            why = "its branches must differ in type, or in const/enum values of a property all require"
            raise self.unsupported("oneOf", path, why)

    def check_typed(self, node: dict[str, Any], path: Path, words: frozenset[str]) -> None:
        types = _types(node)
        untyped = sorted(word for word in words if word in _TYPED and not types)
        if untyped:
            raise self.unsupported(untyped[0], path, f'without "type": "{_TYPED[untyped[0]]}" beside it')
        if "string" in types:
            self.check_string(node, path)
        if "multipleOf" in node and types & {"integer", "number"} and not _multiple_enforced(node, types):
            why = 'only on "type": "integer", a whole step up to 1024, with no bounds or both within 10000'
            raise self.unsupported("multipleOf", path, why)
        missing = [name for name in node.get("required", []) if name not in node.get("properties", {})]
        if "object" in types and missing:
            raise self.unsupported("required", path, f"{json.dumps(missing[0])} is not under properties")
        absent = [name for name, sub in (node.get("properties") or {}).items() if sub is False]
        if "object" in types and absent:  # llguidance reads it: the property may not be there
            why = f"{json.dumps(absent[0])}: false (must be absent), which xgrammar cannot compile"
            raise self.unsupported("properties", path, why)

    def check_string(self, node: dict[str, Any], path: Path) -> None:
        shaped = next((word for word in ("format", "pattern") if word in node), None)
        extra = [word for word in ("pattern", "minLength", "maxLength") if word in node and word != shaped]
        if shaped and extra:
            raise self.unsupported(extra[0], path, f"beside {shaped}, which xgrammar applies alone")
        if "format" in node and node["format"] not in SUPPORTED_FORMATS:
            raise self.unsupported(f"format {json.dumps(node['format'])}", path)
        problem = _pattern_problem(node["pattern"]) if "pattern" in node else None
        if problem:
            raise self.unsupported("pattern", path, problem)

    def exclusive(self, branches: list[Any], path: Path) -> bool:
        """Whether no value satisfies two of the oneOf `branches`, so that anyOf, which is what the
        grammar enforces, means oneOf: shown by disjoint types, by disjoint const/enum values of a
        property that every branch, an object, requires, or pair by pair (_excludes)."""
        resolved = [follow(self.root, branch, path)[0] for branch in branches]
        if len(resolved) < 2:
            return True
        if not all(isinstance(branch, dict) for branch in resolved):
            return False
        # every integer is a number
        types = [_types(b) | ({"integer"} if "number" in _types(b) else set()) for b in resolved]
        if all(types) and _disjoint(types):
            return True
        if all(_excludes(a, b) or _excludes(b, a) for i, a in enumerate(resolved) for b in resolved[i + 1 :]):
            return True
        for name in resolved[0].get("required", []):
            values = [self.listed_values(branch, name, path) for branch in resolved]
            if all(v is not None for v in values) and _disjoint(values):
                return True
        return False

    def listed_values(self, branch: dict[str, Any], name: str, path: Path) -> set[tuple[bool, Any]] | None:
        """The scalar values an object `branch` that requires property `name` lists for it, if any."""
        if _types(branch) != {"object"} or name not in branch.get("required", []):
            return None
        prop = follow(self.root, branch.get("properties", {}).get(name), path)[0]
        if not isinstance(prop, dict) or ("enum" not in prop and "const" not in prop):
            return None
        listed = prop["enum"] if "enum" in prop else [prop["const"]]
        if any(isinstance(value, dict | list) for value in listed):
            return None
        return {(isinstance(value, bool), value) for value in listed}  # true and 1 differ in JSON


class _LlgChecker(_Checker):
    """The rules for llguidance, which leave the rest to its own refusals (LLG_ENFORCED above)."""

    def check_node(self, node: dict[str, Any], path: Path) -> None:
        for key, value in node.items():
            if key in REFUSED_KEYWORDS - LLG_ENFORCED and not (key == "uniqueItems" and value is False):
                raise self.unsupported(key, path)
        self.check_identity(node, path)
        listed: list[Any] = node["enum"] if isinstance(node.get("enum"), list) else []
        for value in [*listed, *([node["const"]] if "const" in node else [])]:
            if _has_huge_int(value):
                raise self.unsupported("enum", path, f"{json.dumps(value)} holds an integer beyond 64 bits")
        applies = not _types(node) or "string" in _types(node)  # format and pattern act on strings only
        patterned = node.get("format") in LLG_PATTERNED and "pattern" not in node
        if applies and "format" in node and node["format"] not in LLG_FORMATS and not patterned:
            why = "beside pattern, which llguidance needs for it" if node["format"] in LLG_PATTERNED else ""
            raise self.unsupported(f"format {json.dumps(node['format'])}", path, why)
        problem = (
            _pattern_problem(node["pattern"]) if applies and isinstance(node.get("pattern"), str) else None
        )
        if problem:
            raise self.unsupported("pattern", path, problem)


def _holds_ref(node: Any) -> bool:
    """Whether a $ref is written anywhere inside `node` (enum and const values included: cheap and
    on the safe side)."""
    if isinstance(node, dict):
        return "$ref" in node or any(_holds_ref(value) for value in node.values())
    return isinstance(node, list) and any(_holds_ref(item) for item in node)


def _excludes(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether no value satisfies both branches `a` and `b`: their types share nothing, or both take
    objects only and `a` requires a property `b` forbids (b lists it not, and takes no others)."""
    types_a, types_b = _types(a), _types(b)
    if types_a and types_b and _disjoint([_with_integer(types_a), _with_integer(types_b)]):
        return True
    if types_a != {"object"} or types_b != {"object"}:
        return False
    closed = b.get("additionalProperties") is False and "patternProperties" not in b
    return closed and any(name not in (b.get("properties") or {}) for name in a.get("required", []))


def _with_integer(types: set[str]) -> set[str]:
    return types | {"integer"} if "number" in types else types


def _types(node: dict[str, Any]) -> set[str]:
    declared = node.get("type")
    return set() if declared is None else {declared} if isinstance(declared, str) else set(declared)


def _disjoint(sets: list[Any]) -> bool:
    return sum(len(s) for s in sets) == len(set().union(*sets))


def _multiple_enforced(node: dict[str, Any], types: set[str]) -> bool:
    """xgrammar checks multipleOf on integers with a divisibility automaton of at most 1024 states when
    there are no bounds, and by listing the multiples when both bounds hold at most 10000 integers;
    with one bound, a wider range or a number, it drops multipleOf."""
    step = node["multipleOf"]
    if "number" in types or not float(step).is_integer() or step > 1024:
        return False
    lows = [node[k] + (k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if k in node]
    highs = [node[k] - (k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if k in node]
    if not lows and not highs:
        return True
    return bool(lows and highs) and min(highs) - max(lows) < 10000


def _has_huge_int(value: Any) -> bool:
    if isinstance(value, list | dict):
        return any(_has_huge_int(item) for item in (value.values() if isinstance(value, dict) else value))
    return isinstance(value, int) and not -_INT64 <= value < _INT64


def _pattern_problem(pattern: str) -> str | None:
    """What in `pattern` the grammar would ignore or misread, or None. xgrammar drops lookaheads and
    anchors inside a pattern and cannot compile lookbehinds, backreferences, \\b, \\p or flags."""
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            if pattern[i + 1 : i + 2] in tuple("bBpPk123456789"):
                return f"the escape {pattern[i : i + 2]}"
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif (char == "^" and i > 0) or (char == "$" and i < len(pattern) - 1):
            return f"an anchor {char} inside the pattern"
        elif char == "(" and pattern.startswith("(?", i) and not _GROUP.match(pattern, i):
            return f"the group {pattern[i : i + 3]}, a lookaround or an inline flag"
        i += 1
    return None


def _json_type(value: object) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), "null")
