"""`ctxfuse bench schemas`: how much of a real-world schema corpus structured output covers, and
whether what it compiles holds.

Each schema of a JSONSchemaBench file (one JSON object a line: id, schema, tests of labelled
instances) goes the way a request's schema goes: check_schema, then the grammar compiler with the
default model's tokenizer (no weights). A refused schema is counted by its reason (the keyword the
refusal names). For a compiled one, every labelled instance is written as the grammar writes JSON
(json.dumps's separators, properties in the schema's order), tokenized, and fed token by token
through the matcher of the engine check_schema chose (xgrammar or llguidance), then the
end-of-sequence token: accepted when every token is and the
matcher ends. A valid instance rejected is lost coverage; an invalid one accepted is a fail-open,
the grammar enforcing less than check_schema claimed.

An invalid instance is only rejected by the grammar if it breaks a keyword, not merely the
properties' order: instances are reordered to the order of the schema branch whose properties
cover the most of their keys, which a valid instance always finds.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema_rs
import llguidance as llg
import xgrammar as xgr

from cloud.grammar.compiled import CompiledGrammar
from cloud.grammar.compiler import GrammarCompiler
from cloud.grammar.formats import grammar_schema
from cloud.grammar.llg_engine import LlgGrammar
from cloud.grammar.schema_paths import RefError, follow
from cloud.grammar.schema_support import check_schema
from cloud.model.tokenizer import Tokenizer
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench-dev.jsonl"
PARAM = "schema"
# "X at $.path is not supported: ... (beside oneOf, which ...)": the reason is X, and the keyword it
# sits beside or lacks where the refusal names one
_WHAT = re.compile(r"^(?P<what>.+?) at \$\S* is not supported")
_BESIDE = re.compile(r"\((?P<how>beside [^\s,]+|without \"type\")")


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    schema: Any
    instances: list[tuple[bool, Any]]  # (labelled valid, instance)


@dataclass(slots=True)
class Failure:
    id: str
    index: int  # which of the schema's instances
    text: str  # the JSON text fed to the matcher (truncated)
    # valid, and accepted written compactly: xgrammar writes enum and const values that way
    spelling_only: bool = False


@dataclass(slots=True)
class Report:
    data: str
    schemas: int = 0
    compiled: int = 0
    compiled_share: float = 0.0
    compiled_by_engine: dict[str, int] = field(default_factory=dict)  # xgrammar, llguidance
    refused: int = 0
    refused_by_reason: dict[str, int] = field(default_factory=dict)
    instances_checked: int = 0
    valid_accepted: int = 0
    valid_rejected: int = 0
    # of those, the ones accepted written without spaces (an object or array listed in an enum or a
    # const, which xgrammar writes compactly): refused by the spelling, not by a keyword
    valid_rejected_spelling_only: int = 0
    invalid_rejected: int = 0
    invalid_accepted: int = 0
    # instances whose label jsonschema_rs (the referee of finished output) does not share
    label_disagreements: int = 0
    valid_rejected_cases: list[Failure] = field(default_factory=list)
    invalid_accepted_cases: list[Failure] = field(default_factory=list)
    refused_ids: dict[str, list[str]] = field(default_factory=dict)  # reason -> a few schema ids
    seconds: float = 0.0


def load_cases(path: Path, limit: int | None = None) -> list[Case]:
    cases: list[Case] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(cases) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                tests = [(bool(t["valid"]), t["data"]) for t in row.get("tests", [])]
                cases.append(Case(str(row["id"]), row["schema"], tests))
    return cases


def refusal_reason(error: InvalidRequestError) -> str:
    """The histogram key of a refusal: its keyword (and what it sits beside), or the error code."""
    message = str(error.message)
    what = _WHAT.match(message)
    if error.code != "unsupported_schema_feature" or what is None:
        return f"{error.code}: {message.split(': ')[-1][:60]}"
    beside = _BESIDE.search(message)
    return what["what"] + (f" ({beside['how']})" if beside else "")


class Bench:
    """check_schema, compile and match, with one tokenizer for every schema."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, cache_size=4)
        self.eos = min(tokenizer.eos_ids)

    def accepts(self, grammar: CompiledGrammar, text: str) -> bool:
        tokens = [*self.tokenizer.encode(text), self.eos]
        if isinstance(grammar, LlgGrammar):
            matcher: llg.LLMatcher = grammar.matcher()
            return all(matcher.consume_token(token) for token in tokens) and matcher.is_stopped()
        xgr_matcher = xgr.GrammarMatcher(grammar)
        return all(xgr_matcher.accept_token(token) for token in tokens) and xgr_matcher.is_terminated()

    def run_case(self, case: Case, report: Report) -> None:
        try:
            engine = check_schema(case.schema, PARAM)
            # the labels are JSON Schema validity: the schema read as JSON Schema says, not strict
            grammar = self.compiler.compile(GrammarSpec.json_schema(case.schema, strict=False, origin=PARAM))
        except InvalidRequestError as exc:
            reason = refusal_reason(exc)
            report.refused += 1
            report.refused_by_reason[reason] = report.refused_by_reason.get(reason, 0) + 1
            ids = report.refused_ids.setdefault(reason, [])
            if len(ids) < 5:
                ids.append(case.id)
            return
        report.compiled += 1
        report.compiled_by_engine[engine] = report.compiled_by_engine.get(engine, 0) + 1
        compiled = grammar_schema(case.schema)
        referee = jsonschema_rs.validator_for(case.schema)
        for index, (valid, instance) in enumerate(case.instances):
            report.instances_checked += 1
            report.label_disagreements += referee.is_valid(instance) != valid
            text = json.dumps(in_schema_order(compiled, compiled, instance), ensure_ascii=False)
            accepted = self.accepts(grammar, text)
            if valid and accepted:
                report.valid_accepted += 1
            elif valid:
                report.valid_rejected += 1
                compact = json.dumps(instance, ensure_ascii=False, separators=(",", ":"))
                spelling_only = self.accepts(grammar, compact)
                report.valid_rejected_spelling_only += spelling_only
                report.valid_rejected_cases.append(Failure(case.id, index, text[:300], spelling_only))
            elif accepted:
                report.invalid_accepted += 1
                report.invalid_accepted_cases.append(Failure(case.id, index, text[:300]))
            else:
                report.invalid_rejected += 1


