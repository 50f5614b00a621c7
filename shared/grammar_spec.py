"""What a request asks its output to follow, as plain data: a JSON schema, tool calls (the
functions, whether a call is required, whether several may be made), a regular expression, or an
EBNF/GBNF grammar (a list of choices is a grammar of alternatives: text_grammar.py). The spec travels
with the request's sampling parameters; the grammar compiled from it is looked up by its key, so equal
specs compile once."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "tool_calls", "regex", "ebnf"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    # json_schema and tool_calls: canonical JSON text (the schema, or {"functions", "required",
    # "parallel"}); regex: the pattern; ebnf: the grammar text, whose start rule is `root`
    source: str
    # json_schema only: properties a schema does not list are refused (OpenAI's strict reading); off
    # for json_object mode, whose schema is just {"type": "object"}
    strict: bool = True
    origin: str = "response_format"  # the request field it came from, named by errors; not in the key

    @classmethod
    def json_schema(cls, schema: dict[str, Any], strict: bool = True, origin: str = "") -> GrammarSpec:
        return cls("json_schema", canonical_json(schema), strict, origin or "response_format")

    @classmethod
    def tool_calls(
        cls, functions: dict[str, dict[str, Any]], *, required: bool, parallel: bool
    ) -> GrammarSpec:
        """Calls of `functions` (name -> parameters schema); `required`: at least one call and no
        text; `parallel`: more than one call allowed."""
        source = {"functions": functions, "required": required, "parallel": parallel}
        return cls("tool_calls", canonical_json(source), origin="tools")

    @classmethod
    def regex(cls, pattern: str, origin: str) -> GrammarSpec:
        return cls("regex", pattern, origin=origin)

    @classmethod
    def ebnf(cls, grammar: str, origin: str) -> GrammarSpec:
        return cls("ebnf", grammar, origin=origin)

    @property
    def key(self) -> str:
        """Equal specs share a key (and so one compiled grammar)."""
        text = f"{self.kind}\0{int(self.strict)}\0{self.source}"
        return hashlib.sha256(text.encode()).hexdigest()


def canonical_json(value: Any) -> str:
    # Compact but not key-sorted: the grammar writes properties in the schema's order, so two
    # schemas that differ only in key order are different grammars.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
