"""After a large one-time load: give freed heap back to the operating system (glibc's malloc_trim),
and take what was loaded out of the garbage collector's full passes.

Building a tokenizer from its JSON allocates tens of MiB that are freed at once but stay in the
process's heap, counted in its RSS, until something reuses them; a router that loads one tokenizer
and then serves small requests never does. Elsewhere than glibc this does nothing.

A full collection walks every tracked object: a gateway holds ~120,000 from its start (the app, the
tokenizer's tables, the template) and walked them every few hundred requests, 20-60 ms each time:
the router's p99 at one connection was 50 ms for 4 ms requests (docs/benchmarks.md). Frozen objects
are skipped by collections (they are freed as usual when nothing refers to them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def freeze_loaded() -> None:
    """What the process holds now is long-lived: collected once, then left out of later collections."""
    gc.collect()
    gc.freeze()


def release_free_heap() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return
    trim(0)
