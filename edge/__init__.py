"""The edge agent: a local OpenAI proxy on devices. Built by the edge-link issue."""
