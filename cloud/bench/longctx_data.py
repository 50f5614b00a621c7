"""Long-context retrieval cases and their scoring: a passkey hidden in repeated filler, or a
RULER-style magic number hidden in varied prose, at a chosen depth of a prompt of a chosen length.

Invariants of `make_case`:
- prompt tokens + answer tokens <= the case's length, and the prompt falls short of that by less than
  one haystack word (a few tokens): lengths are measured with the engine's own chat encoding;
- the needle sits at a sentence boundary, the one nearest `depth` percent of the haystack's tokens
  (0: before the first sentence, 100: after the last); `Case.needle_depth` is the measured fraction;
- a case is a pure function of its spec, the seed and the tokenizer: every engine configuration of
  a run sees the same token ids.
"""

from __future__ import annotations

import itertools
import random
import re
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from cloud.model.tokenizer import Tokenizer

from .longctx_words import ADJECTIVES, ADVERBS, NAMES, NOUNS, PLACES, TEMPLATES, TIMES, VERBS

Task = Literal["passkey", "needle"]
TASKS: tuple[Task, ...] = ("passkey", "needle")

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


@dataclass(frozen=True, slots=True)
class CaseSpec:
    task: Task
    length: int  # total tokens: prompt plus the answer's new tokens
    depth: int  # where the needle goes, percent of the haystack (0 .. 100)
    sample: int = 0  # several samples of one cell differ in key and haystack

    def __post_init__(self) -> None:
        if not 0 <= self.depth <= 100:
            raise ValueError(f"depth is a percentage, got {self.depth}")
        if self.length < 1 or self.sample < 0:
            raise ValueError(f"bad case spec {self}")


@dataclass(frozen=True, slots=True)
class Case:
    spec: CaseSpec
    key: str  # the digits a correct answer contains
    subject: str | None  # needle: the "adjective-noun" the question names; passkey: None
    prompt_ids: tuple[int, ...]
    needle_depth: float  # measured: haystack tokens before the needle / haystack tokens (0 .. 1)
    # where the needle's tokens lie in prompt_ids: [start, end), for diagnostics that follow it
    needle_span: tuple[int, int] = (0, 0)


@dataclass(frozen=True, slots=True)
class Encoder:
    """Text to token ids as the engine does it: its chat encoding (template with the generation
    prompt) and its tokenizer (for the answer prefix and for counting)."""

    encode_chat: Callable[[list[dict[str, object]]], list[int]]
    tokenizer: Tokenizer

    def prompt(self, user: str, answer_prefix: str) -> list[int]:
        # the answer prefix opens the assistant's turn, as RULER does: a small model then only has
        # to continue with the number
        chat = self.encode_chat([{"role": "user", "content": user}])
        return chat + self.tokenizer.encode(answer_prefix, add_special=False)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special=False))


@dataclass(frozen=True, slots=True)
class _Wording:
    intro: str
    needle: str
    question: str
    answer_prefix: str

    def user(self, haystack: str) -> str:
        return f"{self.intro}\n{haystack}\n{self.question}"


@dataclass(slots=True)
class _Haystack:
    """Words of the haystack's sentences with their token costs (each with its leading space)."""

    words: list[str]
    prefix: list[int]  # prefix[i]: tokens of words[:i]
    starts: list[int]  # word index where each sentence starts (starts[0] == 0)

    def closed(self, k: int) -> list[str]:
        """The first k words, ended as a sentence."""
        words = self.words[:k]
        if words and not words[-1].endswith((".", "!", "?")):
            words[-1] = words[-1].rstrip(",;:") + "."  # cut mid-sentence: close it
        return words

    def text(self, k: int, at: int, needle: str) -> str:
        """The first k words with the needle before word `at`."""
        words = self.closed(k)
        return " ".join([*words[:at], needle, *words[at:]])

    def needle_at(self, k: int, depth: int) -> int:
        """The sentence boundary within the first k words nearest depth% of their tokens."""
        bounds = [s for s in self.starts if s < k] + [k]
        want = self.prefix[k] * depth / 100
        return min(bounds, key=lambda b: abs(self.prefix[b] - want))


