"""A NoLiMa-style task (Modarressi et al., "NoLiMa: Long-Context Evaluation Beyond Literal
Matching", 2025): the needle and its question share no content word, so the needle is found only
through one associative step the model must know, a landmark to its city or country. The needle
("Actually, Orvelle lives next to the Semper Opera House.") sits in the needle task's varied prose;
the question ("Which character has been to Dresden?") names the place; the answer is the character.

The table is this benchmark's own: landmarks famous enough that a small model has likely read of
them with their place. None of their words, nor any place or character name, is a word of the
haystack's lists (longctx_words.py), so neither the question nor the needle has a literal echo there.
"""

from __future__ import annotations

import random

from .longctx_draft import Draft, Needle, prose, sentence_haystack

# (landmark, as it follows "lives next to"; the place the question names)
LANDMARKS = (
    ("the Semper Opera House", "Dresden"),  # NoLiMa's own example
    ("the Kremlin", "Moscow"),
    ("the Colosseum", "Rome"),
    ("the Acropolis", "Athens"),
    ("the Taj Mahal", "India"),
    ("the Sagrada Familia", "Barcelona"),
    ("Big Ben", "London"),
    ("the Louvre", "Paris"),
    ("Christ the Redeemer", "Brazil"),
    ("Machu Picchu", "Peru"),
    ("the Forbidden City", "Beijing"),
    ("the Pyramids of Giza", "Egypt"),
    ("the Burj Khalifa", "Dubai"),
    ("Mount Fuji", "Japan"),
    ("Angkor Wat", "Cambodia"),
    ("the Hagia Sophia", "Istanbul"),
    ("the Matterhorn", "Switzerland"),
    ("the Rijksmuseum", "Amsterdam"),
    ("the Atomium", "Brussels"),
    ("Mount Vesuvius", "Naples"),
    ("Stonehenge", "England"),
    ("Uluru", "Australia"),
    ("the Empire State Building", "New York"),
    ("the Great Wall", "China"),
    ("the Alhambra", "Spain"),
    ("Mount Kilimanjaro", "Tanzania"),
)

# made-up names: no model has a prior for one, and none is among the haystack's names
CHARACTERS = (
    "Orvelle", "Talmira", "Brisken", "Quenlow", "Idrasha", "Corvane", "Mirelka", "Dovrin", "Elsmarra",
    "Fennaro", "Galwyn", "Haskeline", "Jorvith", "Kestavin", "Lunavee", "Marrick", "Nessaly", "Perrowen",
    "Rosmund", "Sabrell", "Thaddeo", "Velmira", "Wynford", "Yselda",
)  # fmt: skip


def nolima(rng: random.Random, depth: int) -> Draft:
    landmark, place = rng.choice(LANDMARKS)
    character = rng.choice(CHARACTERS)
    return Draft(
        "Read the following story. I will ask you about one of its characters afterwards.",
        f"Which character has been to {place}?",
        f"The character who has been to {place} is",
        (Needle(f"Actually, {character} lives next to {landmark}.", depth),),
        sentence_haystack(prose(rng)),
        character,
        place,
        (character,),
        match="word",
    )
