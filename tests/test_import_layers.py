"""Imports flow one way (ARCHITECTURE.md): CLI -> gateway -> {edge, cloud} -> {shared, kernels}.
cloud never imports gateway or edge; edge never imports cloud or gateway (the agent installs without
torch); shared and kernels import nothing of ours; inside cloud, the model does not import the
engine. Every import counts: at module top, inside a function, or under TYPE_CHECKING."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("ctxfuse", "gateway", "edge", "cloud", "shared", "kernels")

# what each layer may import of ours (itself always)
ALLOWED: dict[str, set[str]] = {
    "ctxfuse": {"gateway", "edge", "cloud", "shared", "kernels"},
    "gateway": {"edge", "cloud", "shared", "kernels"},
    "edge": {"shared"},
    "cloud": {"shared", "kernels"},
    "shared": set(),
    "kernels": set(),
}
# finer rules inside a layer: (importer prefix, forbidden prefix)
FORBIDDEN_WITHIN = [("cloud.model", "cloud.engine")]


def module_name(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(rel: Path, text: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in a file's text, relative ones resolved."""
    module = module_name(rel)
    package = module if rel.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(text, str(rel))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:  # `from pkg import sub` may name a submodule
                yield node.lineno, f"{target}.{alias.name}"


def sources() -> list[Path]:
    return sorted(p.relative_to(REPO) for top in OURS for p in (REPO / top).rglob("*.py"))


def violations(rel: Path, text: str) -> list[str]:
    importer = module_name(rel)
    layer = importer.split(".")[0]
    found = []
    for line, target in imported(rel, text):
        top = target.split(".")[0]
        where = f"{rel}:{line} imports {target}"
        if top in OURS and top != layer and top not in ALLOWED[layer]:
            found.append(f"{where} ({layer} may not import {top})")
        for inner, forbidden in FORBIDDEN_WITHIN:
            if importer.startswith(inner) and (target == forbidden or target.startswith(forbidden + ".")):
                found.append(f"{where} ({inner} may not import {forbidden})")
    return found


def test_every_layer_is_checked() -> None:
    assert {module_name(p).split(".")[0] for p in sources()} == set(OURS)


def test_imports_flow_one_way() -> None:
    found = [v for rel in sources() for v in violations(rel, (REPO / rel).read_text())]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("importer", "code", "bad"),
    [
        ("edge/agent.py", "from cloud.model import llama\n", True),
        ("edge/agent.py", "def f():\n    import gateway.app\n", True),
        (
            "cloud/engine/core.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import edge\n",
            True,
        ),
        ("cloud/model/llama.py", "from ..engine.attention import AttentionBackend\n", True),
        ("cloud/model/llama.py", "from cloud import engine\n", True),
        ("shared/errors.py", "from kernels import x\n", True),
        ("cloud/engine/core.py", "from ..model.llama import LlamaModel\n", False),
        ("gateway/app.py", "from edge.vision import features\n", False),
        ("edge/agent.py", "from .vision.features import ImagePipeline\n", False),
    ],
)
def test_the_check_catches_what_it_should(importer: str, code: str, bad: bool) -> None:
    assert bool(violations(Path(importer), code)) is bad
