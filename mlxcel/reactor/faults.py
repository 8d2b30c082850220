"""Faults: one vocabulary and one scheduler, for the simulator, the fault bench and the tests.

A :class:`Fault` is something that goes wrong and is put right again -- a partition and its
heal, a crash and its restart, a loss rate switched on and off, a process stopped and
continued -- as a named pair of calls. A :class:`FaultPlan` says when each is on, on any
clock: the simulator installs it on its virtual scheduler (``plan.install(sched.at)``) and
reads from it the windows in which requests may fail; the fault bench and its tests (real
processes on network namespaces, wall clock) run one fault at a time with
:func:`mlxcel.bench.faults.run_fault`, which applies it, waits until the cluster noticed,
and undoes it. Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Fault:
    name: str
    apply: Callable[[], object]
    undo: Callable[[], object] = _nothing
    # May fail requests while on and for ``tail`` seconds after (a deadline to notice it, a
    # message delayed past its end...). Duplicates, reordering and skew must fail nothing.
    hurts: bool = True
    tail: float = 0.0


@dataclass(frozen=True)
class Planned:
    fault: Fault
    start: float
    end: float | None  # None: never undone in this run

    def harm(self, horizon: float) -> tuple[float, float] | None:
        """When a request may fail because of it (None: never)."""
        if not self.fault.hurts:
            return None
        end = horizon if self.end is None else self.end
        return self.start, end + self.fault.tail


@contextmanager
def applied(fault: Fault) -> Iterator[Fault]:
    """``with applied(fault):`` -- on for the block, undone however it ends."""
    fault.apply()
    try:
        yield fault
    finally:
        fault.undo()


def window(
    rng: random.Random, horizon: float, shortest: float = 0.2, longest: float = 4.0
) -> tuple[float, float]:
    """A random fault window starting within ``horizon``."""
    t0 = rng.uniform(0.0, horizon)
    return t0, t0 + rng.uniform(shortest, longest)


class FaultPlan:
    """When each fault is applied and undone."""

    def __init__(self) -> None:
        self.planned: list[Planned] = []
        self._installed = 0  # how many of ``planned`` are on a clock already

    def add(self, fault: Fault, start: float, end: float | None) -> Planned:
        if end is not None and end < start:
            raise ValueError(f"fault {fault.name!r}: undone at {end} before applied at {start}")
        p = Planned(fault, start, end)
        self.planned.append(p)
        return p

    def install(self, at: Callable[[float, Callable[[], object]], object]) -> None:
        """Schedule every apply and undo not scheduled yet on a clock's ``at(time, fn)`` (a
        plan installed again adds only what was planned since)."""
        new, self._installed = self.planned[self._installed :], len(self.planned)
        for p in new:
            at(p.start, p.fault.apply)
            if p.end is not None:
                at(p.end, p.fault.undo)

    def harmful(self, horizon: float = float("inf")) -> list[tuple[float, float]]:
        """The windows in which requests may fail (``horizon``: the end of a fault never
        undone)."""
        return [w for p in self.planned if (w := p.harm(horizon)) is not None]

    def harms(self, start: float, end: float) -> bool:
        """Whether a request that ran from ``start`` to ``end`` met a harmful window."""
        return any(t0 <= end and start <= t1 for t0, t1 in self.harmful())

    def on_during(self, start: float, end: float) -> list[str]:
        """The faults on at some time between ``start`` and ``end``, by name (for a report)."""
        return [
            p.fault.name
            for p in self.planned
            if p.start <= end and (p.end is None or start < p.end)
        ]

    def unexplained(self, start: float, end: float) -> str | None:
        """Why a failure between ``start`` and ``end`` is a violation, or None when a
        harmful fault explains it."""
        if self.harms(start, end):
            return None
        on = self.on_during(start, end)
        return "though no fault touched it" + (
            f" (harmless ones on: {', '.join(on)})" if on else ""
        )
