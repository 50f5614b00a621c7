"""A small retrieval set: passages on distinct topics and, for each, two questions it answers: one
that shares a key word with it, and a paraphrase that shares none (so a hit needs more than word
overlap)."""

from __future__ import annotations

PASSAGES = [
    "The Amazon rainforest spans nine countries and holds about ten percent of the species on Earth.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen.",
    "The Great Wall of China was built over many centuries to guard northern borders from raids.",
    "A sourdough loaf rises thanks to wild yeast and lactic bacteria living in a flour starter.",
    "Jupiter is the largest planet of our solar system, a gas giant with a great red storm.",
    "Regular exercise strengthens the heart, lowers blood pressure and improves sleep.",
    "The stock market lets companies raise money by selling shares to investors.",
    "Beethoven composed nine symphonies, and wrote some of them after he had lost his hearing.",
]
QUESTIONS = [
    "Which jungle in South America is home to a huge variety of animals and plants?",
    "How do green leaves make food from light?",
    "What ancient fortification stretches across northern China?",
    "What makes naturally leavened bread go up?",
    "What is the biggest planet orbiting the Sun?",
    "Why is working out good for your health?",
    "How do businesses get funding from people buying stock?",
    "Which deaf composer wrote famous symphonies?",
]
PARAPHRASES = [
    "Where do jaguars, toucans and countless insects live among tall trees?",
    "How does a leaf feed itself?",
    "What did emperors erect to keep out nomadic invaders?",
    "Why does my homemade dough double in size overnight?",
    "Which world has a storm bigger than Earth?",
    "What does jogging do for my cardiovascular system?",
    "How can a firm get cash from shareholders?",
    "Who wrote the Ode to Joy despite going deaf?",
]
