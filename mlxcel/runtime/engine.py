"""The single-process generation role: continuous batching on mlx-lm's BatchGenerator.

It is a bus role like any other. It consumes ``RunEntry`` (start a sequence),
``CancelRequest`` and ``ReleaseSequence`` (drop one and free its caches), and publishes the
generated tokens to the owner of the request: one ``RunResult`` per sequence per run of
decode steps (a run ends at any sequence's first token, so that one is not held back). New
sequences join between decode steps; finished or cancelled ones leave without stalling the
rest; up to ``max_batch_size`` sequences share one batched forward pass.

This is the reactor's side -- the sequence table, admission, cancellation, results. All MLX
work happens in its runtime (:class:`~mlxcel.runtime.engine_runtime.EngineRuntime`) on the
compute thread; the reactor hands it snapshots and reads back what changed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from loguru import logger

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.defaults import MAX_BATCH_SIZE, PREFILL_STEP_SIZE
from mlxcel.base.handoff import Packed
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    ReleaseSequence,
    RunEntry,
    RunResult,
)
from mlxcel.reactor.bus import Envelope, Node
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.engine_runtime import EngineRuntime
from mlxcel.runtime.engine_state import (
    EngineSeq,
    EngineSeqState,
    Insert,
    Sink,
    StepToken,
    by_sequence,
    entry_problem,
    kv_tokens,
)
from mlxcel.runtime.model import LoadedModel


class LocalEngine:
    """The sequence table on the reactor; its runtime steps on the compute thread. Use
    :meth:`attach` to subscribe it to a node's bus."""

    def __init__(
        self,
        loaded: LoadedModel,
        compute: ComputeThread,
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
        self.max_sequences = max_sequences
        self.runtime = runtime or EngineRuntime(
            loaded,
            max_batch_size=max_batch_size,
            prefill_step_size=prefill_step_size,
            prompt_cache_bytes=prompt_cache_bytes,
            max_kv_size=max_kv_size,
        )
        self.eos = loaded.eos_token_ids()
        self._seqs: dict[str, EngineSeq] = {}
        self._by_uid: dict[int, str] = {}
        self._to_remove: list[int] = []
        self._wake = asyncio.Event()
        self._node: Node | None = None
        self.steps = 0
        # None: a step may take as long as it takes (one process cannot wedge itself); a
        # tensor-parallel engine bounds it, since a lost rank can block a collective forever.
        self.step_timeout: float | None = None
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.sequence_failures = 0
        # Set when the engine cannot go on (a step its runtime cannot recover from failed, or
        # abort() was called): every request failed with ``failure``, and nothing more runs.
        self.failed = asyncio.Event()
        self.failure = ""
        # Caches of finished keep-cache sequences, until their owner takes them.
        self.kept: dict[str, tuple[Packed, tuple[int, ...]]] = {}

    # --- introspection (metrics, tests) --------------------------------------------------
    @property
    def active(self) -> int:
        """Sequences that hold (or are about to hold) KV caches."""
        return len(self._seqs)

    def kv_tokens(self) -> int:
        return kv_tokens(self._seqs.values())

    @property
    def decoding_alone(self) -> bool:
        """Whether a request decodes on its own cache now, outside the batch generator."""
        return self.runtime.decoding_alone

    def batch_cache_rows(self) -> int:
        """Sequences holding KV caches on the compute side (batch rows, the one alone)."""
        return self.runtime.batch_cache_rows()

    # --- wiring ---------------------------------------------------------------------------
    async def attach(self, node: Node, *, serve_bus: bool = True) -> None:
        """Start the decode loop on ``node``. With ``serve_bus`` it also takes ``RunEntry``
        and cancels from the bus (a serving node); a disaggregated role calls :meth:`submit`
        itself and must not hear requests from the network."""
        self._node = node
        await self.compute.run(self.runtime.start)
        if serve_bus:
            self._subscribe(node)
        node.spawn(self._loop(), name="engine.loop", critical=True)

    def _subscribe(self, node: Node) -> None:
        node.bus.subscribe(
            RunEntry, self._on_run_entry, maxsize=self.max_sequences, name="engine.run"
        )
        node.bus.subscribe(CancelRequest, self._on_cancel, maxsize=256, name="engine.cancel")
        node.bus.subscribe(ReleaseSequence, self._on_release, maxsize=256, name="engine.release")

    async def _on_run_entry(self, env: Envelope[RunEntry]) -> None:
        e = env.msg
        problem = self.submit(e, env.source)
        if problem is not None:
            await self._reply(Error(ErrorCode.BAD_REQUEST, problem, e.request_id, e.nonce))

    def submit(
        self,
        e: RunEntry,
        source: str,
        *,
        sink: Sink | None = None,
        cache: list[Any] | None = None,
        key_state: tuple[int, ...] = (),
        keep_cache: bool = False,
        context: tuple[int, ...] = (),
    ) -> str | None:
        """Start a sequence; returns why not (None: started). With ``cache`` it resumes after
        the cached tokens (``context``: the last of them, which its penalties see); with
        ``keep_cache`` its packed cache lands in :attr:`kept` before its last result; with
        ``sink`` its results go there instead of onto the bus."""
        problem = entry_problem(e, self.loaded.config)
        if problem is None and e.request_id in self._seqs:
            problem = f"request {e.request_id!r} is already running"
        if problem is None and len(self._seqs) >= self.max_sequences:
            problem = f"the engine holds its maximum of {self.max_sequences} sequences"
        if problem is not None:
            return problem
        self._seqs[e.request_id] = EngineSeq(
            e, source, cache=cache, key_state=key_state, keep_cache=keep_cache, sink=sink,
            context=context, resumed=int(getattr(cache[0], "offset", 0)) if cache else 0,
        )  # fmt: skip
        self.runtime.interrupt.set()
        self._wake.set()
        return None

    def cancel(self, request_id: str, source: str) -> None:
        """Drop a sequence (only its owner may) and free its caches."""
        self._drop(request_id, source)
        self.kept.pop(request_id, None)

    async def _on_cancel(self, env: Envelope[CancelRequest]) -> None:
        self._drop(env.msg.request_id, env.source)

    async def _on_release(self, env: Envelope[ReleaseSequence]) -> None:
        self._drop(env.msg.request_id, env.source)

    def _drop(self, request_id: str, source: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.source != source:
            return  # unknown, finished, or not the owner: changes nothing
        del self._seqs[request_id]
        if seq.uid is not None:
            self._by_uid.pop(seq.uid, None)
            self._to_remove.append(seq.uid)
        self.runtime.interrupt.set()
        self._wake.set()

    async def _reply(self, msg: Any, seq: EngineSeq | None = None) -> None:
        if seq is not None and seq.sink is not None:
            seq.sink(msg)
            return
        assert self._node is not None
        await self._node.bus.publish(msg, deadline=deadline_in(30.0))

    # --- the decode loop --------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not self._seqs and not self._to_remove:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.runtime.interrupt.clear()  # before the snapshot: a later change stops the run
            inserts = [s for s in self._seqs.values() if s.state is EngineSeqState.QUEUED]
            for s in inserts:
                s.state = EngineSeqState.RUNNING
            removals, self._to_remove = self._to_remove, []
            want_lp = {
                r: s.entry.sampling.top_logprobs
                for r, s in self._seqs.items()
                if s.entry.sampling.logprobs
            }
            try:
                async with asyncio.timeout(self.step_timeout):
                    out = await self.compute.run(
                        self.runtime.step,
                        [
                            Insert(s.entry, s.cache, s.key_state, s.keep_cache, s.context)
                            for s in inserts
                        ],
                        removals,
                        dict(self._by_uid),
                        want_lp,
                    )
            except TimeoutError:
                await self._fail_all(f"engine step took longer than {self.step_timeout:g}s")
                continue
            except Exception as exc:
                logger.exception("engine step failed; failing every running sequence")
                await self._fail_all(f"engine step failed: {exc}")
                continue
            for request_id, uid in out.moved.items():  # from decoding alone into the batch
                if (s := self._seqs.get(request_id)) is not None and s.uid is not None:
                    self._by_uid.pop(s.uid, None)
                    s.uid = uid
                    self._by_uid[uid] = request_id
                else:
                    self._to_remove.append(uid)
            for s in inserts:
                s.cache = None  # the batch generator holds it now
                uid = out.new_uids[s.entry.request_id]
                if self._seqs.get(s.entry.request_id) is s:
                    s.uid = uid
                    self._by_uid[uid] = s.entry.request_id
                else:  # dropped while its insert was running: remove it next step
                    self._to_remove.append(uid)
            self.steps += out.steps
            self.prompt_tokens += out.prompt_tokens
            for request_id, n in out.cached.items():
                if (s := self._seqs.get(request_id)) is not None:
                    s.cached = n
            for request_id, why in out.failed.items():
                await self._fail_one(request_id, why)
            for request_id, kept in out.kept.items():
                if request_id in self._seqs:
                    self.kept[request_id] = kept
            for request_id, items in by_sequence(out.tokens).items():
                seq = self._seqs.get(request_id)
                if seq is None:
                    continue  # cancelled while the step ran
                await self._reply(self._result(seq, items), seq)

    def _result(self, seq: EngineSeq, items: list[StepToken]) -> RunResult:
        """One message for what a run produced for ``seq`` (in order; a finish can only be
        the last): fewer hops per token than a message each, the same tokens."""
        first = seq.generated == 0
        seq.generated += len(items)
        finish = items[-1][2]
        if finish is not None:
            self._seqs.pop(seq.entry.request_id, None)
            if seq.uid is not None:
                self._by_uid.pop(seq.uid, None)
        if finish == "stop" and items[-1][1] in self.eos:
            items = items[:-1]  # the end-of-sequence token is not part of the text
        self.tokens_generated += len(items)
        lps = [lp for _, _, _, lp, _ in items if lp is not None]
        tops = [top for _, _, _, _, top in items if top]
        return RunResult(
            seq.entry.request_id,
            seq.entry.micro_batch,
            tuple(token for _, token, _, _, _ in items),
            finish,
            seq.entry.nonce,
            logprobs=tuple(lps) if lps else None,
            top_ids=tuple(i for ids, _ in tops for i in ids) if tops else None,
            top_logprobs=tuple(v for _, vs in tops for v in vs) if tops else None,
            cached_tokens=seq.cached if first else 0,
        )

    async def _fail_one(self, request_id: str, why: str) -> None:
        """One sequence failed inside a step the others completed: end it, keep the rest."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self.sequence_failures += 1
        if seq.uid is not None:
            self._by_uid.pop(seq.uid, None)
            self._to_remove.append(seq.uid)
        logger.warning("engine: request {} failed alone: {}", request_id, why)
        await self._reply(Error(ErrorCode.SAMPLING_FAILED, why, request_id, seq.entry.nonce), seq)

    async def _fail_all(self, why: str) -> None:
        """After a failed step the batch state is suspect: drop it all and start fresh -- or,
        where the runtime cannot recover (a tensor-parallel group), end the engine."""
        if not self.runtime.recoverable:
            await self.abort(why)
            await asyncio.Event().wait()  # nothing more can run: no spinning until the node ends
        seqs, self._seqs = self._seqs, {}
        self._by_uid.clear()
        self._to_remove.clear()
        # On the compute thread, after whatever step may still be running there (a timed-out
        # one): the state it owns is reset by it, never under it.
        await self.compute.run(self.runtime.reset)
        for rid, s in seqs.items():
            await self._reply(Error(ErrorCode.ENGINE_FAILED, why, rid, s.entry.nonce), s)

    async def abort(self, why: str) -> None:
        """The engine cannot go on: fail every request now, without waiting on the compute
        thread (which may be blocked for good, in a collective that will never complete)."""
        if self.failed.is_set():
            return
        code, message = self.runtime.failure(why)
        self.failure = why
        logger.error("{} failed: {}", self.runtime.name, why)
        seqs, self._seqs = self._seqs, {}
        for rid, s in seqs.items():
            await self._reply(Error(code, message, rid, s.entry.nonce), s)
        self.failed.set()
