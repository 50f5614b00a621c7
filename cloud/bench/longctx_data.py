"""Long-context retrieval cases and their scoring, one task family each:
- passkey: a passkey hidden in repeated filler; needle: a RULER-style magic number in varied prose;
- multikey, multivalue, vartrack, cwe: RULER's harder families (longctx_ruler.py);
- nolima: a needle that shares no word with its question (longctx_nolima.py).

Invariants of `make_case`:
- prompt tokens + answer tokens <= the case's length, and the prompt falls short of that by less than
  one haystack unit (a word, or a list item: a few tokens): lengths are measured with the engine's own
  chat encoding; the answer tokens are the run's, or the task's own where its answer needs more;
- every needle sits at a sentence boundary, the one nearest its depth (0: before the first sentence,
  100: after the last); the first needle, the one the question asks about, at the spec's depth, and
  `Case.needle_depth` is its measured fraction;
- a case is a pure function of its spec, the seed and the tokenizer: every engine configuration of
  a run sees the same token ids.

Scoring: a case lists the items a correct answer holds (`answers`); `score` is the share of them the
answer holds (0 where its first number is a distractor's), `is_correct` whether it holds them all.
"""

from __future__ import annotations

import itertools
import random
import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .longctx_draft import Draft, Encoder, Match, Needle, sentence_haystack
from .longctx_nolima import nolima
from .longctx_ruler import cwe, multikey, multivalue, needle, vartrack

Task = Literal["passkey", "needle", "multikey", "multivalue", "vartrack", "cwe", "nolima"]
TASKS: tuple[Task, ...] = ("passkey", "needle", "multikey", "multivalue", "vartrack", "cwe", "nolima")

# The classic passkey filler (Mohtashami & Jaggi, "Landmark Attention"), one sentence per item.
PASSKEY_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
_DIGIT_GAP = re.compile(r"(?<=\d)[ ,](?=\d)")  # "68 220" or "68,220" still carries the key
_NUMBER = re.compile(r"\d+")
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True, slots=True)
class CaseSpec:
    task: Task
    length: int  # total tokens: prompt plus the answer's new tokens
    depth: int  # where the needle goes, percent of the haystack (0 .. 100); cwe: only varies the list
    sample: int = 0  # several samples of one cell differ in key and haystack

    def __post_init__(self) -> None:
        if not 0 <= self.depth <= 100:
            raise ValueError(f"depth is a percentage, got {self.depth}")
        if self.length < 1 or self.sample < 0:
            raise ValueError(f"bad case spec {self}")


@dataclass(frozen=True, slots=True)
class Case:
    spec: CaseSpec
    key: str  # the expected answer as the records show it: the key's digits, or the items, comma-separated
    subject: str | None  # what the question names: a subject, vartrack's value, nolima's place; else None
    prompt_ids: tuple[int, ...]
    # measured: haystack tokens before the needle / haystack tokens (0 .. 1); cwe, which has no needle:
    # the requested depth / 100
    needle_depth: float
    answers: tuple[str, ...]  # the items a correct answer holds, every one
    match: Match  # how an item is found in the answer
    answer_tokens: int  # new tokens to generate: prompt_ids + these fit the spec's length
    # where the needle's tokens lie in prompt_ids: [start, end), for diagnostics that follow it; the
    # needle the question asks about ((0, 0) for cwe, which has none), then the other needles'
    needle_span: tuple[int, int] = (0, 0)
    other_spans: tuple[tuple[int, int], ...] = ()
    distractors: tuple[str, ...] = ()  # multikey: the other subjects' numbers


def _passkey(rng: random.Random, depth: int) -> Draft:
    key = str(rng.randint(10_000, 99_999))
    return Draft(
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.",
        "What is the pass key?",
        "The pass key is",
        (Needle(f"The pass key is {key}. Remember it. {key} is the pass key.", depth),),
        sentence_haystack(itertools.cycle(PASSKEY_FILLER)),
        key,
        None,
        (key,),
    )


# each task's draft from the case's random stream and the spec's depth
_DRAFTS: dict[Task, Callable[[random.Random, int], Draft]] = {
    "passkey": _passkey,
    "needle": needle,
    "multikey": multikey,
    "multivalue": multivalue,
    "vartrack": vartrack,
    "cwe": cwe,
    "nolima": nolima,
}


