"""One device against two, on a CPU host: processes pinned to cores (``bench pipeline --pin``).

A machine without a second GPU still has cores. With every BLAS at one thread, a process
pinned to one core is one device; a pipeline whose two stage processes each hold a core of
their own is two. Affinity belongs to threads, so a running process is pinned thread by
thread (every thread it starts later inherits its creator's).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from mlxcel.base.errors import ConfigError


def two_cores() -> tuple[int, int]:
    """The first two cores this process may use (refused where there are fewer)."""
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("--pin", "pinning processes to cores needs Linux")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ConfigError("--pin", f"one device against two needs two cores; this has {len(cores)}")
    return cores[0], cores[1]


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cores``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def affinity(pid: int) -> set[int]:
    """The cores of ``pid``'s main thread."""
    return set(os.sched_getaffinity(pid))


@contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """This process on ``cores`` for the block, then back where it was."""
    pid = os.getpid()
    before = affinity(pid)
    pin(pid, cores)
    try:
        yield
    finally:
        pin(pid, before)
