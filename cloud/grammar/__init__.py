"""Structured output: JSON-schema and tool-call grammars, what they can enforce, and reading results."""
