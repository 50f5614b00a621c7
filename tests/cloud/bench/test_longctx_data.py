"""Long-context cases hit their token length with the real tokenizer and chat template (every task),
put the needle at the requested depth, follow from the seed alone, and are scored by the key's
digits (passkey and needle; the other tasks' content and scoring: test_longctx_ruler.py)."""

from __future__ import annotations

import pytest

from cloud.bench.longctx_data import (
    PASSKEY_FILLER,
    TASKS,
    CaseSpec,
    Encoder,
    Task,
    answer_number,
    is_correct,
    make_case,
)

ANSWER_TOKENS = 12
FIT_SLACK = 4  # tokens a prompt may fall short of its length: less than one haystack word
LIST_FIT_SLACK = 9  # ... or one item of cwe's list: " 1234. word" is up to 9 tokens
CLASSIC: tuple[Task, ...] = ("passkey", "needle")


def _text(enc: Encoder, ids: tuple[int, ...]) -> str:
    return enc.tokenizer.decode(list(ids))


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [1024, 2048, 4096, 8192])
def test_prompt_plus_answer_fills_the_length_within_a_few_tokens(
    enc: Encoder, task: Task, length: int
) -> None:
    slack = LIST_FIT_SLACK if task == "cwe" else FIT_SLACK
    for depth in (0, 50, 100):
        case = make_case(CaseSpec(task, length, depth), enc, ANSWER_TOKENS, seed=0)
        assert case.answer_tokens >= ANSWER_TOKENS
        room = length - case.answer_tokens - len(case.prompt_ids)
        assert 0 <= room <= slack, (depth, room)


def test_a_task_answering_with_a_list_takes_the_answer_tokens_it_needs(enc: Encoder) -> None:
    for task in CLASSIC:
        assert make_case(CaseSpec(task, 1024, 50), enc, ANSWER_TOKENS, seed=0).answer_tokens == ANSWER_TOKENS
    lists = {t: make_case(CaseSpec(t, 1024, 50), enc, ANSWER_TOKENS, seed=0) for t in ("multivalue", "cwe")}
    assert all(c.answer_tokens > 3 * ANSWER_TOKENS for c in lists.values())
    # a run that asks for more than the task needs gets it
    assert make_case(CaseSpec("cwe", 1024, 50), enc, 100, seed=0).answer_tokens == 100


@pytest.mark.parametrize("task", TASKS)
def test_every_task_follows_from_the_seed(enc: Encoder, task: Task) -> None:
    spec = CaseSpec(task, 2048, 25)
    a, b = make_case(spec, enc, ANSWER_TOKENS, seed=7), make_case(spec, enc, ANSWER_TOKENS, seed=7)
    assert a == b
    assert make_case(spec, enc, ANSWER_TOKENS, seed=8).prompt_ids != a.prompt_ids
    assert (
        make_case(CaseSpec(task, 2048, 25, sample=1), enc, ANSWER_TOKENS, seed=7).prompt_ids != a.prompt_ids
    )


@pytest.mark.parametrize("task", CLASSIC)
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_needle_sits_at_the_requested_depth(enc: Encoder, task: Task, depth: int) -> None:
    case = make_case(CaseSpec(task, 4096, depth), enc, ANSWER_TOKENS, seed=1)
    assert case.needle_depth == pytest.approx(depth / 100, abs=0.01)
    # and in the text: the needle splits the haystack in that proportion (characters ~ tokens here)
    text = _text(enc, case.prompt_ids)
    needle = f"The pass key is {case.key}." if task == "passkey" else f"magic numbers for {case.subject} is"
    assert text.count(needle) == 1
    intro_end = text.index("afterwards.\n" if task == "needle" else "information there.\n")
    question = text.index("\nWhat is the ")
    at = text.index(needle) - intro_end
    assert at / (question - intro_end) == pytest.approx(depth / 100, abs=0.03)


def test_the_question_and_answer_prefix_close_the_prompt(enc: Encoder) -> None:
    case = make_case(CaseSpec("needle", 2048, 50), enc, ANSWER_TOKENS, seed=0)
    text = _text(enc, case.prompt_ids)
    assert case.subject is not None and case.key.isdigit() and len(case.key) == 7
    assert f"What is the special magic number for {case.subject} mentioned in the provided text?" in text
    assert text.endswith(f"The special magic number for {case.subject} mentioned in the provided text is")
    passkey = _text(enc, make_case(CaseSpec("passkey", 2048, 50), enc, ANSWER_TOKENS, seed=0).prompt_ids)
    assert "What is the pass key?" in passkey and passkey.endswith("The pass key is")


def test_cases_follow_from_the_seed(enc: Encoder) -> None:
    spec = CaseSpec("needle", 2048, 25)
    a, b = make_case(spec, enc, ANSWER_TOKENS, seed=7), make_case(spec, enc, ANSWER_TOKENS, seed=7)
    c = make_case(spec, enc, ANSWER_TOKENS, seed=8)
    assert a == b
    assert (c.key, c.subject) != (a.key, a.subject) and c.prompt_ids != a.prompt_ids
    other_sample = make_case(CaseSpec("needle", 2048, 25, sample=1), enc, ANSWER_TOKENS, seed=7)
    assert other_sample.key != a.key


def test_needle_haystack_is_varied_prose_and_passkey_haystack_the_classic_filler(enc: Encoder) -> None:
    needle = _text(enc, make_case(CaseSpec("needle", 4096, 50), enc, ANSWER_TOKENS, seed=0).prompt_ids)
    sentences = [s for s in needle.split(". ") if s]
    assert len(set(sentences)) > 0.9 * len(sentences)
    case = make_case(CaseSpec("needle", 4096, 50), enc, ANSWER_TOKENS, seed=0)
    assert sum(ch.isdigit() for ch in needle) == len(case.key)  # the only number in the text
    passkey = _text(enc, make_case(CaseSpec("passkey", 2048, 50), enc, ANSWER_TOKENS, seed=0).prompt_ids)
    assert passkey.count(PASSKEY_FILLER[0]) > 50


def test_a_length_with_no_room_for_a_haystack_is_refused(enc: Encoder) -> None:
    with pytest.raises(ValueError, match="no room"):
        make_case(CaseSpec("passkey", 64, 50), enc, ANSWER_TOKENS, seed=0)
    with pytest.raises(ValueError):
        CaseSpec("passkey", 2048, 101)


def test_scoring_finds_the_key_digits_in_the_answer(enc: Encoder) -> None:
    case = make_case(CaseSpec("passkey", 1024, 50), enc, ANSWER_TOKENS, seed=3)
    k = case.key
    assert is_correct(case, f" {k}. Remember it.")
    assert is_correct(case, f"{k[:2]},{k[2:]}")  # thousands separator
    assert is_correct(case, f"{k[:2]} {k[2:]}")
    assert not is_correct(case, f" {k[:-1]}.")
    assert not is_correct(case, "I do not know.")
    assert answer_number(f" {k[:2]},{k[2:]} and 42") == k
    assert answer_number(" none") is None


@pytest.mark.parametrize("task", CLASSIC)
def test_the_needle_span_holds_the_needle_and_its_key(enc: Encoder, task: Task) -> None:
    for depth in (0, 50, 100):
        case = make_case(CaseSpec(task, 2048, depth), enc, ANSWER_TOKENS, seed=0)
        start, end = case.needle_span
        text = _text(enc, case.prompt_ids[start:end])
        assert case.key in text and 5 <= end - start <= 40, (depth, text)
        assert case.key not in _text(enc, case.prompt_ids[:start] + case.prompt_ids[end:])
        assert case.other_spans == ()
