"""Render a model's chat template (Jinja, shipped inside the GGUF) into the prompt text.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable sandbox.
The environment mirrors transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`) so a template renders here
exactly as its authors tested it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import InvalidRequestError, ModelLoadError

# For models that ship no template; the ChatML layout that transformers once used as its default.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


_TEMPLATES = Path(__file__).with_name("templates")
# For GGUF files without a template whose architecture has one turn format (GGUF
# `general.architecture` -> our template file). Any other file without one gets ChatML.
_ARCH_TEMPLATES = {"gemma": "gemma.jinja", "gemma2": "gemma.jinja", "gemma3": "gemma.jinja"}


def default_chat_template(arch: str) -> str | None:
    """Our template for a model of architecture `arch` whose file carries none; None if we know none."""
    name = _ARCH_TEMPLATES.get(arch)
    return None if name is None else (_TEMPLATES / name).read_text()


# what every render sets: a request may add variables, never replace these
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _raise_exception(message: str) -> None:
    # Templates call this to refuse a conversation (e.g. "roles must alternate user/assistant").
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>` and `&`, which would change the prompt the model sees.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates refer to."""

    def __init__(
        self,
        template: str | None,
        bos_token: str = "",
        eos_token: str = "",
        origin: str = "the model's chat template",
    ) -> None:
        self.source = template or CHATML_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(f"{origin} does not compile: {exc}") from exc

    def replaced(self, source: str, origin: str) -> ChatTemplate:
        """Another template for the same model (`--chat-template`): its special tokens stay the model's."""
        return ChatTemplate(source, self.bos_token, self.eos_token, origin)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ChatTemplate, (self.source, self.bos_token, self.eos_token))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`; a conversation the template refuses is the client's error.
        `extra`: more template variables (a request's chat_template_kwargs), never one of ours."""
        taken = RESERVED_VARIABLES.intersection(extra or {})
        if taken:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(sorted(taken))}: the server sets it",
                param="chat_template_kwargs",
            )
        try:
            return self._template.render(
                **(extra or {}),
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            # TypeError/ValueError: the template met a message of a shape it cannot format
            # (e.g. `None` content joined to a string).
            raise InvalidRequestError(
                f"chat template rejected the messages: {exc}", param="messages"
            ) from exc
