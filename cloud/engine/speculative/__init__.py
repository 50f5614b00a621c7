"""Speculative decoding: drafts (ngram.py) verified in the step's one forward (verify.py)."""
