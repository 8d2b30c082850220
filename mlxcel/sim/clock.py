"""Virtual time: one event heap, run in order, with a running hash of everything that ran.

Nothing here reads a wall clock. Two events at the same time run in the order they were
scheduled, so a run is a pure function of its inputs (and of its seed, for the callers that
draw from a seeded RNG).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Scheduler:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._trace = hashlib.blake2b(digest_size=16)

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + max(0.0, delay), fn, *args)

    def run(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to time ``until`` (or until ``stop()`` says so)."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.events += 1
            fn(*args)
            if stop is not None and stop():
                return
        self.now = max(self.now, until)

    @property
    def pending(self) -> int:
        return len(self._heap)

    def trace(self, *fields: object) -> None:
        """Add one line to the trace hash (the time in whole nanoseconds, then ``fields``)."""
        line = f"{round(self.now * 1e9)}|" + "|".join(map(str, fields))
        self._trace.update(line.encode())
        self._trace.update(b"\n")

    @property
    def trace_hash(self) -> str:
        return self._trace.hexdigest()
