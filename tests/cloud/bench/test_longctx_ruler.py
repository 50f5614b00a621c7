"""RULER's harder task families and the NoLiMa-style task, built with the real tokenizer and chat
template: each hides what its question asks for where the depth says, its spans hold what they
claim, its answer fits the answer tokens it asks for, and its scoring takes a right answer and
refuses near misses (a distractor's number, three of four values, a missing variable, nine of ten
words, another character)."""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter

import pytest

from cloud.bench.longctx_data import Case, CaseSpec, Encoder, Task, answer_gist, is_correct, make_case, score
from cloud.bench.longctx_nolima import CHARACTERS, LANDMARKS, nolima
from cloud.bench.longctx_ruler import COMMON_RATIO, COMMON_WORDS, HOPS, MULTIKEYS, MULTIVALUES
from cloud.bench.longctx_words import ADJECTIVES, ADVERBS, NAMES, NOUNS, PLACES, TEMPLATES, TIMES, VERBS

ANSWER_TOKENS = 12
# every sentence each task hides in its haystack
NEEDLES: dict[Task, re.Pattern[str]] = {
    "multikey": re.compile(r"One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\."),
    "multivalue": re.compile(r"One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\."),
    "vartrack": re.compile(r"VAR [A-Z]{5} = (?:\d{5}|VAR [A-Z]{5})\."),
    "nolima": re.compile(r"Actually, [A-Z][a-z]+ lives next to [A-Za-z ]+\."),
}
# the haystack's vocabulary: every word its sentences can hold
HAYSTACK_WORDS = {
    w.lower()
    for words in (NOUNS, ADJECTIVES, VERBS, NAMES, PLACES, TIMES, ADVERBS, TEMPLATES)
    for text in words
    for w in re.findall(r"[A-Za-z]+", text)
}
FUNCTION_WORDS = {"a", "an", "the", "of", "to"}


def _case(enc: Encoder, task: Task, length: int = 2048, depth: int = 50, seed: int = 0) -> Case:
    return make_case(CaseSpec(task, length, depth), enc, ANSWER_TOKENS, seed)


def _text(enc: Encoder, ids: tuple[int, ...]) -> str:
    return enc.tokenizer.decode(list(ids))


def _span(enc: Encoder, case: Case, span: tuple[int, int]) -> str:
    return _text(enc, case.prompt_ids[span[0] : span[1]])


@pytest.mark.parametrize("task", list(NEEDLES))
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_the_asked_needle_sits_at_the_requested_depth(enc: Encoder, task: Task, depth: int) -> None:
    case = _case(enc, task, 4096, depth, seed=1)
    assert case.needle_depth == pytest.approx(depth / 100, abs=0.01)
    if depth == 0:  # needles that share a boundary keep their order: the asked one first
        assert all(case.needle_span[0] < start for start, _ in case.other_spans)


@pytest.mark.parametrize("task", list(NEEDLES))
def test_every_needle_is_a_sentence_of_its_own_with_a_span_that_holds_it(enc: Encoder, task: Task) -> None:
    for depth in (0, 50, 100):
        case = _case(enc, task, 2048, depth)
        text = _text(enc, case.prompt_ids)
        found = NEEDLES[task].findall(text)
        assert len(found) == 1 + len(case.other_spans)
        for needle in found:
            before, after = text[: text.index(needle)], text[text.index(needle) + len(needle) :]
            assert before.endswith((". ", "\n")) and after.startswith((" ", "\n")), needle
        spans = [case.needle_span, *case.other_spans]
        assert sorted(needle for needle in found) == sorted(
            next(n for n in found if n in _span(enc, case, s)) for s in spans
        )


def test_multikey_asks_for_one_of_four_subjects_and_refuses_a_distractors_number(enc: Encoder) -> None:
    case = _case(enc, "multikey", 4096, 25)
    text = _text(enc, case.prompt_ids)
    assert case.subject is not None and len(case.distractors) == MULTIKEYS - 1
    assert len({case.key, *case.distractors}) == MULTIKEYS
    assert f"magic numbers for {case.subject} is: {case.key}." in _span(enc, case, case.needle_span)
    for span, number in zip(case.other_spans, sorted(case.distractors, key=text.index), strict=True):
        assert number in _span(enc, case, span) and case.subject not in _span(enc, case, span)
    assert text.endswith(f"The special magic number for {case.subject} mentioned in the provided text is")
    key, other = case.key, case.distractors[0]
    assert is_correct(case, f" {key}.") and score(case, f" {key}.") == 1.0
    assert is_correct(case, f" {key}, not {other}.")
    assert not is_correct(case, f" {other}.")
    # stricter than RULER's string match: a distractor's number first is wrong, the key after it too
    assert not is_correct(case, f" {other}, or maybe {key}.") and score(case, f" {other} {key}") == 0.0
    assert answer_gist(case, f" {key[:2]},{key[2:]} or {other}") == key


def test_multivalue_hides_four_numbers_and_counts_each_one_recalled(enc: Encoder) -> None:
    case = _case(enc, "multivalue", 4096, 75)
    values = case.answers
    assert len(set(values)) == MULTIVALUES and case.key == ",".join(values)
    assert values[0] in _span(enc, case, case.needle_span)
    for span, value in zip(case.other_spans, values[1:], strict=True):
        assert f"numbers for {case.subject} is: {value}." in _span(enc, case, span)
    text = _text(enc, case.prompt_ids)
    assert f"What are all the special magic numbers for {case.subject} mentioned" in text
    full = f" {values[2]}, {values[0]}, {values[3]} and {values[1]}."
    assert enc.count(full) <= case.answer_tokens  # the answer fits what the case generates
    assert is_correct(case, full) and score(case, full) == 1.0
    three = f" {values[0]}, {values[1]} and {values[2]}."
    assert not is_correct(case, three) and score(case, three) == 0.75
    assert answer_gist(case, full) == ",".join([values[2], values[0], values[3], values[1]])


