"""Give freed heap back to the operating system after a large one-time load (glibc's malloc_trim).

Building a tokenizer from its JSON allocates tens of MiB that are freed at once but stay in the
process's heap, counted in its RSS, until something reuses them; a router that loads one tokenizer
and then serves small requests never does. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


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