def make_case(spec: CaseSpec, enc: Encoder, answer_tokens: int, seed: int) -> Case:
    """The case's prompt, fitted to spec.length less its answer tokens: `answer_tokens`, or the task's
    own where its answer needs more. Raises ValueError when the length leaves no room for a haystack."""
    rng = random.Random(f"longctx/{seed}/{spec.task}/{spec.length}/{spec.depth}/{spec.sample}")
    draft = _DRAFTS[spec.task](rng, spec.depth)
    answer_tokens = max(answer_tokens, draft.answer_tokens)
    target = spec.length - answer_tokens
    base = len(enc.prompt(draft.user(" ".join(n.text for n in draft.needles)), draft.answer_prefix))
    if base >= target:
        raise ValueError(f"{spec.length} tokens leave no room for a haystack ({base} + {answer_tokens})")
    hay = draft.haystack(enc, target - base, draft.needles)

    def build(k: int) -> list[int]:
        return enc.prompt(draft.user(hay.text(k)), draft.answer_prefix)

    units = len(hay.prefix) - 1
    k = bisect_right(hay.prefix, target - base) - 1
    ids = build(k)
    while len(ids) > target and k > 0:  # the seams cost a token or two more than the sums say
        k -= 1
        ids = build(k)
    while k + 1 < units and len(nxt := build(k + 1)) <= target:
        k, ids = k + 1, nxt
    spans = [find_span(ids, enc, n.text) for n in draft.needles] or [(0, 0)]
    return Case(
        spec,
        draft.key,
        draft.subject,
        tuple(ids),
        hay.needle_depth(k, enc),
        draft.answers,
        draft.match,
        answer_tokens,
        spans[0],
        tuple(spans[1:]),
        draft.distractors,
    )


def find_span(ids: list[int], enc: Encoder, text: str) -> tuple[int, int]:
    """[start, end) of `text`'s tokens inside `ids`, where it stands after a space or a newline. The
    token at the seam may differ from `text` tokenized alone; the rest cannot (byte-level BPE never
    merges across a space), so the match is on the rest and the seam's token is taken with it."""
    for form in (f" {text}", text):
        part = enc.tokenizer.encode(form, add_special=False)
        for skip in (0, 1):
            want = part[skip:]
            for start in range(len(ids) - len(want) + 1):
                if ids[start : start + len(want)] == want:
                    return max(0, start - skip), start + len(want)
    raise ValueError(f"{text!r} is not in the prompt")


def _normalised(text: str) -> str:
    return _DIGIT_GAP.sub("", text)


def _holds(answer: str, item: str, match: Match) -> bool:
    if match == "digits":
        return item in _normalised(answer)
    return re.search(rf"\b{re.escape(item)}\b", answer, re.IGNORECASE) is not None


def score(case: Case, answer: str) -> float:
    """The share of the case's answer items the answer holds (RULER's string match: 1.0 or 0.0 where
    one item is expected); 0.0 where the answer's first number is a distractor's (multikey)."""
    first = answer_number(answer) or ""
    # startswith: "9171218 2307796" reads as one number once its digit gaps are dropped
    if any(first.startswith(d) for d in case.distractors):
        return 0.0
    return sum(_holds(answer, a, case.match) for a in case.answers) / len(case.answers)


def is_correct(case: Case, answer: str) -> bool:
    """Whether the answer holds every answer item (and does not open with a distractor's number)."""
    return score(case, answer) == 1.0


def answer_number(answer: str) -> str | None:
    """The first number in the answer: what two configurations' passkey and needle answers are
    compared by."""
    m = _NUMBER.search(_normalised(answer))
    return m.group() if m else None


def answer_gist(case: Case, answer: str) -> str | None:
    """What two configurations' answers are compared by: the first number where one number is asked
    for (passkey, needle, multikey), every number in order where several are (multivalue), and the
    answer's words, lower case, without punctuation, where words are (vartrack, cwe, nolima)."""
    if case.match == "digits":
        if len(case.answers) == 1:
            return answer_number(answer)
        return ",".join(_NUMBER.findall(_normalised(answer))) or None
    return " ".join(_WORD.findall(answer.lower())) or None
