"""Virtual time: the scenario's events on the virtual asyncio loop, with a running hash of
everything that ran.

The scheduler is the scenario's handle on :class:`~mlxcel.sim.vloop.VirtualLoop`: the
simulated network, the simulated compute and the fault schedule put their events on the same
loop that runs the production adapters and services, so one clock orders them all. Nothing
here reads a wall clock: a run is a pure function of its inputs (and of its seed, for the
callers that draw from a seeded RNG).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Coroutine
from typing import Any

from mlxcel.sim.vloop import VirtualLoop


class Scheduler:
    def __init__(self) -> None:
        self.loop = VirtualLoop()
        self.scheduled = 0  # scenario events run (network, compute, faults)
        self._trace = hashlib.blake2b(digest_size=16)

    @property
    def now(self) -> float:
        return self.loop.now

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        self.loop.call_at(max(when, self.now), self._run, fn, args)

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + max(0.0, delay), fn, *args)

    @property
    def events(self) -> int:
        """Everything that ran: the scenario's events and every other turn of the loop."""
        return self.scheduled + self.loop.turns

    def _run(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.scheduled += 1
        fn(*args)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task on the virtual loop (a simulated process's life)."""
        return self.loop.create_task(coro, name=name)

    def run(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run everything due up to time ``until`` (or until ``stop()`` says so)."""
        self.loop.run_to(until, stop)

    def close(self) -> None:
        """End every simulated process and close the loop (once the scenario is checked)."""
        if not self.loop.is_closed():
            self.loop.shut()

    def trace(self, *fields: object) -> None:
        """Add one line to the trace hash (the time in whole nanoseconds, then ``fields``)."""
        line = f"{round(self.now * 1e9)}|" + "|".join(map(str, fields))
        self._trace.update(line.encode())
        self._trace.update(b"\n")

    @property
    def trace_hash(self) -> str:
        return self._trace.hexdigest()
