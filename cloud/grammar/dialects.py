"""Older JSON Schema drafts, rewritten into draft 2020-12, the one dialect the checker and the grammar
read.

What differs, and how each is carried over so the rewritten schema asks exactly what the original does:
- draft 4 spells `$id` as `id`, and its `exclusiveMinimum`/`exclusiveMaximum` are booleans that make
  `minimum`/`maximum` strict; they become the numeric 2020-12 keywords.
- up to draft 7, an `$id` of "#name" names the schema as 2020-12's `$anchor` does.
- up to draft 7, keywords beside a `$ref` are ignored: only the `$ref` is kept (and the definitions
  other `$ref`s may point into).
- up to 2019-09, `items` may be an array (a tuple) with `additionalItems` for the rest: they become
  `prefixItems` and `items`; an `additionalItems` beside a single `items` schema does nothing and goes.
- `dependencies` stays as written: the checker refuses it by that name (its two 2019-09 halves,
  dependentRequired and dependentSchemas, are not enforced either).
A nested `$schema` naming the root's own draft says nothing new and goes. A `$schema` other than
these five is left as it is, for the checker to refuse before anything would fetch it. The original
is never changed; the finished output is still checked against it as sent.
"""

from __future__ import annotations

import copy
import re
from typing import Any

CURRENT = "https://json-schema.org/draft/2020-12/schema"
# $schema value, with or without the trailing "#" -> draft name
_NAMES = {
    "http://json-schema.org/draft-04/schema": "draft-04",
    "http://json-schema.org/draft-06/schema": "draft-06",
    "http://json-schema.org/draft-07/schema": "draft-07",
    "https://json-schema.org/draft/2019-09/schema": "2019-09",
    "https://json-schema.org/draft/2020-12/schema": "2020-12",
}
KNOWN = frozenset(_NAMES) | frozenset(f"{uri}#" for uri in _NAMES)
_REF_ALONE = frozenset({"draft-04", "draft-06", "draft-07"})  # siblings of $ref are ignored
_TUPLE_ITEMS = _REF_ALONE | {"2019-09"}  # items may be an array

# where a schema holds subschemas, in any of these drafts: one schema, a name -> schema map, a list
_ONE = ("additionalProperties", "items", "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_ONE_MORE = ("not", "if", "then", "else", "contains", "propertyNames", "contentSchema")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_KEPT_BESIDE_REF = ("$ref", "$defs", "definitions")
_ANCHOR = re.compile(r"[A-Za-z_][-A-Za-z0-9._]*")


def dialect(schema: object) -> str | None:
    """The draft a schema's root `$schema` names ("draft-04" ... "2020-12"); 2020-12 when it names
    none; None for any other value."""
    if not isinstance(schema, dict) or "$schema" not in schema:
        return "2020-12"
    uri = schema["$schema"]
    return _NAMES.get(uri.removesuffix("#")) if isinstance(uri, str) and uri in KNOWN else None


def to_current(schema: dict[str, Any]) -> dict[str, Any]:
    """A 2020-12 copy of a schema written in a known older draft; the schema itself otherwise."""
    draft = dialect(schema)
    if draft is None or draft == "2020-12":
        return schema
    out = copy.deepcopy(schema)
    _rewrite(out, draft)
    out["$schema"] = CURRENT
    return out


def _rewrite(node: Any, draft: str) -> None:
    if not isinstance(node, dict):
        return
    if dialect(node) == draft:  # a nested copy of the root's own $schema (definitions pasted in)
        node.pop("$schema", None)
    if draft in _REF_ALONE and isinstance(node.get("$ref"), str):
        for key in [key for key in node if key not in _KEPT_BESIDE_REF]:
            del node[key]
    if draft == "draft-04":
        _rewrite_draft4(node)
    if draft in _REF_ALONE:
        _rewrite_anchor(node)
    if draft in _TUPLE_ITEMS:
        _rewrite_items(node)
    for sub in _subschemas(node):
        _rewrite(sub, draft)


def _rewrite_draft4(node: dict[str, Any]) -> None:
    if isinstance(node.get("id"), str) and "$id" not in node:
        node["$id"] = node.pop("id")
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        strict = node.get(flag)
        if not isinstance(strict, bool):
            continue
        del node[flag]
        if strict and bound in node:  # draft 4's meta-schema asks for the bound beside the flag
            node[flag] = node.pop(bound)


def _rewrite_anchor(node: dict[str, Any]) -> None:
    """Up to draft 7 an `$id` of a bare fragment ("#name") names the schema, as 2020-12's $anchor
    does; in 2020-12 an $id may not hold a fragment at all. Any other fragment-only $id (a pointer
    such as "#/definitions/a", which generated schemas write where they stand) names nothing a
    pointer $ref could not reach, and goes."""
    ident = node.get("$id")
    if not isinstance(ident, str) or not ident.startswith("#"):
        return
    del node["$id"]
    if _ANCHOR.fullmatch(ident[1:]) and "$anchor" not in node:
        node["$anchor"] = ident[1:]


def _rewrite_items(node: dict[str, Any]) -> None:
    items = node.get("items")
    if isinstance(items, list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    elif "additionalItems" in node:
        del node["additionalItems"]  # only ever applies beside an items array


def _subschemas(node: dict[str, Any]) -> list[Any]:
    subs: list[Any] = []
    for key, value in node.items():
        if key in _ONE + _ONE_MORE and isinstance(value, dict):
            subs.append(value)
        elif key in _MAP and isinstance(value, dict):
            subs.extend(value.values())  # a dependencies array value is no schema: skipped as no dict
        elif key in _LIST and isinstance(value, list):
            subs.extend(value)
    return subs
