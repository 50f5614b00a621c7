"""The one output constraint a request asks for, from whichever field carries it: OpenAI's
`response_format` (json_object, json_schema, or the `regex` type some clients send), vLLM's
`structured_outputs` and older `guided_*` fields, llama.cpp's `grammar` and `json_schema`.

At most one may be set: two would be two answers to one question, so that is a 400 rather than a
guess at which wins. A JSON constraint becomes a Structure (the finished output is checked against its
schema: structured_result.py); a regex, a choice or a grammar becomes a bare GrammarSpec, and the
output is plain text, returned as the model wrote it.
"""

from __future__ import annotations

from collections.abc import Callable

from cloud.grammar.text_grammar import choice_spec, ebnf_spec, regex_spec
from gateway.openai.structured import Structure, response_format_structure, schema_structure
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec
from shared.protocol import SamplingFields, StructuredOutputs

Constraint = Structure | GrammarSpec
_Build = Callable[[], Constraint]


def _structured_outputs(so: StructuredOutputs, confidence: bool) -> tuple[str, _Build]:
    asked: list[tuple[str, _Build]] = []
    if so.json is not None:
        schema = so.json
        asked.append(
            (
                "structured_outputs.json",
                lambda: schema_structure(schema, "structured_outputs.json", confidence),
            )
        )
    if so.regex is not None:
        regex = so.regex
        asked.append(("structured_outputs.regex", lambda: regex_spec(regex, "structured_outputs.regex")))
    if so.choice is not None:
        choice = so.choice
        asked.append(("structured_outputs.choice", lambda: choice_spec(choice, "structured_outputs.choice")))
    if so.grammar is not None:
        grammar = so.grammar
        asked.append(("structured_outputs.grammar", lambda: ebnf_spec(grammar, "structured_outputs.grammar")))
    if len(asked) != 1:
        raise InvalidRequestError(
            "structured_outputs must hold exactly one of json, regex, choice and grammar",
            param="structured_outputs",
        )
    return asked[0]


def _response_format(req: SamplingFields, confidence: bool) -> tuple[str, _Build] | None:
    rf = req.response_format
    # a regex beside another type, or a json_schema beside type regex, would be ignored: refuse it
    if rf is not None and rf.regex is not None and rf.type != "regex":
        raise InvalidRequestError(
            f"response_format.regex goes with type regex, not {rf.type}", param="response_format.regex"
        )
    if rf is not None and rf.type == "regex" and rf.json_schema is not None:
        raise InvalidRequestError(
            "response_format type regex takes a regex, not a json_schema", param="response_format.json_schema"
        )
    if rf is None or rf.type == "text":
        return None
    if rf.type != "regex":
        return "response_format", lambda: _some(response_format_structure(rf, confidence))
    regex = rf.regex
    if regex is None:
        raise InvalidRequestError("response_format type regex needs a regex", param="response_format.regex")
    return "response_format", lambda: regex_spec(regex, "response_format.regex")


def _some(structure: Structure | None) -> Structure:
    if structure is None:  # response_format_structure answers for every json_* type
        raise InvalidRequestError("response_format asks for no structure", param="response_format")
    return structure


def _asked(req: SamplingFields, confidence: bool) -> list[tuple[str, _Build]]:
    """(field, how to build its constraint) for every constraint field the request sets, in order."""
    asked: list[tuple[str, _Build]] = []
    if rf := _response_format(req, confidence):
        asked.append(rf)
    if req.structured_outputs is not None:
        asked.append(_structured_outputs(req.structured_outputs, confidence))
    if (guided_json := req.guided_json) is not None:
        asked.append(("guided_json", lambda: schema_structure(guided_json, "guided_json", confidence)))
    if (guided_regex := req.guided_regex) is not None:
        asked.append(("guided_regex", lambda: regex_spec(guided_regex, "guided_regex")))
    if (guided_choice := req.guided_choice) is not None:
        asked.append(("guided_choice", lambda: choice_spec(guided_choice, "guided_choice")))
    if (guided_grammar := req.guided_grammar) is not None:
        asked.append(("guided_grammar", lambda: ebnf_spec(guided_grammar, "guided_grammar")))
    if (grammar := req.grammar) is not None:
        asked.append(("grammar", lambda: ebnf_spec(grammar, "grammar")))
    if (json_schema := req.json_schema) is not None:
        asked.append(("json_schema", lambda: schema_structure(json_schema, "json_schema", confidence)))
    return asked


def output_constraint(req: SamplingFields, confidence: bool) -> Constraint | None:
    """The request's constraint, checked (a bad schema, regex or grammar is a 400 naming its field),
    or None when it asks for none. `confidence`: ctxfuse.field_confidence, which needs JSON."""
    asked = _asked(req, confidence)
    if len(asked) > 1:
        fields = ", ".join(field for field, _ in asked)
        raise InvalidRequestError(
            f"a request may carry one output constraint; this one sets {fields}",
            param=asked[1][0],
            code="conflicting_constraints",
        )
    if not asked:
        return None
    field, build = asked[0]
    constraint = build()
    if confidence and isinstance(constraint, GrammarSpec):
        raise InvalidRequestError(
            f"ctxfuse.field_confidence needs JSON output; {field} asks for plain text",
            param="ctxfuse.field_confidence",
        )
    return constraint
