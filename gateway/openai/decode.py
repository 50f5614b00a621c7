"""Strict decoding of request bodies into wire Structs, with the client's mistake named as OpenAI does.

Litestar's own body decoding coerces ("5" becomes 5) and answers in its own error shape; decoding here
keeps one rule for every route: a wrong type or an unknown field is a 400 whose `param` is the field's
path, and every 400 carries a `code` (OpenAI's: `unknown_parameter`, `invalid_type`,
`missing_required_parameter`, `invalid_value`, ...). A body nested deeper than MAX_NESTING is refused:
every walk over a schema after decoding recurses once per level. msgspec bounds its own recursion (a
RecursionError past Python's limit, ~1,000 levels), and a wire type bounds the depth of what it
declares; so after decoding, only the values the type leaves free (`Any`: schemas, tool parameters,
template arguments) are walked for their depth, not the whole body (a 16,000-token chat: ~0.1 ms of
scanning its text became ~2 us).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi
import numpy as np

from shared.errors import InvalidRequestError

T = TypeVar("T")

# Real-world JSON schemas nest to about 17 levels (JSONSchemaBench); 128 leaves them room and keeps
# the decoder and the schema checks far from Python's recursion limit.
MAX_NESTING = 128
# an escaped backslash or quote, the only escapes that can hide or fake a string's end (inside a string
# only: outside one, JSON has no backslash); matched left to right, as a parser reads a run of them
_QUOTING_ESCAPE = re.compile(rb'\\[\\"]')
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"[]{}')))  # all but quotes and brackets
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1

_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")

# Fields that OpenAI, vLLM or llama.cpp define and we cannot honour, with the reason: still a 400 (the
# client asked for something we would not do), but one that says why. Any other unknown field gets
# OpenAI's own message.
_UNSUPPORTED = {
    "audio": "this server writes text only; audio output is not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "the served models do not reason in a separate phase; remove reasoning_effort",
    "verbosity": "verbosity is not supported; ask for the length you want in the prompt or max_tokens",
    "functions": "the legacy `functions` field is not supported; send `tools`",
    "function_call": "the legacy `function_call` field is not supported; send `tool_choice` (or, in a "
    "message, `tool_calls`)",
    "guided_whitespace_pattern": "a custom whitespace pattern is not supported; JSON is written compactly",
}


def _param(message: str) -> tuple[str, str | None]:
    """Split msgspec's message into (reason, field path), e.g. ("Expected `int`...", "max_tokens")."""
    path: str | None = None
    at = _AT.search(message)
    if at:
        message = message[: at.start()]
        path = at.group("path").replace("[...]", "") or None
    missing = _MISSING.search(message) or _UNKNOWN.search(message)
    if missing:
        path = f"{path}.{missing.group('field')}" if path else missing.group("field")
    return message, path


def _unknown_field(message: str, param: str | None) -> InvalidRequestError | None:
    """OpenAI's answer to a field it does not know, or our reason for one we know and cannot honour."""
    unknown = _UNKNOWN.search(message)
    if unknown is None:
        return None
    field = unknown.group("field")
    reason = _UNSUPPORTED.get(field)
    text = f"{field}: {reason}" if reason else f"Unrecognized request argument supplied: {field}"
    where = f" (at `{param}`)" if param and param != field else ""
    code = "unsupported_parameter" if reason else "unknown_parameter"
    return InvalidRequestError(text + where, param=param, code=code)


def nesting_depth(body: bytes) -> int:
    """How deeply the JSON text nests arrays and objects, at C speed: escaped backslashes and quotes
    are dropped (other escapes hide nothing), so each quote left opens or closes a string; then
    everything but quotes and brackets, then every string's text; one cumulative sum runs over the
    brackets left. ~0.1 ms for an 80 KB chat (a regex matching whole strings took 2 ms; one dropping
    every escape, 0.15). Decoding runs it only for a body whose free JSON is too deep or too large
    to walk (free_depth), or that msgspec found too deep to decode."""
    flat = _QUOTING_ESCAPE.sub(b"", body).translate(None, _NOT_STRUCTURE)
    bare = np.frombuffer(b"".join(flat.split(b'"')[::2]), dtype=np.uint8)
    if bare.size == 0:
        return 0
    return int(np.cumsum(_DEPTH_STEP[bare], dtype=np.int64).max(initial=0))


