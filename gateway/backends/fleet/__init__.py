"""The gateway's fleet mode: routing across many backends (ctxfuse workers and other
OpenAI-compatible servers)."""