def test_vartrack_chains_five_variables_in_order_beside_a_distractor_chain(enc: Encoder) -> None:
    case = _case(enc, "vartrack", 4096, 25, seed=3)
    chain, value = case.answers, case.subject
    text = _text(enc, case.prompt_ids)
    assert value is not None and len(chain) == HOPS + 1 and all(re.fullmatch(r"[A-Z]{5}", v) for v in chain)
    assert f"VAR {chain[0]} = {value}." in _span(enc, case, case.needle_span)
    hops = [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(chain)]
    assert [text.index(h) for h in hops] == sorted(text.index(h) for h in hops)  # read in order
    assert text.index(f"VAR {chain[0]} = {value}.") < text.index(hops[0])
    for span, hop in zip(case.other_spans, hops, strict=False):
        assert hop in _span(enc, case, span)
    decoy = re.findall(r"VAR ([A-Z]{5}) = (\d{5})\.", text)
    assert len(decoy) == 2 and {v for _, v in decoy} - {value}  # a second chain, another value
    names = re.findall(r"VAR ([A-Z]{5})", text)
    assert len(set(names)) == 2 * (HOPS + 1)
    full = " " + ", ".join(chain) + "."
    assert enc.count(full) <= case.answer_tokens
    assert is_correct(case, full) and is_correct(case, full.lower())
    missing = " " + ", ".join(chain[:-1]) + "."
    assert not is_correct(case, missing) and score(case, missing) == pytest.approx(0.8)
    # a name inside a longer word is not the name
    assert score(case, " " + ", ".join(f"{v}X" for v in chain)) == 0.0


@pytest.mark.parametrize("length", [1024, 2048, 8192])
def test_cwe_common_words_are_strictly_the_most_frequent_at_every_length(enc: Encoder, length: int) -> None:
    for depth in (0, 50, 100):
        case = _case(enc, "cwe", length, depth)
        text = _text(enc, case.prompt_ids)
        items = re.findall(r"(\d+)\. ([a-z]+)", text[text.index("most often.\n") :])
        assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
        counts = Counter(w for _, w in items)
        common = {counts[w] for w in case.answers}
        rest = max(n for w, n in counts.items() if w not in case.answers)
        assert len(case.answers) == COMMON_WORDS and len(common) == 1
        assert common.pop() == COMMON_RATIO * rest  # the others' full count: the last may be short
        assert (case.needle_span, case.other_spans) == ((0, 0), ())


def test_cwe_scores_the_share_of_the_ten_words_recalled(enc: Encoder) -> None:
    case = _case(enc, "cwe", 2048, 50)
    words = case.answers
    numbered = "\n".join(f"{i}. {w.capitalize()}" for i, w in enumerate(words, 1))
    assert enc.count(numbered) <= case.answer_tokens  # even as a numbered list
    assert is_correct(case, " " + ", ".join(reversed(words))) and is_correct(case, numbered)
    nine = " " + ", ".join(words[:-1])
    assert not is_correct(case, nine) and score(case, nine) == pytest.approx(0.9)
    assert answer_gist(case, "Apple,  Pear.") == "apple pear"
    with pytest.raises(ValueError, match="no room"):
        _case(enc, "cwe", 512)


def test_nolima_asks_for_the_character_by_a_place_its_needle_never_names(enc: Encoder) -> None:
    case = _case(enc, "nolima", 4096, 50)
    place, name = case.subject, case.key
    assert place is not None and case.answers == (name,)
    landmark = next(lm for lm, p in LANDMARKS if p == place)
    assert f"{name} lives next to {landmark}." in _span(enc, case, case.needle_span)
    text = _text(enc, case.prompt_ids)
    assert f"Which character has been to {place}?" in text
    assert text.count(place) == 2 and text.count(name) == 1  # the question and the answer prefix; the needle
    assert is_correct(case, f" {name}.") and is_correct(case, f" {name.lower()}, who lives there.")
    other = next(c for c in CHARACTERS if c != name)
    assert not is_correct(case, f" {other}.") and not is_correct(case, f" {name}son.")


def test_nolima_question_shares_no_content_word_with_its_needle() -> None:
    seen = set()
    for seed in range(500):
        draft = nolima(random.Random(seed), 50)
        needle, question = draft.needles[0].text, draft.question
        words = [set(re.findall(r"[a-z]+", t.lower())) - FUNCTION_WORDS for t in (needle, question)]
        assert not words[0] & words[1], (needle, question)
        seen.add(question)
    assert len(seen) >= 15  # the draws cover the table


def test_nolima_table_has_no_literal_echo_in_the_haystack() -> None:
    assert len(LANDMARKS) >= 20 and len(CHARACTERS) >= 20
    for landmark, place in LANDMARKS:
        words = set(re.findall(r"[a-z]+", f"{landmark} {place}".lower())) - FUNCTION_WORDS
        assert not words & HAYSTACK_WORDS, (landmark, place)
        assert place.lower() not in landmark.lower()
    assert not {c.lower() for c in CHARACTERS} & HAYSTACK_WORDS
