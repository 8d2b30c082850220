"""The engine's compute side: mlx-lm's BatchGenerator, the sequence decoding alone, the prompt
cache, and one step -- joins and leaves applied, then a run of decode steps.

:class:`EngineRuntime` owns everything that lives on the compute thread, and only that. The
engine's core (:mod:`mlxcel.runtime.engine_core`: the sequence table, admission, results)
hands it jobs -- snapshots of what to do -- through :meth:`EngineRuntime.step`, and reads back
what changed. A tensor-parallel rank 0 runs :class:`~mlxcel.tp.engine.TpRuntime`, which
replays each step on the other ranks first.

A lone plain request on an idle engine decodes on its own cache, as mlx-lm's
``generate_step`` does (:mod:`mlxcel.runtime.solo`), and is handed to the batch generator,
unchanged, when another arrives. A finished or cancelled sequence's cache is kept for later
prompts that start alike (:mod:`mlxcel.runtime.prompt_cache`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from loguru import logger
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.base.defaults import MAX_BATCH_SIZE, PREFILL_STEP_SIZE, STREAM_INTERVAL
from mlxcel.base.messages import ErrorCode, RunEntry
from mlxcel.runtime.engine_state import EngineJob, EngineStep, Insert
from mlxcel.runtime.kv_handoff import pack
from mlxcel.runtime.model import LoadedModel
from mlxcel.runtime.prompt_cache import PromptCache, covers
from mlxcel.runtime.sampling import (
    Sampler,
    guarded_sampler,
    key_after_first,
    logits_processors,
    needs_processors,
    top_alternatives,
)
from mlxcel.runtime.solo import Solo

# At most this many decode steps (--stream-interval), and about this long, per hand-off.
RUN_STEPS = STREAM_INTERVAL
RUN_SECONDS = 0.025


class EngineRuntime:
    """Compute thread only (but :attr:`interrupt`, which the reactor sets)."""

    # What the engine's core does when a step fails (see EngineCore): a one-process runtime
    # is reset and goes on; a tensor-parallel one (a rank is gone) cannot. ``step_timeout``
    # None: a step may take as long as it takes.
    recoverable = True
    step_timeout: float | None = None
    failure_code: str = ErrorCode.ENGINE_FAILED
    failure_prefix = ""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_size: int = MAX_BATCH_SIZE,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        prompt_cache_bytes: int = 0,
        max_kv_size: int | None = None,
    ) -> None:
        self.loaded = loaded
        self.eos = loaded.eos_token_ids()
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.max_kv_size = max_kv_size  # rotating caches, which only the batch generator makes
        # Caches of finished prompts for later requests sharing their prefix.
        self.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.run_steps = RUN_STEPS
        self.run_seconds = RUN_SECONDS
        # Set by the reactor when sequences join or leave: ends a run of decode steps early.
        self.interrupt = threading.Event()
        self.solo_enabled = max_kv_size is None
        self.gen: BatchGenerator | None = None
        self._solo: Solo | None = None
        self._solo_uids = 0
        # uids that produced a token (a new one's first token ends a run).
        self._started: set[int] = set()
        # Written by guarded samplers; drained by step().
        self._sample_failures: dict[str, str] = {}
        # Samplers of keep-cache sequences (their key travels with the cache).
        self._kept_samplers: dict[str, tuple[Sampler | None, int]] = {}
        # Each running sequence's prompt-cache namespace, by uid: what it is kept under.
        self._namespace: dict[int, str] = {}

    def start(self) -> None:
        """The batch generator, made on the compute thread (its arrays belong to it)."""
        self.gen = self._make_generator()

    def reset(self) -> None:
        """Forget every sequence's state after a failed step; a fresh batch generator."""
        self._kept_samplers.clear()
        self._namespace.clear()
        self._started.clear()
        self._sample_failures.clear()
        self._solo = None
        if self.prompt_cache is not None:  # its memory may be what the step ran out of
            self.prompt_cache.clear()
        self.gen = self._make_generator()

    def _make_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.loaded.model,
            stop_tokens=[[t] for t in sorted(self.eos)],
            completion_batch_size=self.max_batch_size,
            prefill_batch_size=self.max_batch_size,
            prefill_step_size=self.prefill_step_size,
            max_kv_size=self.max_kv_size,
        )

    # --- what the reactor reads (plain reads of the compute side's state) -----------------
    @property
    def decoding_alone(self) -> bool:
        """Whether a request decodes on its own cache now, outside the batch generator."""
        return self._solo is not None

    def batch_cache_rows(self) -> int:
        """Sequences holding KV caches on the compute side (batch rows, the one alone)."""
        if (gen := self.gen) is None:
            return 0
        alone = 1 if self._solo is not None else 0
        return (
            len(gen._generation_batch)
            + len(gen._prompt_batch)
            + len(gen._unprocessed_sequences)
            + alone
        )

    # --- a step -------------------------------------------------------------------------------
    def step(self, job: EngineJob) -> EngineStep:
        """Apply joins and leaves, then run a run of steps (batched, or the sequence decoding
        alone). Touches no reactor-owned state: it gets snapshots and returns what changed."""
        inserts, removals, want_lp = list(job.inserts), list(job.removals), job.want_lp
        by_uid = dict(job.by_uid)  # this step's own view: joins are added to it
        gen = self.gen
        assert gen is not None
        out = EngineStep()
        if removals:
            # What a cancelled sequence computed still serves a later prompt: a client that
            # stops at a stop string (the frontend cancels it) or retries after leaving.
            # (Stored before the sequence lets go: the reactor sees it held until then.)
            if (solo := self._solo) is not None and solo.uid in removals:
                self._keep_prompt(solo.uid, solo.fed, solo.cache, out)
                self._solo = None
            if self.prompt_cache is not None:  # those decoding; a prompt batch is padded
                self._keep_removed([u for u in removals if u in gen._generation_batch.uids])
            for uid in removals:
                self._namespace.pop(uid, None)
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
            self._insert(gen, inserts, by_uid, out)
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
                or self.interrupt.is_set()
                or time.perf_counter() >= until
            ):
                break
        out.failed.update(self._sample_failures)  # the guards keep this dict: clear, never swap
        self._sample_failures.clear()
        return out

    def _insert(
        self, gen: BatchGenerator, inserts: list[Insert], by_uid: dict[int, str], out: EngineStep
    ) -> None:
        starts = [(i, *self._start(i)) for i in inserts]
        for i, _, n in starts:
            if n < i.min_cached:  # a continuation its cache no longer holds: never started
                out.uncached[i.entry.request_id] = n
        starts = [(i, cache, n) for i, cache, n in starts if n >= i.min_cached]
        if not starts:
            return
        inserts = [i for i, _, _ in starts]
        samplers = [self._guarded(i.entry, i.key_state) for i in inserts]
        caches, seen, prompts = [], [], []
        for i, cache, n in starts:
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
            logits_processors=[logits_processors(i.entry.sampling, self.eos, tok) for i in inserts],
        )
        for i, uid, sampler, cached in zip(inserts, uids, samplers, seen, strict=True):
            rid = i.entry.request_id
            by_uid[uid] = rid
            out.new_uids[rid] = uid
            out.prompt_tokens += len(i.entry.token_ids)
            if cached:
                out.cached[rid] = len(cached)
            self._namespace[uid] = i.entry.cache_ns
            if i.keep_cache:
                self._kept_samplers[rid] = (sampler, len(i.entry.token_ids))

    def _collect(
        self,
        responses: list[Any],
        by_uid: dict[int, str],
        want_lp: dict[str, int],
        out: EngineStep,
    ) -> bool:
        """One step's tokens into ``out``; True when a sequence produced its first token or
        finished."""
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
                self._keep_prompt(r.uid, r.all_tokens, r.prompt_cache, out, request_id)
            if r.finish_reason is not None and request_id in self._kept_samplers:
                sampler, prompt_len = self._kept_samplers.pop(request_id)
                try:
                    packed = pack(r.prompt_cache or [], prompt_len, int(r.token))
                except Exception as exc:  # this sequence fails alone, the batch goes on
                    self._namespace.pop(r.uid, None)
                    out.failed[request_id] = f"could not pack the KV cache: {exc}"
                    continue
                out.kept[request_id] = (packed, key_after_first(sampler))
                # A prefill node's prompt, for its conversation's next turn (after packing:
                # keeping compacts the cache the handoff was just read from).
                self._keep_prompt(r.uid, r.all_tokens, r.prompt_cache, out, request_id)
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
        """This request's sampler, failing alone (None: the shared greedy path)."""
        return guarded_sampler(e.sampling, self._sample_failures, e.request_id, key)

    # --- the prompt cache ------------------------------------------------------------------
    def _keep_removed(self, uids: list[int]) -> None:
        """The caches of the sequences ``uids``, removed while decoding."""
        assert self.gen is not None
        if not uids:
            return
        try:
            taken = self.gen.extract_cache(uids)
        except Exception as exc:  # the cache is an optimization: never fail a step on it
            logger.warning("prompt cache: could not take a cancelled sequence's cache: {}", exc)
            return
        for uid, (cache, tokens) in taken.items():
            self._keep_prompt(uid, list(tokens), cache)

    def _keep_prompt(
        self,
        uid: int,
        tokens: list[int] | None,
        cache: list[Any] | None,
        out: EngineStep | None = None,
        request_id: str | None = None,
    ) -> None:
        """A finished sequence's cache, for later prompts of its namespace that start alike --
        only when ``tokens`` are exactly what it holds (a handoff that brought only its
        prompt's last tokens is decoded, never kept). ``request_id``: a finished request,
        whose last result says whether it was kept."""
        namespace = self._namespace.pop(uid, "")
        if self.prompt_cache is not None and tokens and cache and covers(cache, len(tokens)):
            kept = self.prompt_cache.store(tokens, cache, namespace)
            if kept and out is not None and request_id is not None:
                out.stored.add(request_id)

    def _start(self, i: Insert) -> tuple[list[Any] | None, int]:
        """The cache a sequence starts from and how many of its prompt tokens that cache
        covers. A handed-off cache covers what came before ``token_ids``; otherwise the
        prompt cache may cover a prefix of them (its namespace's only)."""
        if i.cache is not None or self.prompt_cache is None:
            return i.cache, 0
        return self.prompt_cache.fetch(i.entry.token_ids, i.entry.cache_ns)

    # --- a sequence decoding alone -----------------------------------------------------------
    def _may_solo(self, inserts: list[Insert]) -> bool:
        """A lone plain request on an idle engine decodes without the batch generator."""
        if not self.solo_enabled or len(inserts) != 1 or self.batch_cache_rows():
            return False
        i = inserts[0]
        return i.cache is None and not i.keep_cache and not needs_processors(i.entry.sampling)

    def _start_solo(self, i: Insert, out: EngineStep) -> None:
        cache, n = self._start(i)
        if n < i.min_cached:  # a continuation its cache no longer holds: never started
            out.uncached[i.entry.request_id] = n
            return
        rid, tokens = i.entry.request_id, list(i.entry.token_ids)
        self._solo_uids -= 1  # negative: never one of the batch generator's uids
        self._solo = Solo(
            self.loaded.model,
            rid,
            self._solo_uids,
            tokens[n:],
            cache if cache is not None else make_prompt_cache(self.loaded.model),
            tokens[:n],
            self._guarded(i.entry, i.key_state),
            i.entry.sampling.max_tokens,
            self.eos,
            self.prefill_step_size,
        )
        out.new_uids[rid] = self._solo_uids
        self._namespace[self._solo_uids] = i.entry.cache_ns
        out.prompt_tokens += len(tokens)
        if n:
            out.cached[rid] = n

    def _solo_step(self, solo: Solo, want_lp: dict[str, int], out: EngineStep) -> bool:
        t = solo.step()
        if t is None:
            return False  # a prefill chunk
        self._record(solo.request_id, t.token, t.finish, t.logprobs, want_lp, out)
        if t.finish is not None:  # kept before it lets go: the reactor sees it held till then
            self._keep_prompt(solo.uid, solo.fed, solo.cache, out, solo.request_id)
            self._solo = None
        return t.first or t.finish is not None

    def _hand_over(
        self,
        solo: Solo,
        by_uid: dict[int, str],
        want_lp: dict[str, int],
        out: EngineStep,
    ) -> None:
        assert self.gen is not None
        t, rest = solo.hand_over()
        if t is not None:
            self._record(solo.request_id, t.token, t.finish, t.logprobs, want_lp, out)
        if rest is None:  # that token finished it
            self._keep_prompt(solo.uid, solo.fed, solo.cache, out, solo.request_id)
            self._solo = None
            return
        (uid,) = self.gen.insert(
            [rest.prompt],
            max_tokens=[rest.max_tokens],
            caches=[rest.cache],
            all_tokens=[rest.fed],
            samplers=[solo.sampler],
        )
        self._solo = None
        self._namespace[uid] = self._namespace.pop(solo.uid, "")
        by_uid[uid] = solo.request_id
        out.moved[solo.request_id] = uid
        if solo.generated:
            self._started.add(uid)  # its next token is not a first token
