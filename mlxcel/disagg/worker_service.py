"""The prefill and decode nodes' services: their cores, carried out through an engine.

Each node runs its model through a :class:`~mlxcel.runtime.engine.LocalEngine` on the same
bus, which hears only this process: the service hands it ``PrefillEntry`` (a prompt whose KV
cache is kept), ``ResumeSequence`` (decode after a handed-off cache), ``ContinueEntry`` (a
conversation's next turn from the decode node's own cache) and ``ReleaseSequence``, and takes
back its ``CacheKept``, ``RunResult`` and ``Error``. The engine
knows each by the request's one id, the router's; the lease or slot rides in the entry's
nonce, and comes back in every answer.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from mlxcel.base.effects import Effect, FreeCache, StartCompute
from mlxcel.base.handoff import check as check_handoff
from mlxcel.base.messages import (
    CacheKept,
    CancelRequest,
    ContinueEntry,
    Error,
    HandoffAck,
    HandoffVerdict,
    KvHandoff,
    PrefillEntry,
    PrefillRequest,
    QueryState,
    ReleaseSequence,
    ResumeSequence,
    RunEntry,
    RunResult,
    SlotAnswer,
    SlotRequest,
)
from mlxcel.disagg.decode_core import DecodeConfig, DecodeCore
from mlxcel.disagg.prefill_core import PrefillConfig, PrefillCore
from mlxcel.disagg.protocol import (
    ContinueJob,
    PrefillJob,
    ResumeJob,
    VerifyJob,
    decode_namespace,
)
from mlxcel.disagg.service import DisaggAdapter
from mlxcel.reactor.adapter import LocalOutbox
from mlxcel.reactor.bus import Envelope, Node, Origin
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
        self._to_engine = LocalOutbox(node, "prefill.engine")

    def attach(self) -> None:
        self.subscribe(
            [PrefillRequest, HandoffAck, SlotAnswer, CancelRequest, QueryState],
            Origin.REMOTE,
            maxsize=1024,
        )
        self._to_engine.start()
        self.node.bus.subscribe(
            (CacheKept, RunResult, Error),
            self._from_engine,
            maxsize=1024,
            name="prefill.from-engine",
            origin=Origin.LOCAL,
            sync=True,
        )
        self.start()

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute) and isinstance(effect.job, PrefillJob):
            job = effect.job
            # The lease rides in the nonce: the engine's answer names it back.
            entry = RunEntry(
                job.request_id, 0, job.token_ids, 0, job.sampling, job.lease, cache_ns=job.cache_ns
            )
            self._to_engine.put(PrefillEntry(entry))
        elif isinstance(effect, FreeCache):
            self._to_engine.put(ReleaseSequence(effect.key))
        else:
            super().apply(effect)

    def _figures(self) -> dict[str, int]:
        held = sum(x.held.prompt_len for x in self.prefill.leases.values() if x.held)
        return _engine_figures(self.engine, held)

    def _from_engine(self, env: Envelope[CacheKept | RunResult | Error]) -> None:
        """The engine's answer for a lease's prompt: its first token and KV cache, or why
        not."""
        m, now = env.msg, self.now()
        r = m.result if isinstance(m, CacheKept) else m
        lease = r.nonce or 0
        x = self.prefill.leases.get(lease)
        if x is None or x.request.request_id != r.request_id:
            return  # its lease ended as it ran (and released it)
        if isinstance(m, Error):
            self.feed(self.prefill.compute_failed(lease, m.message, now))
            return
        packed, key = (m.cache, m.key_state) if isinstance(m, CacheKept) else (None, ())
        top = (r.top_ids, r.top_logprobs) if r.top_ids and r.top_logprobs else None
        self.feed(
            self.prefill.compute_done(
                lease,
                r.token_ids,
                r.finish_reason,
                r.logprobs,
                packed,
                key,
                now,
                top,
                r.cached_tokens,
                r.kept,
            )  # fmt: skip
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
        self._to_engine = LocalOutbox(node, "decode.engine")

    def attach(self) -> None:
        self.subscribe(
            [KvHandoff, HandoffVerdict, SlotRequest, PrefillRequest, CancelRequest, QueryState],
            Origin.REMOTE,
            maxsize=1024,
        )
        self._to_engine.start()
        self.node.bus.subscribe(
            (RunResult, Error),
            self._from_engine,
            maxsize=1024,
            name="decode.from-engine",
            origin=Origin.LOCAL,
            sync=True,
        )
        self.start()

    def apply(self, effect: Effect) -> None:
        if isinstance(effect, StartCompute) and isinstance(effect.job, VerifyJob):
            self.node.spawn(self._verify(effect.job), name="decode.verify")
        elif isinstance(effect, StartCompute) and isinstance(effect.job, ResumeJob):
            self.resume(effect.job)
        elif isinstance(effect, StartCompute) and isinstance(effect.job, ContinueJob):
            j = effect.job  # the slot rides in the nonce, as for a resumed handoff
            entry = RunEntry(
                j.request_id, 0, j.token_ids, 0, j.sampling, j.slot, cache_ns=j.cache_ns
            )
            self._to_engine.put(ContinueEntry(entry, j.min_cached))
        elif isinstance(effect, FreeCache):
            self._to_engine.put(ReleaseSequence(effect.key))
        else:
            super().apply(effect)

    async def _verify(self, job: VerifyJob) -> None:
        cache = None
        try:
            problem = await self.offload(self.check, job.handoff)
            if problem is None:
                cache = await self.engine.compute.run(self.load, job.handoff)
        except Exception as exc:  # a malformed tensor the checks missed: refuse, keep serving
            problem, cache = f"could not load the handoff: {exc}", None
        self.feed(self.decode.verified(job.slot, problem, self.now(), cache))

    def resume(self, job: ResumeJob) -> None:
        """Hand a committed slot's loaded cache to the engine: it decodes from there."""
        h = job.handoff
        # The request's own id; the slot rides in the nonce, and the engine names it back. The
        # namespace is where the engine keeps the conversation when it ends.
        ns = decode_namespace(h.router, h.cache_ns)
        entry = RunEntry(h.request_id, 0, (h.first_token,), 0, h.sampling, job.slot, cache_ns=ns)
        self._to_engine.put(ResumeSequence(entry, job.cache, h.prompt_len, h.rng_key, h.context))

    def _from_engine(self, env: Envelope[RunResult | Error]) -> None:
        m = env.msg
        s = self.decode.slots.get(m.nonce or 0)
        if s is not None and s.handoff.request_id == m.request_id:
            self.feed(self.decode.token(s.id, m, self.now()))


def _unpack(handoff: KvHandoff) -> Any:
    from mlxcel.runtime.kv_handoff import unpack

    return unpack(handoff)


def _engine_figures(engine: LocalEngine, more_tokens: int = 0) -> dict[str, int]:
    """A prefill or decode node's State figures: its KV cache (plus ``more_tokens`` held
    outside the engine) and its wire bytes."""
    m = engine.loaded
    return kv_figures(engine.kv_tokens() + more_tokens, m.config, m.n_layers)
