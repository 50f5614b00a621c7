"""Whether a grammar can ever finish: the rules that derive at least one finite string.

A grammar such as `root ::= "a" root` compiles (xgrammar and llguidance take it), but no output can
ever complete it: the model would write "aaaa..." until max_tokens and the answer would never parse.
Such a request is refused before decoding. The check is the textbook productivity fixpoint over the
grammar as xgrammar prints it after parsing (`str(xgr.Grammar)`: one `name ::= body` per line,
bodies of quoted strings, character classes, rule names, parentheses, `|`, and `*`, `+`, `?`,
`{m, n}` repetition, with `(=(...))` lookaheads that only restrict and are ignored here).

A character class always matches something unless it is a negated class of every code point; a
repetition whose lower bound is 0 matches the empty string. An unparsable body is assumed
productive: this check only refuses what it can prove.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<name>[A-Za-z_][\w.\-]*)'
    r"|(?P<rep>\{\s*\d+\s*(?:,\s*\d*\s*)?\})|(?P<op>[()|*+?=]))"
)
_ZERO_MIN = re.compile(r"\{\s*0\s*(,|\})")
_EVERYTHING = re.compile(r"^\[\^\\0-\\U0010[fF]{4}\]$")  # a negated class of all code points


class _Unparsed(Exception):
    pass


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        if body[pos:].strip() == "":
            break
        m = _TOKEN.match(body, pos)
        if m is None:
            raise _Unparsed(body[pos : pos + 20])
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Body:
    """One rule's body, asked whether it derives a finite string given the productive rules."""

    def __init__(self, body: str) -> None:
        self.toks = _tokens(body)

    def productive(self, known: set[str]) -> bool:
        self.known, self.i = known, 0
        ok = self._alternatives()
        if self.i != len(self.toks):
            raise _Unparsed("trailing tokens")
        return ok

    def _peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def _alternatives(self) -> bool:
        ok = self._sequence()
        while self._peek() == ("op", "|"):
            self.i += 1
            ok = self._sequence() or ok
        return ok

    def _sequence(self) -> bool:
        ok = True
        while (tok := self._peek()) is not None and tok not in (("op", "|"), ("op", ")")):
            ok = self._item() and ok
        return ok

    def _item(self) -> bool:
        kind, text = self.toks[self.i]
        self.i += 1
        if (kind, text) == ("op", "(") and self._peek() == ("op", "="):  # a lookahead: no output
            self.i += 1
            self._alternatives()
            self._close()
            return True
        if (kind, text) == ("op", "("):
            ok = self._alternatives()
            self._close()
        elif kind == "str":
            ok = True
        elif kind == "cls":
            ok = not _EVERYTHING.match(text)
        elif kind == "name":
            ok = text in self.known
        else:
            raise _Unparsed(text)
        while (tok := self._peek()) is not None and (tok[0] == "rep" or tok[1] in ("*", "+", "?")):
            self.i += 1
            if tok[1] in ("*", "?") or (tok[0] == "rep" and _ZERO_MIN.search(tok[1])):
                ok = True  # zero repetitions: the empty string
        return ok

    def _close(self) -> None:
        if self._peek() != ("op", ")"):
            raise _Unparsed("unbalanced parentheses")
        self.i += 1


def unproductive_rules(printed: str) -> list[str] | None:
    """The rules of a grammar (as xgrammar prints it) that derive no finite string, in order; None
    when the text is not in the form this reads (nothing is proven then)."""
    bodies: dict[str, _Body] = {}
    try:
        for line in printed.splitlines():
            if not line.strip():
                continue
            name, sep, body = line.partition(" ::= ")
            if not sep:
                raise _Unparsed(line[:20])
            bodies[name.strip()] = _Body(body)
        productive: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, rule in bodies.items():
                if name not in productive and rule.productive(productive):
                    productive.add(name)
                    changed = True
    except _Unparsed:
        return None
    return [name for name in bodies if name not in productive]
