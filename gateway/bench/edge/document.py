"""A prose-like document of a given token count, and questions to ask about it.

Sentences are drawn from word lists with a seeded generator, in numbered sections of a few
paragraphs, with figures (days, amounts, percentages) mixed in: text that compresses like prose and
has no long repeats, so its content-defined chunks are nearly all distinct and the link's savings
come from the agent's dedup across requests, not from repetition inside one document.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from cloud.model.tokenizer import Tokenizer


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_ADJECTIVES = _words(
    "annual quarterly written prior reasonable material separate applicable current final initial "
    "independent confidential commercial standard additional outstanding relevant general specific "
    "former principal subsequent regional statutory technical operational financial customary"
)
_NOUNS = _words(
    "supplier customer agreement invoice payment delivery schedule warranty notice period obligation "
    "licence service report audit committee account shipment order estimate dispute remedy term "
    "record policy budget contractor inspection facility premises region schedule milestone forecast "
    "deposit tariff carrier warehouse consignment claim deadline review procedure amendment appendix"
)
_VERBS = _words(
    "approves reviews delivers confirms records submits receives extends replaces suspends issues "
    "settles verifies transfers assesses documents renews reduces allocates requests withholds"
)
_ADVERBS = ("promptly", "jointly", "annually", "thereafter", "in writing", "without delay", "in good faith")
_PREPOSITIONS = ("before", "after", "under", "within", "against", "for", "beside", "despite")
_CONNECTORS = ("unless", "provided that", "whereas", "so that", "until", "because", "although")
_TOPICS = _words(
    "Definitions Scope Delivery Acceptance Pricing Invoicing Warranties Liability Confidentiality "
    "Termination Insurance Audit Disputes Force-Majeure Assignment Notices Records Compliance"
)

QUESTION_TEMPLATES = (
    "What does section {k} say about the {noun}?",
    "Who {verb} the {noun} in section {k}, and when?",
    "Summarise the obligations of the {noun} in section {k}.",
    "Which deadlines in section {k} apply to the {noun}?",
    "Does section {k} allow the {noun} to be changed? Quote it.",
)


def _clause(rng: random.Random) -> str:
    a, n, v = rng.choice(_ADJECTIVES), rng.choice(_NOUNS), rng.choice(_VERBS)
    return f"the {a} {n} {v} the {rng.choice(_NOUNS)} {rng.choice(_PREPOSITIONS)} the {rng.choice(_NOUNS)}"


def _figure(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"within {rng.randint(2, 120)} days"
    if kind == 1:
        return f"for EUR {rng.randint(100, 99_999):,}.{rng.randint(0, 99):02d}"
    return f"at {rng.randint(1, 40)}.{rng.randint(0, 9)} percent"


def _sentence(rng: random.Random) -> str:
    text = _clause(rng)
    if rng.random() < 0.5:
        text += f" {_figure(rng)}"
    if rng.random() < 0.4:
        text += f", {rng.choice(_CONNECTORS)} {_clause(rng)}"
    if rng.random() < 0.3:
        text += f" {rng.choice(_ADVERBS)}"
    return text[0].upper() + text[1:] + "."


def _pieces(seed: int) -> Iterator[str]:
    """Headings and sentences, each with the separator that follows it; endless."""
    rng = random.Random(seed)
    section = 0
    while True:
        section += 1
        yield f"Section {section}. {rng.choice(_TOPICS)}\n\n"
        for _ in range(rng.randint(2, 4)):
            n = rng.randint(3, 7)
            for i in range(n):
                yield _sentence(rng) + ("\n\n" if i == n - 1 else " ")


def document(tokenizer: Tokenizer, tokens: int, seed: int = 0) -> str:
    """The longest run of pieces whose text has at most `tokens` tokens (counted by `tokenizer`)."""
    source = _pieces(seed)
    pieces: list[str] = []

    def count(n: int) -> int:
        return len(tokenizer.encode("".join(pieces[:n]).rstrip()))

    # per-piece counts only approximate the whole's: overshoot by them, check, then search
    estimate = 0
    while estimate <= tokens * 1.05 or count(len(pieces)) <= tokens:
        pieces.append(next(source))
        estimate += len(tokenizer.encode(pieces[-1]))
    lo, hi = 0, len(pieces)  # invariant: count(lo) <= tokens < count(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= tokens else (lo, mid)
    return "".join(pieces[:lo]).rstrip()


def questions(n: int, seed: int = 0) -> list[str]:
    """`n` different questions (distinct by construction: each names its own section number)."""
    rng = random.Random(seed + 1)
    return [
        QUESTION_TEMPLATES[i % len(QUESTION_TEMPLATES)].format(
            k=i + 1, noun=rng.choice(_NOUNS), verb=rng.choice(_VERBS)
        )
        for i in range(n)
    ]
