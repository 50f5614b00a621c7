"""The engine's loop for its callers: the async engine (a thread of its own), the engine process behind a
pipe, and the per-request output streams."""
