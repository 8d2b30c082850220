"""An asyncio event loop on virtual time: the production code runs on it unchanged.

The loop is a stock :class:`asyncio.SelectorEventLoop` whose clock is a number and whose
selector does no I/O: where the loop would wait for its next timer, the selector moves the
clock to that timer instead. Tasks, futures, ``asyncio.sleep``, ``asyncio.timeout``, queues
and ``call_at`` all behave as on a real loop, only without waiting -- so an adapter, a bus
and a role service run here exactly as they run over sockets, and an hour of cluster time
takes as long as the work done in it.

Nothing here reads a wall clock; the loop's ready queue and timer heap are deterministic, so
a run is a pure function of what is scheduled on it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from collections.abc import Callable
from typing import Any


class _FifoTimer(asyncio.TimerHandle):
    """A timer that runs after every timer scheduled before it for the same time (asyncio's
    own compare only the times: ties would run in heap order, and a link's two messages
    arriving at one instant could swap)."""

    __slots__ = ("_seq",)

    def __lt__(self, other: object) -> bool:
        if isinstance(other, _FifoTimer):
            return (self._when, self._seq) < (other._when, other._seq)
        return super().__lt__(other)


class _NoIOSelector(selectors.BaseSelector):
    """Keeps the loop's registrations (its self-pipe) and never reports an event; a wait
    moves the virtual clock instead, bounded by ``until``."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, _fd(fileobj), events, data)
        self._keys[key.fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(_fd(fileobj))

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return dict(self._keys)

    def select(self, timeout: float | None = None) -> list[Any]:
        loop = self.loop
        assert loop is not None
        loop.turns += 1
        if loop.stop_when is not None and loop.stop_when():
            loop.stop()
        elif timeout is None:  # nothing ready and no timer: nothing will ever happen again
            loop.stop()
        elif timeout > 0:
            if loop.now + timeout > loop.until:
                loop.now = max(loop.now, loop.until)
                loop.stop()
            else:
                loop.now += timeout
        return []


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else fileobj.fileno()


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _NoIOSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0
        self.until = 0.0
        self.stop_when: Callable[[], bool] | None = None
        self._order = itertools.count()
        self.turns = 0  # turns of the loop: what the simulator counts as events
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> Any:
        self._check_closed()
        timer = _FifoTimer(when, callback, args, self, context)
        timer._seq = next(self._order)
        heapq.heappush(self._scheduled, timer)
        timer._scheduled = True
        return timer

    def run_to(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run everything due up to virtual time ``until`` (or until ``stop()`` is true,
        checked once per turn of the loop, or until nothing is left to happen)."""
        self.until, self.stop_when = until, stop
        try:
            self.run_forever()
        finally:
            self.stop_when = None

    def shut(self) -> None:
        """Cancel what still runs, let it unwind, and close the loop."""
        tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            self.until = self.now + 3600.0
            self.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.close()
