"""A pipeline stage node: the stage protocol core on the bus, its layer range on the compute
thread.

:class:`StageService` is a thin adapter. The protocol -- who may send what, per-sequence
state, batching, leases, drain -- is :class:`~mlxcel.pipeline.stage_core.StageCore`'s; the
MLX work is :class:`~mlxcel.pipeline.stage_runtime.StageRuntime`'s, always on the one compute
thread (MLX streams belong to the thread that made them). This module only moves messages,
jobs and results between them.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from loguru import logger

from mlxcel.base.effects import (
    DropPrefixes,
    Effect,
    FreeCache,
    KeepPrefix,
    LoadPrefix,
    StartCompute,
    Stopped,
)
from mlxcel.base.messages import Bundle, Undecodable
from mlxcel.pipeline.stage_core import StageCore
from mlxcel.pipeline.stage_protocol import (
    MAY_SEND,
    ComputeJob,
    Seq,
    StageConfig,
    StageState,
    StageStats,
    StepOutput,
)
from mlxcel.pipeline.stage_runtime import StageRuntime
from mlxcel.reactor.adapter import CoreAdapter
from mlxcel.reactor.bus import Node, Origin
from mlxcel.reactor.endpoint import Endpoint
from mlxcel.runtime.compute import Compute, ComputeThread, call_back

__all__ = ["StageConfig", "StageService", "StageState"]

SLOW_FORWARD_S = 1.0  # a forward pass longer than this is logged


class StageService(CoreAdapter):
    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        runtime: StageRuntime,
        compute: Compute | ComputeThread,
        config: StageConfig,
    ) -> None:
        self.layers = layers = runtime.layers
        self.runtime = runtime
        core = StageCore(
            config,
            width=runtime.width,
            vocab=runtime.vocab,
            layers=(layers.start, layers.end),
            counters=lambda: {
                "wire_bytes_out": endpoint.wire_bytes,
                **runtime.timing.fields(),
                "model": config.model,
                "weights": config.weights,
                **runtime.kv_figures(sum(s.tokens for s in self.stage.seqs.values())),
            },
        )
        super().__init__(node, endpoint, core, f"stage{config.index}", config.reply_deadline)
        self.stage = core
        self.compute = compute
        self.config = config
        self.stopped = asyncio.Event()

    # What tests, /health and the CLI read.
    @property
    def seqs(self) -> dict[str, Seq]:
        return self.stage.seqs

    @property
    def stats(self) -> StageStats:
        return self.stage.stats

    @property
    def state(self) -> StageState:
        return self.stage.state

    def attach(self) -> None:
        self.subscribe([*MAY_SEND, Undecodable, Bundle], Origin.REMOTE, maxsize=256)
        self.bundles = True
        self.start()

    async def warm_up(self) -> float:
        """Serve throwaway sequences (a full prompt chunk, short prompts, decode batches up to
        ``max_batch`` rows) before serving; returns the seconds."""
        t0 = self.now()
        await self.compute.run(
            self.runtime.warm_up,
            self.config.warm_up_tokens,
            self.stage.is_first,
            self.stage.is_last,
            self.config.max_batch,
        )
        took = self.now() - t0
        logger.info("stage {}: warmed up in {:.2f}s", self.config.index, took)
        return took

    def request_shutdown(self) -> None:
        """Drain, then stop once the last sequence is released (``stopped`` is set)."""
        self.feed(self.stage.shutdown(self.now()))

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute):
            # Submitted now: the compute thread starts while the reactor still sends the
            # previous job's outputs (ordered with frees); its end comes back as a callback.
            job, loop = effect.job, self.loop
            fut = self.compute.submit(self.runtime.run, job)
            fut.add_done_callback(lambda f: call_back(loop, self._job_ended, job, f))
        elif isinstance(effect, FreeCache):
            # Queued behind any job still using the cache: the compute thread runs in order.
            self.compute.submit(self.runtime.free, effect.key)
        elif isinstance(effect, LoadPrefix):  # before the sequence's first step, in order
            e = effect
            self.compute.submit(self.runtime.load_prefix, e.key, e.owner, e.entry, e.tokens)
        elif isinstance(effect, KeepPrefix):  # before the FreeCache that follows it
            e, loop = effect, self.loop
            fut = self.compute.submit(self.runtime.keep_prefix, e.key, e.owner, e.entry, e.tokens)
            fut.add_done_callback(lambda f: call_back(loop, self._kept, e, f))
        elif isinstance(effect, DropPrefixes):
            self.compute.submit(self.runtime.drop_prefixes, effect.owner, effect.entries)
        elif isinstance(effect, Stopped):
            self.stopped.set()
        else:
            super().apply(effect)

    def _kept(self, e: KeepPrefix, done: Future[str | None]) -> None:
        """A refused keep is no error (the entry answers "not cached" when asked for), but
        the operator should know the budgets disagree."""
        if done.cancelled():
            return
        exc = done.exception()
        why = f"{type(exc).__name__}: {exc}" if exc is not None else done.result()
        if why is not None and self.running:
            text = f"stage {self.config.index}: prompt-cache entry {e.entry} not kept: {why}"
            self.limiter.warn("prefix-mismatch", text)

    def _job_ended(self, job: ComputeJob, done: Future[tuple[list[StepOutput], float]]) -> None:
        if not self.running or done.cancelled():  # the node closed meanwhile
            return
        try:
            outputs, took = done.result()
        except Exception as exc:  # an execution failure is reported like a bad activation
            logger.exception("stage {}: forward failed", self.config.index)
            self.feed(self.stage.compute_failed(job.id, str(exc), self.now()))
            return
        if took > SLOW_FORWARD_S:  # what an operator sees of kernels compiling, or an overload
            rows, tokens = len(job.steps), sum(s.n for s in job.steps)
            logger.info(
                "stage {}: a forward of {} sequence(s), {} token(s) took {:.1f}s",
                self.config.index,
                rows,
                tokens,
                took,
            )
        self.feed(self.stage.compute_done(job.id, outputs, took, self.now()))
