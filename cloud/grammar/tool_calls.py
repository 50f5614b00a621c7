"""Reading tool calls out of model output, whole (`parse_tool_calls`) or as it streams
(`ToolCallStream`). The grammar builder writes calls with the same constants, so what the grammar
lets the model produce and what is read here cannot drift apart. One call (Hermes/Qwen convention):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside calls is content. A block not exactly of this shape, or cut off, is not a call and
stays content. `parse_tool_calls` is the reference; the streaming reader commits to a call once its
header is read (see `ToolCallStream`), and agrees with the reference on well-formed text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum

from .json_scan import STRING_BODY, ContainerScan, container_end

CALL_BEGIN = "<tool_call>\n"
CALL_END = "\n</tool_call>"
# Calls follow each other directly. After "</tool_call>" a small model strongly prefers a newline to
# ending its turn; with a newline allowed between calls it repeats calls until max_tokens, while
# with the newline forbidden it chooses between another call and the end (SmolLM2-135M: "\n" 0.80,
# end-of-turn 0.18, "<" under 0.001 after its first call).
CALL_SEPARATOR = ""
CALL_SUFFIX = "}" + CALL_END
_NAME_KEY = '{"name": '
_ARGUMENTS_KEY = ', "arguments": '


def call_prefix(name: str) -> str:
    """Everything of a call before its arguments object."""
    return CALL_BEGIN + _NAME_KEY + json.dumps(name) + _ARGUMENTS_KEY


def _prefixes(literal: str) -> str:
    """A pattern matching exactly the prefixes of `literal`, from "" to all of it."""
    pattern = ""
    for char in reversed(literal):
        pattern = f"(?:{re.escape(char)}{pattern})?"
    return pattern


_HEADER = re.compile(f'{re.escape(CALL_BEGIN + _NAME_KEY)}("{STRING_BODY}"){re.escape(_ARGUMENTS_KEY)}')
# Text that more text could still turn into a header: a prefix of the fixed opening, or the opening
# and a name literal in progress (possibly stopped inside an escape).
_HEADER_START = re.compile(
    f"{_prefixes(CALL_BEGIN + _NAME_KEY)}"
    f'|{re.escape(CALL_BEGIN + _NAME_KEY)}"{STRING_BODY}'
    rf'(?:\\(?:u[0-9a-fA-F]{{0,3}})?|"{_prefixes(_ARGUMENTS_KEY)})?'
)


@dataclass(slots=True, frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object exactly as the model wrote it


def _is_json_object(text: str) -> bool:
    def reject_constant(word: str) -> None:
        raise ValueError(f"{word} is not JSON")  # json.loads accepts NaN and Infinity; clients do not

    try:
        return isinstance(json.loads(text, parse_constant=reject_constant), dict)
    except (ValueError, RecursionError):
        return False


def _call_at(text: str, begin: int) -> tuple[ParsedCall, int] | None:
    """The call whose CALL_BEGIN is at text[begin] and the offset just past it; None if malformed."""
    header = _HEADER.match(text, begin)
    if header is None or not text.startswith("{", header.end()):
        return None
    end = container_end(text, header.end())
    if end is None or not text.startswith(CALL_SUFFIX, end):
        return None
    arguments = text[header.end() : end]
    if not _is_json_object(arguments):
        return None
    return ParsedCall(json.loads(header.group(1)), arguments), end + len(CALL_SUFFIX)


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls): content is all text outside well-formed calls, stripped, None if empty."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    taken = search = 0  # text[:taken] is accounted for; look for the next call from `search`
    while (begin := text.find(CALL_BEGIN, search)) >= 0:
        found = _call_at(text, begin)
        if found is None:
            search = begin + 1  # not a call: it stays content, but a real one may start inside it
            continue
        call, end = found
        content.append(text[taken:begin])
        calls.append(call)
        taken = search = end
    content.append(text[taken:])
    return "".join(content).strip() or None, calls


@dataclass(slots=True, frozen=True)
class ContentDelta:
    text: str


@dataclass(slots=True, frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(slots=True, frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(slots=True, frozen=True)
class CallEnded:
    index: int


StreamEvent = ContentDelta | CallStarted | ArgumentsDelta | CallEnded


class _Mode(Enum):
    CONTENT = "content"  # outside calls; _pending may hold the start of a possible header
    ARGUMENTS = "arguments"  # inside the arguments object of the open call
    SUFFIX = "suffix"  # arguments closed; _pending holds what has come of CALL_SUFFIX


class ToolCallStream:
    """Turns model output, fed in pieces of any size, into content and call events.

    Invariants: content never includes text that later turns out to open a call (a possible header
    is held back until decided); arguments text is passed on as soon as it is known to be inside
    the arguments object, and one call's ArgumentsDelta texts join to its arguments exactly; the
    ContentDelta texts join to `parse_tool_calls`' content (or ""), whitespace being held until
    more content follows, so none is sent between calls.

    A call is started (CallStarted) once its header is read, and ended (CallEnded) only when its
    arguments are a valid JSON object followed by CALL_SUFFIX. A started call that goes wrong
    (text the grammar should have prevented) is abandoned: it never gets CallEnded, and reading
    continues as content from where it went wrong. One still open at `finish` (output cut by
    max_tokens) likewise never ends; its arguments are incomplete, and the caller reports
    finish_reason "length" for it. A possible header still held at `finish` is flushed as content.
    """

    def __init__(self) -> None:
        self._mode = _Mode.CONTENT
        self._pending = ""  # text fed but not yet turned into events
        self._started = 0  # CallStarted events so far; the open call's index is _started - 1
        self._scan = ContainerScan()
        self._arguments: list[str] = []
        self._content_seen = False
        self._held_whitespace = ""
        self._finished = False

    def feed(self, text: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("ToolCallStream.feed after finish")
        self._pending += text
        events: list[StreamEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not self._finished and self._mode is _Mode.CONTENT:
            self._content(events, self._pending)
        self._pending, self._finished = "", True
        return events

    def _step(self, events: list[StreamEvent]) -> bool:
        """Turns as much pending text as the current mode can into events; True if the mode
        changed and the rest of the pending text needs another look."""
        if self._mode is _Mode.CONTENT:
            return self._step_content(events)
        if self._mode is _Mode.ARGUMENTS:
            return self._step_arguments(events)
        return self._step_suffix(events)

    def _step_content(self, events: list[StreamEvent]) -> bool:
        text = self._pending
        at = text.find("<")
        while at >= 0:
            header = _HEADER.match(text, at)
            if header is not None:
                self._content(events, text[:at])
                events.append(CallStarted(self._started, json.loads(header.group(1))))
                self._started += 1
                self._mode, self._pending = _Mode.ARGUMENTS, text[header.end() :]
                self._scan, self._arguments = ContainerScan(), []
                return True
            if _HEADER_START.fullmatch(text, at):
                self._content(events, text[:at])
                self._pending = text[at:]  # undecided: wait for more text
                return False
            at = text.find("<", at + 1)
        self._content(events, text)
        self._pending = ""
        return False

    def _step_arguments(self, events: list[StreamEvent]) -> bool:
        text, index = self._pending, self._started - 1
        if not text:
            return False
        if not self._arguments and not text.startswith("{"):
            self._mode = _Mode.CONTENT  # abandoned before its arguments began
            return True
        end = self._scan.feed(text)
        piece = text if end is None else text[:end]
        events.append(ArgumentsDelta(index, piece))
        self._arguments.append(piece)
        self._pending = text[len(piece) :]
        if end is None:
            return False
        valid = _is_json_object("".join(self._arguments))
        self._mode = _Mode.SUFFIX if valid else _Mode.CONTENT
        return True

    def _step_suffix(self, events: list[StreamEvent]) -> bool:
        text = self._pending
        if text.startswith(CALL_SUFFIX):
            events.append(CallEnded(self._started - 1))
            self._pending = text[len(CALL_SUFFIX) :]
        elif CALL_SUFFIX.startswith(text):
            return False
        self._mode = _Mode.CONTENT  # ended, or abandoned at the first character that differs
        return True

    def _content(self, events: list[StreamEvent], text: str) -> None:
        """Emits content, stripped as a whole: whitespace is passed on only once content follows."""
        if not self._content_seen:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._held_whitespace += text if self._content_seen else ""
            return
        piece = self._held_whitespace + body
        self._held_whitespace, self._content_seen = text[len(body) :], True
        last = events[-1] if events else None
        if isinstance(last, ContentDelta):
            events[-1] = ContentDelta(last.text + piece)  # one delta per stretch of content
        else:
            events.append(ContentDelta(piece))
