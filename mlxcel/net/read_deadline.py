"""A reader's deadline that moves with every read, without a timer per read.

A connection bounds each read (the idle wait between messages, the rest of a frame once its
header is in). An ``asyncio.timeout`` around each read makes and cancels a timer every time,
which on a busy link is most of the reads' cost. :class:`ReadDeadline` keeps at most one timer
armed on the loop: starting a read only records when it must end; the timer is moved only
when that end is earlier than the time it is armed for, and when it fires early (the reads
it was armed for ended in time) it re-arms for the read in progress, if any.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ReadDeadline:
    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[str], None]) -> None:
        self._loop = loop
        self._expire = expire  # called once, with the reason, when a read overruns
        self._end: float | None = None  # the read in progress must end by this time
        self._why = ""
        self._armed: asyncio.TimerHandle | None = None
        self._armed_at = 0.0

    def start(self, seconds: float, why: str) -> None:
        """A read begins that must end within ``seconds``."""
        self._end = end = self._loop.time() + seconds
        self._why = why
        if self._armed is None or self._armed_at > end:
            self._arm(end)

    def done(self) -> None:
        """The read in progress ended (with data, an error or a cancellation)."""
        self._end = None

    def cancel(self) -> None:
        self._end = None
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None

    def _arm(self, when: float) -> None:
        if self._armed is not None:
            self._armed.cancel()
        self._armed, self._armed_at = self._loop.call_at(when, self._check), when

    def _check(self) -> None:
        self._armed = None
        end = self._end
        if end is None:
            return  # no read in progress: the next one arms again
        if self._loop.time() >= end:
            self._end = None
            self._expire(self._why)
        else:
            self._arm(end)
