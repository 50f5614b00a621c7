"""The OpenAI API: its routes, and chat, completions, streaming and structured outputs from an engine."""
