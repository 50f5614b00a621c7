"""Wire types and helpers used by more than one tier. Imports nothing else of ctxfuse."""
