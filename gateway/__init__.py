"""The OpenAI-compatible front door (Litestar + msgspec). Built by the openai-api issue."""
