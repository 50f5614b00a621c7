"""Fixtures of the fleet tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .openai_stub import StubServer


@pytest.fixture()
def stubs() -> Iterator[tuple[StubServer, StubServer]]:
    a, b = StubServer("a"), StubServer("b")
    yield a, b
    a.stop()
    b.stop()
