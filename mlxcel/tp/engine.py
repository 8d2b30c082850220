"""Rank 0's runtime under tensor parallelism: the local runtime, with every step replayed.

Each batch step first sends the other ranks what it is about to do (which sequences join,
which leave), then runs it; the followers (:mod:`mlxcel.tp.follower`) apply the same step to
their own batch, so all ranks execute one identical batched forward per step. Unseeded
sampling gets a seed here, so every rank draws the same token. A failed step means a rank is
gone: the group cannot continue, so it is fatal (``recoverable`` is False: the engine fails
every request and ends).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from mlxcel.base.messages import ErrorCode, TpInsert, TpStep
from mlxcel.runtime.engine_runtime import EngineRuntime
from mlxcel.runtime.engine_state import EngineJob, EngineStep, Insert
from mlxcel.tp.group import broadcast_step
from mlxcel.tp.step_seal import StepSeal

STEP_TIMEOUT = 120.0  # seconds


class TpRuntime(EngineRuntime):
    recoverable = False
    # A lost rank can block a collective forever: a step far longer than any real one
    # (even a long CPU prefill) means the group is wedged.
    step_timeout = STEP_TIMEOUT
    failure_code = ErrorCode.TP_GROUP_FAILED
    failure_prefix = "a tensor-parallel rank failed: "

    def __init__(self, *args: Any, group: Any, seal: StepSeal, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.seal = seal  # tags every step this rank broadcasts
        self.run_steps = 1  # followers replay one batch step per broadcast
        self.solo_enabled = False  # followers replay BatchGenerator steps: no lone decoding

    def step(self, job: EngineJob) -> EngineStep:
        job = dataclasses.replace(job, inserts=tuple(_seeded(i) for i in job.inserts))
        step = TpStep(
            tuple(
                TpInsert(i.entry.request_id, i.entry.token_ids, i.entry.sampling)
                for i in job.inserts
            ),
            tuple(job.removals),
        )
        broadcast_step(self.group, step, self.seal)
        return super().step(job)

    def stop_followers(self) -> None:
        """Tell the other ranks to exit (after the last step)."""
        broadcast_step(self.group, TpStep((), (), stop=True), self.seal)


def _seeded(i: Insert) -> Insert:
    """Every rank must draw the same token: an unseeded sampled request gets a seed all ranks
    share (it travels in the step)."""
    p = i.entry.sampling
    if p.temperature <= 0 or p.seed is not None:
        return i
    sampling = dataclasses.replace(p, seed=secrets.randbits(63))
    return dataclasses.replace(i, entry=dataclasses.replace(i.entry, sampling=sampling))
