"""Turning logits into tokens: the batched sampler and the grammar masks of constrained decoding."""
