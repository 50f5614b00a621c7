"""How the CPU engine's threads wait. Imports nothing heavy: it must run before torch loads.

Our C++ kernels hand work to their own pool (thread_pool.h); PyTorch's ops to its OpenMP team. Both
keep a worker per core. libgomp's default lets an OpenMP worker spin for a while after every
parallel region, so on a decode step, where our kernels and PyTorch's ops alternate, those spinning
threads held the cores our pool's worker needed: with OMP_WAIT_POLICY=PASSIVE (OpenMP workers sleep
at once) an in-process decode step at one stream took 8.3 ms instead of 13-14 ms, and 62 instead of
82-96 ms at 32 streams (2 cores, AMD EPYC; docs/benchmarks.md). libgomp reads the variable once, when
it loads, so it must be in the environment before torch is imported: `ctxfuse` sets it first thing
and the engine process inherits it. A value the user set is kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

WAIT_POLICY = ("OMP_WAIT_POLICY", "PASSIVE")


def quiet_openmp() -> None:
    """Make OpenMP workers sleep between regions in this process (before torch loads) and in the
    processes it starts, unless the user chose otherwise."""
    os.environ.setdefault(*WAIT_POLICY)


@contextmanager
def quiet_openmp_for_children() -> Iterator[None]:
    """Within the block, processes started (spawned) get OMP_WAIT_POLICY=PASSIVE unless the user set
    a policy; this process's environment is restored after."""
    name, value = WAIT_POLICY
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