# a walk past this many values of free JSON stops and scans the body's text instead (linear at C speed)
_WALK_AT_MOST = 4096
_CONTAINERS = (msgspec.Struct, dict, list, tuple, msgspec.Raw)
_SCALARS = (
    mi.StrType, mi.BytesType, mi.ByteArrayType, mi.MemoryViewType, mi.IntType, mi.FloatType, mi.BoolType,
    mi.NoneType, mi.LiteralType, mi.EnumType, mi.DecimalType, mi.UUIDType, mi.DateTimeType, mi.DateType,
    mi.TimeType, mi.TimeDeltaType,
)  # fmt: skip


def _unbounded(t: mi.Type, holding: frozenset[type] = frozenset()) -> bool:
    """Whether a value of type `t` can nest deeper than the type itself says: it holds free JSON
    (`Any`, or raw JSON text), a Struct that holds itself, or a type this walk does not know."""
    if isinstance(t, mi.StructType):
        inside = holding | {t.cls}
        return t.cls in holding or any(_unbounded(f.type, inside) for f in t.fields)
    if isinstance(t, mi.UnionType):
        return any(_unbounded(member, holding) for member in t.types)
    if isinstance(t, mi.Metadata):
        return _unbounded(t.type, holding)
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        return _unbounded(t.item_type, holding)
    if isinstance(t, mi.TupleType):
        return any(_unbounded(item, holding) for item in t.item_types)
    if isinstance(t, mi.DictType):
        return _unbounded(t.key_type, holding) or _unbounded(t.value_type, holding)
    return not isinstance(t, _SCALARS)


@cache
def _free_fields(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields of a wire Struct whose values can nest without a bound its type sets."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return tuple(f.name for f in info.fields if _unbounded(f.type, frozenset({cls})))


def free_depth(value: Any, body: bytes) -> int:
    """How deeply a decoded body nests along the paths its type leaves free, counting every object and
    array from the body's top; the depth of every other path is bounded by its type (a dozen levels at
    most for our wire types, far below MAX_NESTING). A walk over more than _WALK_AT_MOST free values
    gives way to the scan of the whole body, which is exact and linear at C speed."""
    deepest, visited = 0, 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, msgspec.Struct):
            children: Any = (getattr(item, name) for name in _free_fields(type(item)))
        elif isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:  # raw JSON text kept undecoded, or an object of a type the walk does not know
            return nesting_depth(body)
        deepest = max(deepest, level)
        visited += 1
        if deepest > MAX_NESTING or visited > _WALK_AT_MOST:
            return nesting_depth(body)
        stack.extend((child, level + 1) for child in children if isinstance(child, _CONTAINERS))
    return deepest


def _too_deep(depth: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"the request body nests {depth} levels of arrays and objects; at most {MAX_NESTING} are accepted",
        code="nesting_too_deep",
    )


def _type_code(reason: str) -> str:
    if reason.startswith("Expected `"):
        return "invalid_type"
    if reason.startswith("Object missing required field"):
        return "missing_required_parameter"
    return "invalid_value"


def decode_body(body: bytes, type_: type[T]) -> T:
    if not body.strip():
        raise InvalidRequestError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        value = msgspec.json.decode(body, type=type_, strict=True)
    except RecursionError:
        raise _too_deep(nesting_depth(body)) from None
    except msgspec.ValidationError as exc:
        reason, param = _param(str(exc))
        if unknown := _unknown_field(reason, param):
            raise unknown from None
        where = f" (at `{param}`)" if param else ""
        raise InvalidRequestError(
            f"invalid request: {reason}{where}", param=param, code=_type_code(reason)
        ) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(
            f"the request body is not valid JSON ({exc}); send a JSON object with Content-Type: "
            "application/json",
            code="invalid_json",
        ) from None
    if (depth := free_depth(value, body)) > MAX_NESTING:
        raise _too_deep(depth)
    return value
