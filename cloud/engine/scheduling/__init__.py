"""Which requests run each step: the scheduler, admission (what fits the context) and the context-overflow
policies."""
