"""Simulated compute for the production stage service: a compute "thread" on virtual time and
a stage runtime over the fake (or real tiny) model.

:class:`SimCompute` takes the place of :class:`~mlxcel.runtime.compute.ComputeThread`: jobs
run one after another, each finishing after the time the model says it takes, and their
futures resolve on the loop as a real thread's do. :class:`SimStageRuntime` takes the place
of :class:`~mlxcel.pipeline.stage_runtime.StageRuntime` for :class:`StageService`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from mlxcel.pipeline.stage_protocol import ComputeJob, SeqKey, StepOutput
from mlxcel.sim.clock import Scheduler


class SimCompute:
    """One job after another; ``cost(fn, args)`` says how long a job takes (virtual s)."""

    def __init__(
        self, sched: Scheduler, cost: Callable[[Callable[..., Any], tuple[Any, ...]], float]
    ):
        self.sched = sched
        self.cost = cost
        self.busy_until = sched.now
        self.alive = True  # false once the process is killed: nothing more completes

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        start = max(self.sched.now, self.busy_until)
        self.busy_until = start + self.cost(fn, args)
        self.sched.at(self.busy_until, self._finish, fut, fn, args)
        return fut

    def _finish(self, fut: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not self.alive:
            return
        try:
            fut.set_result(fn(*args))
        except Exception as exc:
            fut.set_exception(exc)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.submit(fn, *args))


@dataclass
class SimLayers:
    start: int
    end: int


class _NoTiming:
    def fields(self) -> dict[str, Any]:
        return {}


class SimStageRuntime:
    """The stage runtime's surface over a fake stage backend (``run``/``free``/``caches``)."""

    def __init__(self, backend: Any, model: Any, layers: tuple[int, int]) -> None:
        self.backend = backend
        self.model = model
        self.layers = SimLayers(*layers)
        self.width = model.width
        self.vocab = model.vocab
        self.timing = _NoTiming()
        self.slow = 1.0  # the host's compute time multiplier (a slow node)
        self.traced: Callable[..., None] | None = None  # the scheduler's trace, for this host

    def cost(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> float:
        if fn == self.run:
            return float(self.model.compute_time(args[0])) * self.slow
        return 0.0  # a free, queued behind the jobs before it

    def run(self, job: ComputeJob) -> tuple[list[StepOutput], float]:
        return self.backend.run(job), float(self.model.compute_time(job)) * self.slow

    def free(self, key: SeqKey) -> None:
        self.backend.free(key)

    def load_prefix(self, key: SeqKey, owner: str, entry: int, tokens: int) -> None:
        self.backend.load_prefix(key, owner, entry, tokens)
        if self.traced is not None:  # which cache a sequence starts from is part of the run
            self.traced("load", key[0], entry, tokens)

    def keep_prefix(self, key: SeqKey, owner: str, entry: int, tokens: int) -> str | None:
        return self.backend.keep_prefix(key, owner, entry, tokens)

    def drop_prefixes(self, owner: str, entries: tuple[int, ...] = ()) -> None:
        self.backend.drop_prefixes(owner, entries)

    def warm_up(self, *args: Any) -> None:
        pass

    def kv_figures(self, tokens: int) -> dict[str, int]:
        return {"kv_tokens": tokens}