def _article(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _prose(rng: random.Random) -> Iterator[str]:
    """Endless varied sentences: a random template filled with random words."""
    while True:
        adj, adj2 = rng.sample(ADJECTIVES, 2)
        noun, noun2, noun3 = rng.sample(NOUNS, 3)
        time = rng.choice(TIMES)
        yield rng.choice(TEMPLATES).format(
            adj=adj,
            adj2=adj2,
            noun=noun,
            noun2=noun2,
            verb=rng.choice(VERBS),
            verb2=rng.choice(VERBS),
            name=rng.choice(NAMES),
            name2=rng.choice(NAMES),
            place=rng.choice(PLACES),
            time=time,
            Time=time[0].upper() + time[1:],
            adverb=rng.choice(ADVERBS),
            a_adj=_article(adj),
            a_noun=_article(noun3),
        )


def _task(task: Task, rng: random.Random) -> tuple[_Wording, str, str | None, Iterator[str]]:
    """The wording, the key, the subject and the haystack's sentences of one case."""
    if task == "passkey":
        key = str(rng.randint(10_000, 99_999))
        wording = _Wording(
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.",
            f"The pass key is {key}. Remember it. {key} is the pass key.",
            "What is the pass key?",
            "The pass key is",
        )
        return wording, key, None, itertools.cycle(PASSKEY_FILLER)
    subject = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    key = str(rng.randint(1_000_000, 9_999_999))
    wording = _Wording(
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.",
        f"One of the special magic numbers for {subject} is: {key}.",
        f"What is the special magic number for {subject} mentioned in the provided text?",
        f"The special magic number for {subject} mentioned in the provided text is",
    )
    return wording, key, subject, _prose(rng)


def _haystack(sentences: Iterator[str], enc: Encoder, tokens: int) -> _Haystack:
    """Enough sentences for `tokens` haystack tokens and a sentence more."""
    cost: dict[str, int] = {}
    hay = _Haystack([], [0], [])
    while hay.prefix[-1] <= tokens:
        hay.starts.append(len(hay.words))
        for w in next(sentences).split(" "):
            # byte-level BPE never merges across a space, so a word's tokens with its leading space
            # add up exactly inside the haystack; only the seams with the template may differ
            n = cost.get(w)
            if n is None:
                n = cost[w] = enc.count(f" {w}")
            hay.words.append(w)
            hay.prefix.append(hay.prefix[-1] + n)
    return hay


def make_case(spec: CaseSpec, enc: Encoder, answer_tokens: int, seed: int) -> Case:
    """The case's prompt, fitted to spec.length - answer_tokens tokens. Raises ValueError when the
    length leaves no room for a haystack."""
    rng = random.Random(f"longctx/{seed}/{spec.task}/{spec.length}/{spec.depth}/{spec.sample}")
    wording, key, subject, sentences = _task(spec.task, rng)
    target = spec.length - answer_tokens
    base = len(enc.prompt(wording.user(wording.needle), wording.answer_prefix))
    if base >= target:
        raise ValueError(f"{spec.length} tokens leave no room for a haystack ({base} + {answer_tokens})")
    hay = _haystack(sentences, enc, target - base)

    def build(k: int) -> list[int]:
        text = hay.text(k, hay.needle_at(k, spec.depth), wording.needle)
        return enc.prompt(wording.user(text), wording.answer_prefix)

    k = bisect_right(hay.prefix, target - base) - 1
    ids = build(k)
    while len(ids) > target and k > 0:  # the seams cost a token or two more than the sums say
        k -= 1
        ids = build(k)
    while k + 1 < len(hay.words) and len(nxt := build(k + 1)) <= target:
        k, ids = k + 1, nxt
    at = hay.needle_at(k, spec.depth)
    before = enc.count(" ".join(hay.words[:at]))
    total = enc.count(" ".join(hay.closed(k)))
    depth = before / total if total else spec.depth / 100
    span = find_span(ids, enc, wording.needle)
    return Case(spec, key, subject, tuple(ids), min(depth, 1.0), span)


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


def is_correct(case: Case, answer: str) -> bool:
    """Whether the answer contains the key's digits (RULER's string-match metric)."""
    return case.key in _normalised(answer)


def answer_number(answer: str) -> str | None:
    """The first number in the answer: what two configurations' answers are compared by."""
    m = _NUMBER.search(_normalised(answer))
    return m.group() if m else None
