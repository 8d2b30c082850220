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
import time
from typing import Any

from loguru import logger

from mlxcel.base.messages import ErrorCode, TpInsert, TpStep
from mlxcel.runtime.engine_runtime import EngineRuntime
from mlxcel.runtime.engine_state import EngineJob, EngineStep, Insert
from mlxcel.tp.group import agree, broadcast_step
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
        self._starts: dict[str, tuple[list[Any] | None, int]] = {}  # this step's, by request
        self.prefix_mismatches = 0
        self._quiet_until = 0.0

    def step(self, job: EngineJob) -> EngineStep:
        job = dataclasses.replace(job, inserts=tuple(_seeded(i) for i in job.inserts))
        # The prompt cache is looked up here, before the step goes out: rank 0 decides which
        # prefix each sequence starts from, and every rank starts from its own shard of it.
        starts = {i.entry.request_id: EngineRuntime._start(self, i) for i in job.inserts}
        step = TpStep(
            tuple(
                TpInsert(
                    i.entry.request_id,
                    i.entry.token_ids,
                    i.entry.sampling,
                    starts[i.entry.request_id][1],
                    i.entry.cache_ns,
                )
                for i in job.inserts
            ),
            tuple(job.removals),
        )
        broadcast_step(self.group, step, self.seal)
        cached = [rid for rid, (_, n) in starts.items() if n]
        if cached:  # every rank holds the entry, or every rank prefills it in full
            for rid, ok in zip(cached, agree(self.group, [True] * len(cached)), strict=True):
                if not ok:
                    starts[rid] = (None, 0)
                    self._mismatch(rid)
        self._starts = starts
        return super().step(job)

    def _start(self, i: Insert) -> tuple[list[Any] | None, int]:
        return self._starts.pop(i.entry.request_id)

    def _mismatch(self, request_id: str) -> None:
        self.prefix_mismatches += 1
        now = time.monotonic()
        if now >= self._quiet_until:  # once a minute at most: a diverged cache says it often
            self._quiet_until = now + 60.0
            logger.warning(
                "tensor parallel: a rank lacks the cached prefix rank 0 chose for {} ({} "
                "such in all): every rank prefills it in full",
                request_id,
                self.prefix_mismatches,
            )

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
