"""The prefill and decode nodes' services: their cores, carried out through an engine.

Each runs its model through a :class:`~mlxcel.runtime.engine.LocalEngine` that does not
listen on the bus (requests reach it only through the core).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from mlxcel.base.effects import Effect, FreeCache, StartCompute
from mlxcel.base.handoff import check as check_handoff
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    HandoffAck,
    HandoffVerdict,
    KvHandoff,
    PrefillRequest,
    QueryState,
    RunEntry,
    RunResult,
    SlotAnswer,
    SlotRequest,
)
from mlxcel.disagg.decode_core import DecodeConfig, DecodeCore
from mlxcel.disagg.prefill_core import PrefillConfig, PrefillCore
from mlxcel.disagg.protocol import PrefillJob, ResumeJob, VerifyJob
from mlxcel.disagg.service import DisaggAdapter
from mlxcel.reactor.bus import Node, Origin
from mlxcel.reactor.endpoint import Endpoint
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.kv_usage import figures as kv_figures

# Runs a function off the reactor and off the compute thread: a worker thread.
Offload = Callable[..., Awaitable[Any]]


class PrefillService(DisaggAdapter):
    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        engine: LocalEngine,
        config: PrefillConfig,
        first_lease: int | None = None,
    ) -> None:
        # Unpredictable per process (the simulator draws it from its seed).
        lease = secrets.randbits(40) + 1 if first_lease is None else first_lease
        core = PrefillCore(config, first_lease=lease, counters=lambda: self._figures())
        super().__init__(node, endpoint, core, "prefill")
        self.prefill = core
        self.engine = engine

    def attach(self) -> None:
        self.subscribe(
            [PrefillRequest, HandoffAck, SlotAnswer, CancelRequest, QueryState],
            Origin.REMOTE,
            maxsize=1024,
        )
        self.start()

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute) and isinstance(effect.job, PrefillJob):
            job = effect.job
            rid = f"lease-{job.lease}"
            entry = RunEntry(rid, 0, job.token_ids, 0, job.sampling, 0)
            problem = self.engine.submit(
                entry, "prefill", sink=lambda m: self._done(job.lease, rid, m), keep_cache=True
            )
            if problem is not None:
                self.feed(self.prefill.compute_failed(job.lease, problem, self.now()))
        elif isinstance(effect, FreeCache):
            self.engine.cancel(f"lease-{effect.key}", "prefill")
        else:
            super().apply(effect)

    def _figures(self) -> dict[str, int]:
        held = sum(x.held.prompt_len for x in self.prefill.leases.values() if x.held)
        return _engine_figures(self.engine, held)

    def _done(self, lease: int, rid: str, m: RunResult | Error) -> None:
        if isinstance(m, Error):
            self.feed(self.prefill.compute_failed(lease, m.message, self.now()))
            return
        packed, key = self.engine.kept.pop(rid, (None, ()))
        top = (m.top_ids, m.top_logprobs) if m.top_ids and m.top_logprobs else None
        self.feed(
            self.prefill.compute_done(
                lease, m.token_ids, m.finish_reason, m.logprobs, packed, key, self.now(), top
            )
        )


class DecodeService(DisaggAdapter):
    def __init__(
        self,
        node: Node,
        endpoint: Endpoint,
        engine: LocalEngine,
        config: DecodeConfig,
        *,
        check: Callable[[KvHandoff], str | None] | None = None,
        offload: Offload = asyncio.to_thread,
        load: Callable[[KvHandoff], Any] | None = None,
    ) -> None:
        core = DecodeCore(config, counters=lambda: _engine_figures(self.engine))
        super().__init__(node, endpoint, core, "decode")
        self.decode = core
        self.engine = engine
        # A handoff's problem (its shapes, which the config's dims name, and the SHA-256 over
        # every byte: about a second per GB of cache), found by ``offload`` off the compute
        # thread, which meanwhile keeps stepping the streams it decodes.
        dims = config.dims
        if check is None and dims is None:
            raise ValueError("a decode service checks handoffs by its config's dims")

        def by_dims(h: KvHandoff) -> str | None:
            assert dims is not None
            return check_handoff(h, *dims)

        self.check = check or by_dims
        self.offload = offload
        # A checked handoff as caches, on the compute thread (MLX arrays belong to it). The
        # simulator's model supplies its own check, worker and load.
        self.load = load or _unpack
        self.staged: dict[int, Any] = {}  # slot -> verified caches, not yet read

    def attach(self) -> None:
        self.subscribe(
            [KvHandoff, HandoffVerdict, SlotRequest, CancelRequest, QueryState],
            Origin.REMOTE,
            maxsize=1024,
        )
        self.start()

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute) and isinstance(effect.job, VerifyJob):
            self.node.spawn(self._verify(effect.job), name="decode.verify")
        elif isinstance(effect, StartCompute) and isinstance(effect.job, ResumeJob):
            self._resume(effect.job)
        elif isinstance(effect, FreeCache):
            self.staged.pop(effect.key, None)
            self.engine.cancel(f"slot-{effect.key}", "decode")
        else:
            super().apply(effect)

    async def _verify(self, job: VerifyJob) -> None:
        caches = None
        try:
            problem = await self.offload(self.check, job.handoff)
            if problem is None:
                caches = await self.engine.compute.run(self.load, job.handoff)
        except Exception as exc:  # a malformed tensor the checks missed: refuse, keep serving
            problem, caches = f"could not load the handoff: {exc}", None
        if caches is not None and job.slot in self.decode.slots:
            self.staged[job.slot] = caches
        self.feed(self.decode.verified(job.slot, problem, self.now()))

    def _resume(self, job: ResumeJob) -> None:
        h, slot = job.handoff, job.slot
        caches = self.staged.pop(slot, None)
        rid = f"slot-{slot}"
        problem = "the verified cache is gone" if caches is None else None
        if problem is None:
            entry = RunEntry(rid, 0, (h.first_token,), 0, h.sampling, 0)
            problem = self.engine.submit(
                entry,
                "decode",
                sink=lambda m: self.feed(self.decode.token(slot, m, self.now())),
                cache=caches,
                key_state=h.rng_key,
                context=h.context,
            )
        if problem is not None:
            err = Error(ErrorCode.ENGINE_FAILED, problem, rid)
            self.feed(self.decode.token(slot, err, self.now()))


def _unpack(handoff: KvHandoff) -> Any:
    from mlxcel.runtime.kv_handoff import unpack

    return unpack(handoff)


def _engine_figures(engine: LocalEngine, more_tokens: int = 0) -> dict[str, int]:
    """A prefill or decode node's State figures: its KV cache (plus ``more_tokens`` held
    outside the engine) and its wire bytes."""
    m = engine.loaded
    return kv_figures(engine.kv_tokens() + more_tokens, m.config, m.n_layers)
