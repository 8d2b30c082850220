"""ReadDeadline: one timer for a reader's moving deadline, and it still fires on time.

Driven by a virtual clock (``VirtualLoop``: ``time()`` and ``call_at`` only, what the class
uses), so the expected times are exact and a loaded machine cannot move them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from mlxcel.net.read_deadline import ReadDeadline


class Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualLoop:
    """``time()`` is a number that only ``advance`` moves; due timers run in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, Handle, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.armed = 0  # timers ever armed

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, fn: Callable[[], None]) -> Handle:
        h = Handle()
        self.armed += 1
        heapq.heappush(self._timers, (when, next(self._seq), h, fn))
        return h

    def advance(self, dt: float) -> None:
        end = self.now + dt
        while self._timers and self._timers[0][0] <= end:
            when, _, h, fn = heapq.heappop(self._timers)
            self.now = max(self.now, when)
            if not h.cancelled:
                fn()
        self.now = end

    @property
    def pending(self) -> int:
        return sum(not h.cancelled for _, _, h, _ in self._timers)


def deadline() -> tuple[VirtualLoop, ReadDeadline, list[tuple[str, float]]]:
    loop = VirtualLoop()
    expired: list[tuple[str, float]] = []
    d = ReadDeadline(loop, lambda why: expired.append((why, loop.time())))  # type: ignore[arg-type]
    return loop, d, expired


def test_reads_that_end_in_time_never_expire_and_share_one_timer() -> None:
    loop, d, expired = deadline()
    for _ in range(30):  # each read ends well inside its 0.05 s
        d.start(0.05, "late")
        loop.advance(0.01)
        d.done()
    loop.advance(1.0)
    assert expired == []
    # One timer at a time, re-armed only when it fires early: far fewer than one per read.
    assert loop.armed <= 8 and loop.pending == 0
    d.cancel()


def test_a_read_that_overruns_expires_once_with_its_reason_at_its_deadline() -> None:
    loop, d, expired = deadline()
    d.start(5.0, "idle")  # armed for 5 s...
    d.done()
    loop.advance(1.0)
    d.start(0.05, "frame late")  # ...and this read must end far earlier: at 1.05
    loop.advance(10.0)
    assert [why for why, _ in expired] == ["frame late"] and abs(expired[0][1] - 1.05) < 1e-9


def test_a_later_read_after_an_early_timer_is_still_bounded() -> None:
    """The timer armed for an earlier read fires early; it must re-arm for the read now in
    progress, not forget it."""
    loop, d, expired = deadline()
    d.start(0.05, "first")
    loop.advance(0.02)
    d.done()
    d.start(0.1, "second")  # ends at 0.12, after the timer armed for 0.05
    loop.advance(0.099)
    assert expired == []
    loop.advance(0.1)
    assert [why for why, _ in expired] == ["second"] and abs(expired[0][1] - 0.12) < 1e-9


def test_a_read_in_progress_when_its_timer_fires_expires_exactly_then() -> None:
    loop, d, expired = deadline()
    d.start(0.2, "idle")
    loop.advance(0.1999)
    assert expired == []
    loop.advance(0.0002)
    assert len(expired) == 1 and abs(expired[0][1] - 0.2) < 1e-9
    loop.advance(5.0)
    assert len(expired) == 1  # once


def test_cancel_disarms() -> None:
    loop, d, expired = deadline()
    d.start(0.03, "x")
    d.cancel()
    loop.advance(1.0)
    assert expired == [] and loop.pending == 0


def test_a_read_started_after_a_cancel_is_bounded_again() -> None:
    """A connection cancels its deadline when it closes a read loop and may start another:
    the new read must arm a timer of its own, even one later than the cancelled one."""
    loop, d, expired = deadline()
    d.start(5.0, "first")
    d.cancel()
    d.start(10.0, "second")
    loop.advance(9.999)
    assert expired == []
    loop.advance(0.002)
    assert [w for w, _ in expired] == ["second"] and abs(expired[0][1] - 10.0) < 1e-9
    d.start(3.0, "third")  # after an expiry the next read arms again
    loop.advance(3.0)
    assert [w for w, _ in expired] == ["second", "third"]
