"""The single-process generation role: continuous batching on mlx-lm's BatchGenerator.

It is a bus role like any other, built as the others are: a pure core
(:class:`~mlxcel.runtime.engine_core.EngineCore`: the sequence table, admission, step
scheduling, cancellation, results), carried out by the shared effect runner
(:class:`~mlxcel.reactor.adapter.CoreAdapter`), with its MLX work in a runtime on the compute
thread (:class:`~mlxcel.runtime.engine_runtime.EngineRuntime`; tensor parallelism's rank 0
runs :class:`~mlxcel.tp.engine.TpRuntime`).

It hears only this process (``Origin.LOCAL``): ``RunEntry`` from a frontend, and from a
disaggregated node's service ``PrefillEntry``/``ResumeSequence``; ``CancelRequest`` and
``ReleaseSequence`` from either. What it delivers (``RunResult``, ``CacheKept``, ``Error``)
goes back onto the bus, to whoever subscribed: the frontend, or that service. New sequences
join between decode steps; finished or cancelled ones leave without stalling the rest; up to
``max_batch_size`` sequences share one batched forward pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from loguru import logger

from mlxcel.base.defaults import MAX_BATCH_SIZE, PREFILL_STEP_SIZE
from mlxcel.base.effects import CutShort, Deliver, Effect, StartCompute, Stopped
from mlxcel.base.messages import (
    CancelRequest,
    ContinueEntry,
    PrefillEntry,
    ReleaseSequence,
    ResumeSequence,
    RunEntry,
)
from mlxcel.reactor.adapter import CoreAdapter, LocalOutbox
from mlxcel.reactor.bus import Node, Origin
from mlxcel.reactor.endpoint import NoNetwork
from mlxcel.runtime.compute import Compute, ComputeThread, call_back
from mlxcel.runtime.engine_core import EngineCore
from mlxcel.runtime.engine_runtime import EngineRuntime
from mlxcel.runtime.engine_state import EngineJob, EngineStep, ResetJob
from mlxcel.runtime.model import LoadedModel

INBOX = 1024  # entries and cancels waiting for the core (it takes each as it comes)


class LocalEngine(CoreAdapter):
    """Build it on a running node, then :meth:`attach` it."""

    def __init__(
        self,
        node: Node,
        loaded: LoadedModel,
        compute: Compute | ComputeThread,
        *,
        max_batch_size: int = MAX_BATCH_SIZE,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        max_sequences: int = 64,
        prompt_cache_bytes: int = 0,
        max_kv_size: int | None = None,
        runtime: EngineRuntime | None = None,
    ) -> None:
        self.loaded = loaded
        self.compute = compute
        self.runtime = rt = runtime or EngineRuntime(
            loaded,
            max_batch_size=max_batch_size,
            prefill_step_size=prefill_step_size,
            prompt_cache_bytes=prompt_cache_bytes,
            max_kv_size=max_kv_size,
        )
        core = EngineCore(
            loaded.config,
            loaded.eos_token_ids(),
            max_sequences=max_sequences,
            step_timeout=rt.step_timeout,
            recoverable=rt.recoverable,
            failure_code=rt.failure_code,
            failure_prefix=rt.failure_prefix,
        )
        super().__init__(node, NoNetwork(), core, "engine", send_budget=30.0)
        self.table = core  # the core: its sequence table and what it decides
        self._local = LocalOutbox(node, "engine")
        # Set once the engine cannot go on (see EngineCore): its node should end.
        self.failed = asyncio.Event()

    async def attach(self) -> None:
        """Make the runtime's state on the compute thread, then take messages."""
        await self.compute.run(self.runtime.start)
        classes = [
            RunEntry, PrefillEntry, ResumeSequence, ContinueEntry, CancelRequest, ReleaseSequence,
        ]  # fmt: skip
        self.subscribe(classes, Origin.LOCAL, maxsize=INBOX)
        self._local.start()
        self.start()

    def abort(self, why: str) -> None:
        """End the engine now (a tensor-parallel rank is gone), without waiting for a step
        that may be blocked in a collective forever."""
        self.feed(self.table.abort(why))

    # --- what metrics, health and tests read ----------------------------------------------------
    @property
    def active(self) -> int:
        return self.table.active

    def kv_tokens(self) -> int:
        return self.table.kv_tokens()

    @property
    def failure(self) -> str:
        return self.table.failure or ""

    @property
    def steps(self) -> int:
        return self.table.steps

    @property
    def tokens_generated(self) -> int:
        return self.table.tokens_generated

    @property
    def prompt_tokens(self) -> int:
        return self.table.prompt_tokens

    @property
    def sequence_failures(self) -> int:
        return self.table.sequence_failures

    @property
    def decoding_alone(self) -> bool:
        """Whether a request decodes on its own cache now, outside the batch generator."""
        return self.runtime.decoding_alone

    def batch_cache_rows(self) -> int:
        """Sequences holding KV caches on the compute side (batch rows, the one alone)."""
        return self.runtime.batch_cache_rows()

    # --- effects --------------------------------------------------------------------------------
    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute) and isinstance(effect.job, EngineJob):
            self.runtime.interrupt.clear()  # before the job starts: a later change cuts it
            self._submit(effect.job, self.runtime.step, effect.job)
        elif isinstance(effect, StartCompute) and isinstance(effect.job, ResetJob):
            self._submit(effect.job, self.runtime.reset)
        elif isinstance(effect, CutShort):
            self.runtime.interrupt.set()
        elif isinstance(effect, Deliver):
            self._local.put(effect.msg)
        elif isinstance(effect, Stopped):
            self.failed.set()
        else:
            super().apply(effect)

    def _submit(self, job: EngineJob | ResetJob, fn: Callable[..., Any], *args: Any) -> None:
        """Queued now, in order with what the compute thread already has; its end comes
        back as a callback on the loop."""
        loop = self.loop
        fut = self.compute.submit(fn, *args)
        fut.add_done_callback(lambda f: call_back(loop, self._job_ended, job, f))

    def _job_ended(self, job: EngineJob | ResetJob, done: Future[EngineStep | None]) -> None:
        if not self.running or done.cancelled():  # the node closed meanwhile
            return
        try:
            out = done.result()
        except Exception as exc:
            logger.opt(exception=exc).error("engine: a compute job failed")
            self.feed(self.table.compute_failed(job.id, str(exc), self.now()))
            return
        self.feed(self.table.compute_done(job.id, out or EngineStep(), self.now()))
