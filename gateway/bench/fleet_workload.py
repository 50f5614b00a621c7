"""The fleet bench's workload (like llm-d's prefix-cache benchmark, scaled down): users, each with a
long document of its own as the system message and a few short questions about it, sent interleaved.

Every (phase, user) pair gets its own seeded document, so a routing policy measured later never finds
the blocks an earlier policy's requests left in the workers' prefix caches. Each document opens with
a title unique to it, so two users share no prompt block beyond the chat template's few tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cloud.model.tokenizer import Tokenizer

_NAMES = (
    "Avery",
    "Blake",
    "Casey",
    "Devon",
    "Emery",
    "Finley",
    "Harper",
    "Jordan",
    "Kendall",
    "Logan",
    "Morgan",
    "Parker",
    "Quinn",
    "Reese",
    "Rowan",
)
_SURNAMES = (
    "Holloway",
    "Marsh",
    "Okafor",
    "Lindqvist",
    "Varga",
    "Castellano",
    "Nakamura",
    "Brennan",
    "Adeyemi",
    "Moreau",
    "Petrov",
)
_SUBJECTS = (
    "the tenant",
    "the landlord",
    "the insurer",
    "the contractor",
    "the building manager",
    "the auditor",
    "the supplier",
    "the council",
)
_VERBS = ("shall pay", "may inspect", "must repair", "agrees to insure", "will report", "can terminate")
_OBJECTS = (
    "the heating system",
    "the monthly rent",
    "the shared garden",
    "the parking spaces",
    "the water supply",
    "the roof and gutters",
    "the security deposit",
    "the annual service charge",
    "the fire alarms",
    "the storage units",
)
_WHEN = (
    "within thirty days of written notice",
    "before the end of each quarter",
    "unless a court decides otherwise",
    "at its own cost and risk",
    "after the first year of the term",
    "whenever the other party asks in writing",
)
_TOPICS = (
    "the rent",
    "repairs",
    "insurance",
    "the deposit",
    "the garden",
    "parking",
    "notice periods",
    "the roof",
    "fire safety",
    "the water supply",
    "storage",
    "termination",
    "the service charge",
    "inspections",
    "the heating",
    "disputes",
)
_ASKS = ("What does the document say about {}?", "Who is responsible for {}?", "Summarise the rules on {}.")


@dataclass(frozen=True, slots=True)
class Query:
    user: int
    question: int  # its number among the user's questions
    document: str  # the system message, shared by all of the user's questions
    text: str  # the user message


def document(tokenizer: Tokenizer, tokens: int, rng: random.Random, title: str) -> str:
    """Seeded contract-like prose of about `tokens` tokens (by the model's tokenizer, +-1 sentence)."""
    sentences = [f"{title}."]
    count = len(tokenizer.encode(sentences[0]))
    while count < tokens:
        batch = [
            f"Clause {len(sentences) + i}: {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
            f"{rng.choice(_OBJECTS)} {rng.choice(_WHEN)}."
            for i in range(10)
        ]
        sentences += batch
        count = len(tokenizer.encode(" ".join(sentences)))
    while len(sentences) > 1 and len(tokenizer.encode(" ".join(sentences[:-1]))) >= tokens:
        sentences.pop()
    return " ".join(sentences)


def questions(count: int, rng: random.Random) -> list[str]:
    """`count` distinct short questions (the pairs of ask and topic, shuffled, then numbered)."""
    pairs = [ask.format(topic) for ask in _ASKS for topic in _TOPICS]
    rng.shuffle(pairs)
    return [f"{pairs[i % len(pairs)]} (question {i + 1})" for i in range(count)]


def workload(
    tokenizer: Tokenizer, users: int, questions_per_user: int, prefix_tokens: int, seed: int, phase: int
) -> list[Query]:
    """Every user's questions, in a seeded shuffled order that interleaves the users."""
    rng = random.Random(f"fleet-bench/{seed}/{phase}")
    queries: list[Query] = []
    for u in range(users):
        title = (
            f"Case file {phase}-{u} ({rng.choice(_NAMES)} {rng.choice(_SURNAMES)}, "
            f"ref {rng.randrange(10**8):08d})"
        )
        doc = document(tokenizer, prefix_tokens, rng, title)
        queries += [Query(u, i, doc, q) for i, q in enumerate(questions(questions_per_user, rng))]
    rng.shuffle(queries)
    return queries
