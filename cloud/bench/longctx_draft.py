"""What a long-context task hands the case builder (longctx_data.make_case): a `Draft` (the wording,
the needles with their depths, what a correct answer holds, and a maker of the haystack), and the
sentence haystack most tasks use: sentences (varied prose, or the passkey's filler) with the needles
set at sentence boundaries.

A haystack is a sequence of units (words of prose, items of a list) whose token costs add up: the
case builder fits the prompt to its length by the number of units, so every haystack has `prefix`
(prefix[k]: tokens of the first k units) and `text(k)` (those units, the needles in place).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from cloud.model.tokenizer import Tokenizer

from .longctx_words import ADJECTIVES, ADVERBS, NAMES, NOUNS, PLACES, TEMPLATES, TIMES, VERBS

# how an answer item is found in the answer: "digits", within the answer once the gaps between its
# digits ("68 220", "68,220") are dropped (RULER's string match); "word", as a whole word, any case
Match = Literal["digits", "word"]


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
class Needle:
    text: str  # one or more whole sentences
    depth: int  # percent of the haystack's tokens before it (0 .. 100)


class Haystack(Protocol):
    prefix: list[int]  # prefix[k]: tokens of the first k units, each with its leading space

    def text(self, k: int) -> str:
        """The first k units, the needles in place."""
        ...

    def needle_depth(self, k: int, enc: Encoder) -> float:
        """Measured: the haystack's tokens before the first needle / its tokens (0 .. 1)."""
        ...


# a haystack of at least `tokens` tokens (and a unit more) around these needles
HaystackMaker = Callable[[Encoder, int, tuple[Needle, ...]], Haystack]


@dataclass(frozen=True, slots=True)
class Draft:
    """One case before it is fitted to its length."""

    intro: str
    question: str
    answer_prefix: str
    needles: tuple[Needle, ...]  # the first is the one the question asks about; () for none
    haystack: HaystackMaker
    key: str  # what the records show as the expected answer
    subject: str | None  # what the question names (a subject, a value, a place), if anything
    answers: tuple[str, ...]  # the items a correct answer holds, every one
    match: Match = "digits"
    distractors: tuple[str, ...] = ()  # numbers that, as the answer's first number, make it wrong
    answer_tokens: int = 0  # the fewest new tokens the answer needs (0: the run's --max-tokens)

    def __post_init__(self) -> None:
        if not self.answers:
            raise ValueError("a case needs at least one expected answer item")

    def user(self, haystack: str) -> str:
        return f"{self.intro}\n{haystack}\n{self.question}"


@dataclass(slots=True)
class SentenceHaystack:
    """Words of the haystack's sentences with their token costs; the needles go before the
    sentence starts nearest their depths."""

    words: list[str]
    prefix: list[int]  # prefix[i]: tokens of words[:i]
    starts: list[int]  # word index where each sentence starts (starts[0] == 0)
    needles: tuple[Needle, ...]

    def closed(self, k: int) -> list[str]:
        """The first k words, ended as a sentence."""
        words = self.words[:k]
        if words and not words[-1].endswith((".", "!", "?")):
            words[-1] = words[-1].rstrip(",;:") + "."  # cut mid-sentence: close it
        return words

    def text(self, k: int) -> str:
        words = self.closed(k)
        # needles sharing a boundary keep their order in `needles`: a chain of assignments stays in order
        at = sorted((self.needle_at(k, n.depth), i) for i, n in enumerate(self.needles))
        out: list[str] = []
        done = 0
        for b, i in at:
            out += words[done:b]
            out.append(self.needles[i].text)
            done = b
        return " ".join(out + words[done:])

    def needle_at(self, k: int, depth: int) -> int:
        """The sentence boundary within the first k words nearest depth% of their tokens."""
        bounds = [s for s in self.starts if s < k] + [k]
        want = self.prefix[k] * depth / 100
        return min(bounds, key=lambda b: abs(self.prefix[b] - want))

    def needle_depth(self, k: int, enc: Encoder) -> float:
        if not self.needles:
            return 0.0
        at = self.needle_at(k, self.needles[0].depth)
        before = enc.count(" ".join(self.words[:at]))
        total = enc.count(" ".join(self.closed(k)))
        return min(before / total, 1.0) if total else self.needles[0].depth / 100


def sentence_haystack(sentences: Iterator[str]) -> HaystackMaker:
    """A maker of a haystack drawn from these sentences, as many as the tokens need."""

    def make(enc: Encoder, tokens: int, needles: tuple[Needle, ...]) -> Haystack:
        cost: dict[str, int] = {}
        hay = SentenceHaystack([], [0], [], needles)
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

    return make


def _article(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def prose(rng: random.Random) -> Iterator[str]:
    """Endless varied sentences: a random template filled with random words (no digit anywhere)."""
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


def depths(rng: random.Random, n: int, low: int = 0, high: int = 100) -> list[int]:
    """n needle depths drawn uniformly from low .. high percent, in ascending order."""
    return sorted(rng.randint(low, high) for _ in range(n))
