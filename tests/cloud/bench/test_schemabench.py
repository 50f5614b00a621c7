"""`ctxfuse bench schemas` over a small JSONSchemaBench file, with the default model's tokenizer: a
refused schema is counted by its keyword, compiled ones have every instance fed through the matcher
token by token, and a grammar that accepts an instance labelled invalid is reported (exit 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cloud.bench.schemabench import Bench, Report, in_schema_order, load_cases, refusal_reason, run
from cloud.grammar.schema_support import check_schema
from cloud.model.tokenizer import Tokenizer
from ctxfuse.cli import main
from shared.errors import InvalidRequestError

INT = {"type": "integer"}
PERSON = {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _row(id_: str, schema: Any, *tests: tuple[bool, Any]) -> dict[str, Any]:
    return {"id": id_, "schema": schema, "tests": [{"valid": v, "data": d} for v, d in tests]}


ROWS = [
    # keys out of the schema's order, and a name that is several tokens of non-ASCII text
    _row(
        "person",
        PERSON,
        (True, {"age": 3, "name": "Zoë 東京"}),
        (False, {"name": "x", "age": -1}),
        (False, {"name": "x"}),
    ),
    _row("unique", {"type": "array", "items": INT, "uniqueItems": True}, (True, [1, 2])),
    _row("deps", {"type": "object", "properties": {"a": INT}, "dependencies": {"a": ["b"]}}, (True, {})),
    _row("bounded", {"type": "integer", "minimum": 1, "maximum": 3}, (True, 2), (False, 4), (False, "2")),
]


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


def _write(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_counts_compiled_refused_and_every_instance(tok: Tokenizer, tmp_path: Path) -> None:
    report = run(tok, _write(tmp_path, ROWS))
    assert (report.schemas, report.compiled, report.refused) == (4, 2, 2)
    assert report.refused_by_reason == {"uniqueItems": 1, "dependencies": 1}
    assert (report.valid_accepted, report.valid_rejected) == (2, 0)
    assert (report.invalid_rejected, report.invalid_accepted) == (4, 0)
    assert report.instances_checked == 6 and report.label_disagreements == 0


def test_limit_takes_the_first_schemas(tok: Tokenizer, tmp_path: Path) -> None:
    report = run(tok, _write(tmp_path, ROWS), limit=2)
    assert report.schemas == 2 and [c.id for c in load_cases(_write(tmp_path, ROWS), 2)] == [
        "person",
        "unique",
    ]


def test_an_accepted_invalid_instance_is_reported(tok: Tokenizer, tmp_path: Path) -> None:
    # labelled invalid, yet valid: the grammar accepts it, so the bench reports what a fail-open looks like
    rows = [_row("mislabelled", {"type": "integer", "maximum": 3}, (False, 2))]
    report = run(tok, _write(tmp_path, rows))
    assert report.invalid_accepted == 1 and report.label_disagreements == 1
    assert [(c.id, c.text) for c in report.invalid_accepted_cases] == [("mislabelled", "2")]


def test_schemas_are_read_as_json_schema_and_compact_enum_spelling_is_told_apart(
    tok: Tokenizer, tmp_path: Path
) -> None:
    # the labels are JSON Schema validity: an unlisted property is allowed (no strict reading), but
    # one the schema types is still checked; xgrammar writes an object listed in an enum compactly
    rows = [
        _row(
            "open",
            {"type": "object", "properties": {"a": INT}},
            (True, {"a": 1, "extra": 2}),
            (False, {"a": "s"}),
        ),
        _row("listed", {"enum": [{"k": 1}]}, (True, {"k": 1})),
    ]
    report = run(tok, _write(tmp_path, rows))
    assert (report.valid_accepted, report.invalid_rejected) == (1, 1)
    assert report.valid_rejected == 1 and report.valid_rejected_spelling_only == 1
    assert [(c.id, c.spelling_only) for c in report.valid_rejected_cases] == [("listed", True)]


def test_matcher_is_fed_the_tokenizers_tokens(tok: Tokenizer) -> None:
    bench = Bench(tok)
    check_schema(PERSON, "schema")
    from shared.grammar_spec import GrammarSpec

    grammar = bench.compiler.compile(GrammarSpec.json_schema(PERSON))
    assert len(tok.encode('{"name": "Zoë 東京", "age": 3}')) > 3
    assert bench.accepts(grammar, '{"name": "Zoë 東京", "age": 3}')
    assert not bench.accepts(grammar, '{"name": "Zoë 東京", "age": 3')  # cannot end there
    assert not bench.accepts(grammar, '{"name":"Zoë","age":3}')  # the grammar writes ", " and ": "


def test_instances_follow_the_order_of_the_branch_they_match() -> None:
    schema = {
        "$defs": {"b": {"type": "object", "properties": {"y": INT, "x": INT}}},
        "type": "object",
        "properties": {"id": INT},
        "anyOf": [{"properties": {"q": INT}}, {"$ref": "#/$defs/b"}],
    }
    ordered = in_schema_order(schema, schema, {"x": 1, "id": 2, "y": 3})
    assert list(ordered) == ["id", "y", "x"]
    items = {"type": "array", "items": {"type": "object", "properties": {"b": INT, "a": INT}}}
    assert [list(item) for item in in_schema_order(items, items, [{"a": 1, "b": 2}])] == [["b", "a"]]


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "format": "hostname"}, 'format "hostname"'),
        ({"$ref": "#/nowhere"}, 'invalid_schema: $ref "#/nowhere" points at nothing'),
    ],
)
def test_refusals_are_grouped_by_keyword(schema: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_schema(schema, "schema")
    assert refusal_reason(caught.value) == reason


def test_cli_prints_the_report_and_exits_nonzero_on_a_fail_open(
    gguf_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _write(tmp_path, ROWS)
    out = tmp_path / "report.json"
    args = [
        "bench",
        "schemas",
        "--data",
        str(data),
        "--model",
        str(gguf_path),
        "--limit",
        "1",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["compiled"] == 1
    assert set(printed) == set(Report.__dataclass_fields__) - {
        "valid_rejected_cases",
        "invalid_accepted_cases",
        "refused_ids",
    }
    bad = _write(tmp_path, [_row("mislabelled", {"type": "integer", "maximum": 3}, (False, 2))])
    assert main(["bench", "schemas", "--data", str(bad), "--model", str(gguf_path), "--details"]) == 1
    assert json.loads(capsys.readouterr().out)["invalid_accepted_cases"][0]["id"] == "mislabelled"
