"""Rank 0's engine under tensor parallelism: the local engine, with every step replayed.

Each batch step first sends the other ranks what it is about to do (which sequences join,
which leave), then runs it; the followers (:mod:`mlxcel.tp.follower`) apply the same step to
their own batch, so all ranks execute one identical batched forward per step. Unseeded
sampling gets a seed here, so every rank draws the same token. A failed step means a rank is
gone: the group cannot continue, so it is fatal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Any

from loguru import logger

from mlxcel.base.messages import Error, RunEntry, TpInsert, TpStep
from mlxcel.reactor.bus import Envelope
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.engine_state import EngineStep, Insert
from mlxcel.tp.group import broadcast_step
from mlxcel.tp.step_seal import StepSeal

STEP_TIMEOUT = 120.0  # a batch step (even a long CPU prefill) far below this; a wedged group above


class TpEngine(LocalEngine):
    def __init__(self, *args: Any, group: Any, seal: StepSeal, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.seal = seal  # tags every step this rank broadcasts
        self.step_timeout = STEP_TIMEOUT
        self.run_steps = 1  # followers replay one batch step per broadcast
        self.solo_enabled = False  # followers replay BatchGenerator steps: no lone decoding
        self.fatal: asyncio.Event = asyncio.Event()
        self.fatal_reason = ""

    async def _on_run_entry(self, env: Envelope[RunEntry]) -> None:
        e = env.msg
        if e.sampling.temperature > 0 and e.sampling.seed is None:
            # Every rank must draw the same token: give the request a seed all ranks share.
            e = dataclasses.replace(
                e, sampling=dataclasses.replace(e.sampling, seed=secrets.randbits(63))
            )
            env = Envelope(e, env.source)
        await super()._on_run_entry(env)

    def _step(
        self,
        inserts: list[Insert],
        removals: list[int],
        by_uid: dict[int, str],
        want_lp: dict[str, int],
    ) -> EngineStep:
        step = TpStep(
            tuple(
                TpInsert(i.entry.request_id, i.entry.token_ids, i.entry.sampling) for i in inserts
            ),
            tuple(removals),
        )
        broadcast_step(self.group, step, self.seal)
        return super()._step(inserts, removals, by_uid, want_lp)

    def stop_followers(self) -> None:
        """Compute thread: tell the other ranks to exit (after the last step)."""
        broadcast_step(self.group, TpStep((), (), stop=True), self.seal)

    async def abort(self, why: str) -> None:
        """The group is broken: fail every request now, without waiting on the compute thread
        (which may be blocked in a collective that will never complete)."""
        if self.fatal.is_set():
            return
        self.fatal_reason = why
        logger.error("tensor-parallel group failed: {}", why)
        seqs, self._seqs = self._seqs, {}
        for rid, s in seqs.items():
            err = Error(
                "tp_group_failed", f"a tensor-parallel rank failed: {why}", rid, s.entry.nonce
            )
            await self._reply(err)
        self.fatal.set()

    async def _fail_all(self, why: str) -> None:
        await self.abort(why)
        # The group is gone; waiting here keeps the loop from spinning until the node exits.
        await asyncio.Event().wait()
