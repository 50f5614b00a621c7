"""Build and load a C++ extension once per machine (torch.utils.cpp_extension), into
`$CTXFUSE_HOME/ext/<name>-<hash of the sources and flags>` (default ~/.cache/ctxfuse): a changed
source builds afresh, an unchanged one loads in milliseconds.

The code is compiled portably (no -march=native): functions that need AVX2 or AVX-512 carry
`__attribute__((target(...)))` and are chosen at run time from the CPU's flags, so one build runs on
every x86-64 machine of a fleet. Where the build fails (no compiler, no headers) `load_extension`
warns once, naming the reason, and returns None: callers keep their PyTorch path.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

CFLAGS = ("-O3", "-std=c++17", "-pthread")  # threads: thread_pool.h (no OpenMP)
LDFLAGS = ("-pthread",)


def _root() -> Path:
    # the same rule as shared/home.py (kernels import nothing of ours)
    return Path(os.environ.get("CTXFUSE_HOME") or Path.home() / ".cache" / "ctxfuse") / "ext"


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip package's binary is not there unless the
    virtual environment is activated."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(Path(ninja.BIN_DIR))
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


@cache
def load_extension(name: str, *sources: Path) -> ModuleType | None:
    """The compiled module, or None (with a warning) when it cannot be built here."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    try:
        digest = hashlib.sha256()
        # the sources and every header beside them (thread_pool.h), so a changed header rebuilds too
        headers = sorted({h for src in sources for h in src.parent.glob("*.h")})
        for src in (*sources, *headers):
            digest.update(src.read_bytes())
        digest.update(" ".join((*CFLAGS, *LDFLAGS, torch.__version__)).encode())
        build = _root() / f"{name}-{digest.hexdigest()[:16]}"
        build.mkdir(parents=True, exist_ok=True)
        return load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # a missing compiler, header or source: the PyTorch path still serves
        warnings.warn(
            f"ctxfuse: the C++ kernels {name!r} could not be built ({type(exc).__name__}: {exc}); "
            "using the PyTorch path",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


class Extension:
    """One C++ extension as its Python wrapper uses it, built (or loaded) on first use: `get()` gives
    the module or None (after the build's warning), `available()` says which, and `module()` raises
    RuntimeError naming the extension where it could not be built. `on_load` runs once on the module
    (gguf_matmul applies CTXFUSE_CPU_ISA there)."""

    def __init__(
        self, name: str, *sources: Path, on_load: Callable[[ModuleType], None] | None = None
    ) -> None:
        self.name = name
        self.sources = sources
        self._on_load = on_load
        self._ready = False

    def get(self) -> ModuleType | None:
        ext = load_extension(self.name, *self.sources)
        if ext is not None and not self._ready:
            if self._on_load is not None:
                self._on_load(ext)
            self._ready = True
        return ext

    def available(self) -> bool:
        """Whether the module builds (or is cached) here; the first call builds it."""
        return self.get() is not None

    def module(self) -> ModuleType:
        ext = self.get()
        if ext is None:
            raise RuntimeError(f"the C++ extension {self.name!r} could not be built here (see the warning)")
        return ext


ISAS = ("scalar", "avx2", "avx512")  # the vector paths of the extensions, narrowest first


@cache
def isa_cap() -> str | None:
    """`CTXFUSE_CPU_ISA` (scalar, avx2 or avx512): the widest vector path the kernels may take, to
    measure on an AVX-512 machine what an AVX2-only one runs. Unset: the widest the CPU has."""
    cap = os.environ.get("CTXFUSE_CPU_ISA", "").strip().lower() or None
    if cap is not None and cap not in ISAS:
        raise ValueError(f"CTXFUSE_CPU_ISA={cap!r}: expected one of {', '.join(ISAS)}")
    return cap
