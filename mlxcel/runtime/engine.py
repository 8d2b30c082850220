"""The single-process generation role: continuous batching on mlx-lm's BatchGenerator.

It is a bus role like any other. It consumes ``RunEntry`` (start a sequence),
``CancelRequest`` and ``ReleaseSequence`` (drop one and free its caches), and publishes the
generated tokens to the owner of the request: one ``RunResult`` per sequence per run of
decode steps (a run ends at any sequence's first token, so that one is not held back). New
sequences join between decode steps; finished or cancelled ones leave without stalling the
rest; up to ``max_batch_size`` sequences share one batched forward pass.

All MLX work happens in :meth:`_step` on the compute thread; the reactor moves messages.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from loguru import logger
from mlx_lm.generate import BatchGenerator

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.defaults import MAX_BATCH_SIZE, PREFILL_STEP_SIZE, STREAM_INTERVAL
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
from mlxcel.runtime.engine_caches import CacheSteps
from mlxcel.runtime.engine_solo import SoloSteps
from mlxcel.runtime.engine_state import (
    EngineSeq,
    EngineSeqState,
    EngineStep,
    Insert,
    Sink,
    StepToken,
    by_sequence,
    entry_problem,
    kv_tokens,
)
from mlxcel.runtime.kv_handoff import pack
from mlxcel.runtime.model import LoadedModel
from mlxcel.runtime.prompt_cache import PromptCache
from mlxcel.runtime.sampling import (
    Sampler,
    guarded_sampler,
    key_after_first,
    logits_processors,
    top_alternatives,
)
from mlxcel.runtime.solo import Solo

# At most this many decode steps (--stream-interval), and about this long, per hand-off.
RUN_STEPS = STREAM_INTERVAL
RUN_SECONDS = 0.025


class LocalEngine(SoloSteps, CacheSteps):
    """Owns the batch generator. Use :meth:`attach` to subscribe it to a node's bus."""

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
    ) -> None:
        self.loaded = loaded
        self.max_kv_size = max_kv_size  # rotating caches, which only the batch generator makes
        self.compute = compute
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.max_sequences = max_sequences
        # Compute thread: caches of finished prompts for later requests sharing their prefix.
        self.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.eos = loaded.eos_token_ids()
        self._seqs: dict[str, EngineSeq] = {}
        self._by_uid: dict[int, str] = {}
        self._to_remove: list[int] = []
        self._wake = asyncio.Event()
        # Set by the reactor when sequences join or leave: ends a run of decode steps early.
        self._interrupt = threading.Event()
        # Compute thread: uids that produced a token (a new one's first token ends a run).
        self._started: set[int] = set()
        self.run_steps = RUN_STEPS
        self.run_seconds = RUN_SECONDS
        # Compute thread: the sequence decoding alone, if any (runtime/solo.py).
        self.solo_enabled = max_kv_size is None
        self._solo: Solo | None = None
        self._solo_uids = 0
        self._gen: BatchGenerator | None = None
        self._node: Node | None = None
        self.steps = 0
        # None: a step may take as long as it takes (one process cannot wedge itself); a
        # tensor-parallel engine bounds it, since a lost rank can block a collective forever.
        self.step_timeout: float | None = None
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.sequence_failures = 0
        # Written by guarded samplers on the compute thread; drained by _step on it too.
        self._sample_failures: dict[str, str] = {}
        # Compute thread: samplers of keep-cache sequences (their key travels with the cache).
        self._kept_samplers: dict[str, tuple[Sampler | None, int]] = {}
        # Reactor: caches of finished keep-cache sequences, until their owner takes them.
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
        return self._solo is not None

    def batch_cache_rows(self) -> int:
        """Sequences holding KV caches on the compute side (batch rows, the one alone)."""
        if (gen := self._gen) is None:
            return 0
        alone = 1 if self._solo is not None else 0
        return (
            len(gen._generation_batch)
            + len(gen._prompt_batch)
            + len(gen._unprocessed_sequences)
            + alone
        )

    # --- wiring ---------------------------------------------------------------------------
    async def attach(self, node: Node, *, serve_bus: bool = True) -> None:
        """Start the decode loop on ``node``. With ``serve_bus`` it also takes ``RunEntry``
        and cancels from the bus (a serving node); a disaggregated role calls :meth:`submit`
        itself and must not hear requests from the network."""
        self._node = node
        self._gen = await self.compute.run(self._make_generator)
        if serve_bus:
            self._subscribe(node)
        node.spawn(self._loop(), name="engine.loop", critical=True)

    def _subscribe(self, node: Node) -> None:
        node.bus.subscribe(
            RunEntry, self._on_run_entry, maxsize=self.max_sequences, name="engine.run"
        )
        node.bus.subscribe(CancelRequest, self._on_cancel, maxsize=256, name="engine.cancel")
        node.bus.subscribe(ReleaseSequence, self._on_release, maxsize=256, name="engine.release")

    def _reset(self) -> BatchGenerator:
        """Compute thread: forget every sequence's state; a fresh batch generator."""
        self._kept_samplers.clear()
        self._started.clear()
        self._solo = None
        if self.prompt_cache is not None:  # its memory may be what the step ran out of
            self.prompt_cache.clear()
        return self._make_generator()

    def _make_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.loaded.model,
            stop_tokens=[[t] for t in sorted(self.eos)],
            completion_batch_size=self.max_batch_size,
            prefill_batch_size=self.max_batch_size,
            prefill_step_size=self.prefill_step_size,
            max_kv_size=self.max_kv_size,
        )

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
        self._interrupt.set()
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
        self._interrupt.set()
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
            self._interrupt.clear()  # before the snapshot: a later change stops the run
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
                        self._step,
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

    def _step(
        self,
        inserts: list[Insert],
        removals: list[int],
        by_uid: dict[int, str],
        want_lp: dict[str, int],
    ) -> EngineStep:
        """Compute thread: apply joins and leaves, then run a run of steps (batched, or the
        sequence decoding alone).

        Touches no reactor-owned state: it gets snapshots and returns what changed.
        """
        gen = self._gen
        assert gen is not None
        out = EngineStep()
        if removals:
            # What a cancelled sequence computed still serves a later prompt: a client that
            # stops at a stop string (the frontend cancels it) or retries after leaving.
            # (Stored before the sequence lets go: the reactor sees it held until then.)
            if (solo := self._solo) is not None and solo.uid in removals:
                self._keep_prompt(solo.fed, solo.cache)
                self._solo = None
            if self.prompt_cache is not None:  # those decoding; a prompt batch is padded
                self._keep_removed([u for u in removals if u in gen._generation_batch.uids])
            gen.remove(removals)
            self._started.difference_update(removals)
        running = set(by_uid.values())
        for rid in [r for r in self._kept_samplers if r not in running]:
            self._kept_samplers.pop(rid)  # removed before it finished
        if inserts and self._solo is not None:  # a second sequence: the first joins the batch
            self._hand_over(self._solo, by_uid, want_lp, out)
        if inserts and self._may_solo(inserts):
            self._start_solo(inserts[0], out)
        elif inserts:
            samplers = [self._guarded(i.entry, i.key_state) for i in inserts]
            caches, seen, prompts = [], [], []
            for i in inserts:
                cache, n = self._start(i)
                caches.append(cache)
                # A cached prefix (or a handed-off cache's context) is what penalties see.
                seen.append([*i.context, *i.entry.token_ids[:n]])
                prompts.append(list(i.entry.token_ids[n:]))
            tok = self.loaded.tokenizer
            uids = gen.insert(
                prompts,
                max_tokens=[i.entry.sampling.max_tokens for i in inserts],
                caches=caches,
                all_tokens=seen,
                samplers=samplers,
                logits_processors=[
                    logits_processors(i.entry.sampling, self.eos, tok) for i in inserts
                ],
            )
            for i, uid, sampler, cached in zip(inserts, uids, samplers, seen, strict=True):
                rid = i.entry.request_id
                by_uid[uid] = rid
                out.new_uids[rid] = uid
                out.prompt_tokens += len(i.entry.token_ids)
                if cached:
                    out.cached[rid] = len(cached)
                if i.keep_cache:
                    self._kept_samplers[rid] = (sampler, len(i.entry.token_ids))
        # Steps run back to back while nothing changes: the reactor wakes once per run, not
        # per token. A run ends at a new sequence's first token, a finish, a step with
        # nothing to do, a sampler failure, the reactor asking (a request came or left),
        # run_seconds, or about run_steps tokens: its tokens are delivered together, and
        # longer bursts kept the reactor on the GIL while the compute thread waited (8
        # streams in 16-step runs lost 20% on an H200). A big batch amortizes the hand-off.
        until = time.perf_counter() + self.run_seconds
        for _ in range(max(1, self.run_steps // max(1, self.batch_cache_rows()))):
            out.steps += 1
            if self._solo is not None:
                news, busy = self._solo_step(self._solo, want_lp, out), True
            else:
                prompt_responses, responses = gen.next()
                news = self._collect(responses, by_uid, want_lp, out)
                busy = bool(responses or prompt_responses)
            if (
                news
                or not busy
                or self._sample_failures
                or self._interrupt.is_set()
                or time.perf_counter() >= until
            ):
                break
        out.failed.update(self._sample_failures)  # the guards keep this dict: clear, never swap
        self._sample_failures.clear()
        return out

    def _collect(
        self,
        responses: list[Any],
        by_uid: dict[int, str],
        want_lp: dict[str, int],
        out: EngineStep,
    ) -> bool:
        """Compute thread: one step's tokens into ``out``; True when a sequence produced its
        first token or finished."""
        news = False
        for r in responses:
            if r.uid not in self._started:
                self._started.add(r.uid)
                news = True
            if r.finish_reason is not None:
                self._started.discard(r.uid)
                news = True
            request_id = by_uid.get(r.uid)
            if request_id is None:
                continue
            self._record(request_id, int(r.token), r.finish_reason, r.logprobs, want_lp, out)
            if r.finish_reason is not None and request_id not in self._kept_samplers:
                self._keep_prompt(r.all_tokens, r.prompt_cache)
            if r.finish_reason is not None and request_id in self._kept_samplers:
                sampler, prompt_len = self._kept_samplers.pop(request_id)
                try:
                    packed = pack(r.prompt_cache or [], prompt_len, int(r.token))
                except Exception as exc:  # this sequence fails alone, the batch goes on
                    out.failed[request_id] = f"could not pack the KV cache: {exc}"
                    continue
                out.kept[request_id] = (packed, key_after_first(sampler))
        return news

    def _record(
        self,
        request_id: str,
        token: int,
        finish: str | None,
        logprobs: Any,
        want_lp: dict[str, int],
        out: EngineStep,
    ) -> None:
        lp = top = None
        if request_id in want_lp:
            lp = float(logprobs[token].item())
            if want_lp[request_id]:
                top = top_alternatives(logprobs, want_lp[request_id])
        out.tokens.append((request_id, token, finish, lp, top))

    def _guarded(self, e: RunEntry, key: tuple[int, ...] = ()) -> Sampler | None:
        """Compute thread: this request's sampler, failing alone (None: the shared greedy path)."""
        return guarded_sampler(e.sampling, self._sample_failures, e.request_id, key)

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
        """After a failed step the batch state is suspect: drop it all and start fresh."""
        seqs, self._seqs = self._seqs, {}
        self._by_uid.clear()
        self._to_remove.clear()
        self._sample_failures.clear()
        # On the compute thread, after whatever step may still be running there (a timed-out
        # one): the state it owns is reset by it, never under it.
        self._gen = await self.compute.run(self._reset)
        for rid, s in seqs.items():
            await self._reply(Error(ErrorCode.ENGINE_FAILED, why, rid, s.entry.nonce), s)
