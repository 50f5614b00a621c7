"""Prompts from a ShareGPT-like file: a JSON array or JSON lines of conversations.

Each conversation is `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`
(ShareGPT) or `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}` (OpenAI
style). The first human turn is the prompt; the first assistant turn after it sets the output length
(in words), unless --output-len overrides it. Conversations without either are skipped.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from gateway.bench.serving.dataset import Prompt

HUMAN = frozenset({"human", "user"})
ASSISTANT = frozenset({"gpt", "assistant", "chatgpt", "bard", "model"})


class _Part(msgspec.Struct):
    text: str | None = None


class _Turn(msgspec.Struct):
    from_: str | None = msgspec.field(name="from", default=None)
    role: str | None = None
    value: str | None = None
    content: str | list[_Part] | None = None

    @property
    def speaker(self) -> str:
        return (self.from_ or self.role or "").lower()

    @property
    def text(self) -> str:
        if self.value is not None:
            return self.value
        if isinstance(self.content, list):
            return " ".join(p.text for p in self.content if p.text)
        return self.content or ""


class _Conversation(msgspec.Struct):
    conversations: list[_Turn] | None = None
    messages: list[_Turn] | None = None


def _decode(data: bytes) -> list[_Conversation]:
    if data.lstrip().startswith(b"["):
        return msgspec.json.decode(data, type=list[_Conversation])
    decoder = msgspec.json.Decoder(_Conversation)
    return [decoder.decode(line) for line in data.splitlines() if line.strip()]


def _prompt(conv: _Conversation, output_len: int | None) -> Prompt | None:
    turns = conv.conversations or conv.messages or []
    first = next((i for i, t in enumerate(turns) if t.speaker in HUMAN and t.text.strip()), None)
    if first is None:
        return None
    text = turns[first].text
    answer = next((t.text for t in turns[first + 1 :] if t.speaker in ASSISTANT), None)
    if output_len is None:
        if answer is None:
            return None
        output_len = max(1, len(answer.split()))
    return Prompt(text, len(text.split()), output_len)


def load_prompts(path: Path, output_len: int | None) -> list[Prompt]:
    """Every usable conversation's prompt, in the file's order; ValueError when the file is missing
    or not such a file."""
    try:
        convs = _decode(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read the dataset {path}: {exc.strerror or exc}") from exc
    except msgspec.MsgspecError as exc:
        raise ValueError(f"{path} is not a ShareGPT-like JSON or JSONL file: {exc}") from exc
    return [p for p in (_prompt(c, output_len) for c in convs) if p is not None]


def file_prompts(path: Path, n: int, output_len: int | None, seed: int) -> list[Prompt]:
    """`n` prompts in a seeded order; they repeat when the file holds fewer usable conversations."""
    usable = load_prompts(path, output_len)
    if not usable:
        raise ValueError(f"{path} holds no conversation with a human turn and an assistant answer")
    random.Random(seed).shuffle(usable)
    return [usable[i % len(usable)] for i in range(n)]
