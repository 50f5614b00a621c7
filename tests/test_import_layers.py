"""Imports flow one way (ARCHITECTURE.md): CLI -> gateway -> {edge, cloud} -> {shared, kernels}.
cloud never imports gateway or edge; edge never imports cloud or gateway (the agent installs without
torch); shared and kernels import nothing of ours; inside cloud, the model does not import the
engine. Every import counts: at module top, inside a function, or under TYPE_CHECKING."""

from __future__ import annotations

import ast
import subprocess
import sys
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


# What a router without an engine never loads (the `router` extra has none of them): the gateway
# package, the CLI's routing commands and the torch-free parts of cloud/ it reads must stay clear.
ENGINE_SIDE = ("torch", "transformers", "xgrammar", "triton", "gguf", "accelerate", "safetensors")
ROUTER_ENTRY = ("gateway", "ctxfuse.cli", "ctxfuse.serve_cli", "ctxfuse.fleet_cli")


# the engine's own code, which the gateway reaches only through the Backend the CLI hands it; of
# cloud/engine/ it may read the configuration's names and, on a worker, the prefix cache's event log
ENGINE_CODE = ("cloud.engine", "cloud.serving", "kernels", "cloud.grammar.compiler", "cloud.grammar.compiled")
ENGINE_CODE += tuple(
    f"cloud.model.{m}" for m in ("loading", "llama", "gemma3", "causal_lm", "linear", "weights")
)
GATEWAY_MAY_READ = ("cloud.engine.config", "cloud.engine.kv.block_events")


def engine_code(target: str) -> bool:
    if any(target == m or target.startswith(m + ".") for m in GATEWAY_MAY_READ):
        return False
    return any(target == m or target.startswith(m + ".") for m in ENGINE_CODE)


def gateway_modules() -> list[str]:
    return [module_name(p) for p in sources() if module_name(p).split(".")[0] == "gateway"]


def test_the_gateway_imports_no_engine_side_package() -> None:
    """Every gateway module imported in a fresh interpreter, then the routing CLI: no torch, grammar
    engine or GGUF reader in sys.modules (imports inside functions count only when they run)."""
    modules = [*gateway_modules(), *ROUTER_ENTRY]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(' '.join(sorted(k for k in sys.modules if k.split('.')[0] in {ENGINE_SIDE!r})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    loaded = {m.split(".")[0] for m in proc.stdout.split()}
    assert not loaded, f"importing the gateway loads {sorted(loaded)}"


def test_no_gateway_module_imports_the_engine_or_the_model_code() -> None:
    """Statically too: the engine's clients live in cloud/serving/, built by the CLI and handed in."""
    found = []
    for rel in sources():
        if module_name(rel).split(".")[0] != "gateway":
            continue
        for line, target in imported(rel, (REPO / rel).read_text()):
            if target.split(".")[0] in ENGINE_SIDE or engine_code(target):
                found.append(f"{rel}:{line} imports {target}")
    assert not found, "\n".join(found)