def run(tokenizer: Tokenizer, data: Path, limit: int | None = None) -> Report:
    start = time.perf_counter()
    report = Report(str(data))
    bench = Bench(tokenizer)
    for case in load_cases(data, limit):
        report.schemas += 1
        bench.run_case(case, report)
    report.compiled_share = report.compiled / report.schemas if report.schemas else 0.0
    report.refused_by_reason = dict(Counter(report.refused_by_reason).most_common())
    report.seconds = time.perf_counter() - start
    return report


def in_schema_order(root: Any, node: Any, value: Any) -> Any:
    """`value` with each object's properties in the order the grammar writes them: those `node`
    lists first, in its order, then those of the composition branch that lists most of the rest."""
    try:
        node, _ = follow(root, node, ())
    except RefError:
        return value
    if not isinstance(node, dict):
        return value
    if isinstance(value, list):
        return [
            in_schema_order(root, sub, item) for sub, item in zip(_item_schemas(node), value, strict=False)
        ]
    if not isinstance(value, dict):
        return value
    listed = node.get("properties")
    props: dict[str, Any] = listed if isinstance(listed, dict) else {}
    head = {name: in_schema_order(root, props[name], value[name]) for name in props if name in value}
    rest = {name: item for name, item in value.items() if name not in head}
    branch = _best_branch(root, node, rest)
    if branch is not None:
        rest = in_schema_order(root, branch, rest)
    elif isinstance(node.get("additionalProperties"), dict):
        rest = {
            name: in_schema_order(root, node["additionalProperties"], item) for name, item in rest.items()
        }
    return {**head, **rest}


def _item_schemas(node: dict[str, Any]) -> Iterator[Any]:
    prefix = node.get("prefixItems")
    items = node.get("items")
    if isinstance(prefix, list):
        yield from prefix
    elif isinstance(items, list):  # draft 4's tuple form, left as it came if not translated
        yield from items
        items = node.get("additionalItems")
    while True:
        yield items if isinstance(items, dict) else {}


def _best_branch(root: Any, node: dict[str, Any], value: dict[str, Any]) -> Any:
    branches = [b for key in ("allOf", "anyOf", "oneOf") for b in node.get(key) or [] if isinstance(b, dict)]
    best, covered = None, -1
    for branch in branches:
        try:
            resolved, _ = follow(root, branch, ())
        except RefError:
            continue
        names = _listed(root, resolved)
        score = sum(name in names for name in value)
        if score > covered:
            best, covered = branch, score
    return best


def _listed(root: Any, node: Any, depth: int = 0) -> set[str]:
    """The property names a schema lists, its composition branches' included."""
    if not isinstance(node, dict) or depth > 8:
        return set()
    names = set(node.get("properties") or {}) if isinstance(node.get("properties"), dict) else set()
    for key in ("allOf", "anyOf", "oneOf"):
        for branch in node.get(key) or []:
            try:
                names |= _listed(root, follow(root, branch, ())[0], depth + 1)
            except RefError:
                continue
    return names


def cmd_schemas(args: argparse.Namespace) -> int:
    from cloud.model.text_side import load_text_side

    tokenizer, _ = load_text_side(args.model)
    report = run(tokenizer, Path(args.data), args.limit)
    out = asdict(report)
    if not args.details:
        for key in ("valid_rejected_cases", "invalid_accepted_cases", "refused_ids"):
            out.pop(key)
    text = json.dumps(out, indent=2, ensure_ascii=False)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if report.invalid_accepted == 0 else 1


def add_schemas_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser(
        "schemas",
        help="real-world JSON Schema coverage: share compiled, refusals by reason, and labelled "
        "instances through the grammar token by token; prints JSON (exit 1 on a fail-open)",
    )
    p.add_argument(
        "--data", default=str(DEFAULT_DATA), help=f"a JSONSchemaBench .jsonl (default {DEFAULT_DATA})"
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N schemas")
    p.add_argument("--model", default=None, help="tokenizer source: a .gguf or HF directory (default model)")
    p.add_argument("--details", action="store_true", help="list the failing instances and refused ids")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.set_defaults(func=cmd_schemas)
