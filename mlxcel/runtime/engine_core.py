"""The engine's protocol core: the sequence table, admission, step scheduling, cancellation,
results and failures. Pure: it performs no I/O and reads no clock (see
:mod:`mlxcel.base.effects`); :class:`~mlxcel.runtime.engine.LocalEngine` carries out what
it decides, and the compute side (:class:`~mlxcel.runtime.engine_runtime.EngineRuntime`)
runs the jobs it hands out.

What it takes (``handle``): ``RunEntry`` (start a sequence), ``PrefillEntry`` (start one and
keep its KV cache: a prefill node), ``ResumeSequence`` (start one after a handed-off cache: a
decode node), ``ContinueEntry`` (start one only if the prompt cache supplies enough of it: a
decode node continuing a conversation), ``CancelRequest`` and ``ReleaseSequence`` (drop one:
only its owner may).

What it gives (effects):

* one ``StartCompute(EngineJob)`` at a time -- the sequences that join, the batch rows that
  leave, then a run of decode steps -- and ``CutShort`` when the table changes while one
  runs, so that the change reaches the compute side within a step. An idle engine starts
  its next job from the timer, due at once: on the loop's next turn, with every entry that
  arrived meanwhile; a job that ends starts the next one at once;
* ``Deliver`` of each sequence's results to its owner, one ``RunResult`` per sequence per
  job (a run ends at any sequence's first token, so that one is not held back); a
  ``PrefillEntry``'s last result comes as ``CacheKept``, with its cache;
* ``Deliver(Error)``: a refused entry (``bad_request``, at once), a sequence whose sampler
  failed (alone: the others go on), a ``ContinueEntry`` its cache fell short for
  (``prefix_not_cached``, unrun), every sequence after a failed or overrunning step.

After a failed step the compute side's state is suspect: a recoverable engine fails every
sequence, resets it (``StartCompute(ResetJob)``) and goes on; one that is not (tensor
parallelism: a rank is gone) fails every sequence, refuses every later one and says
``Stopped``. A step overruns when ``step_timeout`` passes (None: a step may take as long as
it takes -- one process cannot wedge itself; a collective that lost a rank can).
"""

from __future__ import annotations

import dataclasses

from mlxcel.base.effects import CutShort, Deliver, Effect, Send, StartCompute, Stopped, Warn
from mlxcel.base.messages import (
    CacheKept,
    CancelRequest,
    ContinueEntry,
    Error,
    ErrorCode,
    Message,
    PrefillEntry,
    ReleaseSequence,
    ResumeSequence,
    RunEntry,
    RunResult,
)
from mlxcel.runtime.engine_state import (
    EngineJob,
    EngineSeq,
    EngineSeqState,
    EngineStep,
    Insert,
    ResetJob,
    StepToken,
    by_sequence,
    entry_problem,
    kv_tokens,
)


class EngineCore:
    def __init__(
        self,
        config: dict[str, object],
        eos: set[int],
        *,
        max_sequences: int = 64,
        step_timeout: float | None = None,
        recoverable: bool = True,
        failure_code: str = ErrorCode.ENGINE_FAILED,
        failure_prefix: str = "",
    ) -> None:
        self.config = config  # the model's config.json: what an entry is checked against
        self.eos = eos
        self.max_sequences = max_sequences
        self.step_timeout = step_timeout
        self.recoverable = recoverable
        # What every sequence gets when a step fails: the code, and the words before why.
        self.failure_code = failure_code
        self.failure_prefix = failure_prefix
        self.seqs: dict[str, EngineSeq] = {}
        self.by_uid: dict[int, str] = {}
        self.to_remove: list[int] = []  # batch rows to drop in the next job
        self.job: int | None = None  # the job under way (its id), if any
        self.start_due: float | None = None  # no job under way: when the next one starts
        self.resetting = False  # that job is a ResetJob
        self.job_started = 0.0
        self._jobs = 0
        self._cut = False  # CutShort said for the job under way
        self.failure: str | None = None  # set once an unrecoverable failure ended the engine
        self.steps = 0
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.sequence_failures = 0

    # --- what metrics and tests read -------------------------------------------------------
    @property
    def active(self) -> int:
        """Sequences that hold (or are about to hold) KV caches."""
        return len(self.seqs)

    def kv_tokens(self) -> int:
        return kv_tokens(self.seqs.values())

    # --- messages --------------------------------------------------------------------------
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        if isinstance(msg, RunEntry):
            return self._admit(EngineSeq(msg, source), now)
        if isinstance(msg, PrefillEntry):
            return self._admit(EngineSeq(msg.entry, source, keep_cache=True), now)
        if isinstance(msg, ResumeSequence):
            seq = EngineSeq(
                msg.entry, source, cache=msg.cache, key_state=msg.key_state,
                context=msg.context, resumed=msg.positions,
            )  # fmt: skip
            return self._admit(seq, now)
        if isinstance(msg, ContinueEntry):
            return self._admit(EngineSeq(msg.entry, source, min_cached=msg.min_cached), now)
        if isinstance(msg, (CancelRequest, ReleaseSequence)):
            return self._drop(msg.request_id, source, now)
        return []

    def _admit(self, seq: EngineSeq, now: float) -> list[Effect]:
        e = seq.entry
        problem = entry_problem(e, self.config)
        code = ErrorCode.BAD_REQUEST
        if problem is None and e.request_id in self.seqs:
            problem = f"request {e.request_id!r} is already running"
        if problem is None and len(self.seqs) >= self.max_sequences:
            problem = f"the engine holds its maximum of {self.max_sequences} sequences"
        if problem is None and self.failure is not None:
            code, problem = self.failure_code, self.failure
        if problem is not None:
            return [Deliver(Error(code, problem, e.request_id, e.nonce))]
        self.seqs[e.request_id] = seq
        return self._changed(now)

    def _drop(self, request_id: str, source: str, now: float) -> list[Effect]:
        seq = self.seqs.get(request_id)
        if seq is None or seq.source != source:
            return []  # unknown, finished, or not the owner: changes nothing
        self._forget(seq)
        return self._changed(now)

    def _forget(self, seq: EngineSeq) -> None:
        """Out of the table; its batch row (if it has one yet) leaves in the next job."""
        del self.seqs[seq.entry.request_id]
        if seq.uid is not None:
            self.by_uid.pop(seq.uid, None)
            self.to_remove.append(seq.uid)

    def _changed(self, now: float) -> list[Effect]:
        """The table changed: with no job under way, one starts at ``now`` -- by the timer,
        on the loop's next turn, so entries that arrive together (a burst of requests)
        start together; with one under way, it is cut short."""
        if self.job is None:
            self.start_due = now if self.start_due is None else self.start_due
            return []
        if self._cut:
            return []
        self._cut = True
        return [CutShort()]

    def _next_job(self, now: float) -> list[Effect]:
        self.start_due = None
        if self.job is not None or self.failure is not None:
            return []
        if not self.seqs and not self.to_remove:
            return []
        inserts = [s for s in self.seqs.values() if s.state is EngineSeqState.QUEUED]
        for s in inserts:
            s.state = EngineSeqState.RUNNING
        removals, self.to_remove = self.to_remove, []
        self._jobs += 1
        job = EngineJob(
            self._jobs,
            tuple(Insert(s.entry, s.cache, s.key_state, s.keep_cache, s.context, s.min_cached)
                  for s in inserts),
            tuple(removals),
            dict(self.by_uid),
            {r: s.entry.sampling.top_logprobs for r, s in self.seqs.items() if s.entry.sampling.logprobs},
        )  # fmt: skip
        for s in inserts:
            s.cache = None  # the compute side holds it now
        self._start(job.id, now)
        return [StartCompute(job)]

    def _start(self, job_id: int, now: float, *, reset: bool = False) -> None:
        self.job, self._cut, self.resetting = job_id, False, reset
        self.job_started = now

    # --- the compute side's answers ----------------------------------------------------------
    def compute_done(self, job_id: int, out: EngineStep, now: float) -> list[Effect]:
        if job_id != self.job:
            return []  # a job abandoned when it overran: its state was reset since
        self.job, self.resetting = None, False
        effects: list[Effect] = []
        for request_id, uid in out.moved.items():  # from decoding alone into the batch
            self._renumber(request_id, uid)
        for request_id, uid in out.new_uids.items():
            s = self.seqs.get(request_id)
            if s is not None and s.state is EngineSeqState.RUNNING and s.uid is None:
                s.uid = uid
                self.by_uid[uid] = request_id
            else:  # dropped while its insert was running: remove it in the next job
                self.to_remove.append(uid)
        self.steps += out.steps
        self.prompt_tokens += out.prompt_tokens
        for request_id, n in out.cached.items():
            if (s := self.seqs.get(request_id)) is not None:
                s.cached = n
        for request_id, why in out.failed.items():
            effects += self._fail_one(request_id, why)
        for request_id, n in out.uncached.items():
            effects += self._not_cached(request_id, n)
        for request_id, items in by_sequence(out.tokens).items():
            seq = self.seqs.get(request_id)
            if seq is None:
                continue  # cancelled while the step ran
            result = self._result(seq, items)
            if result.finish_reason is not None and request_id in out.stored:
                result = dataclasses.replace(result, kept=True)  # its prompt cache keeps it
            kept = out.kept.get(request_id)
            if result.finish_reason is not None and seq.keep_cache:
                if kept is None:
                    why = "the finished sequence left no KV cache"
                    effects.append(
                        Deliver(Error(ErrorCode.ENGINE_FAILED, why, request_id, seq.entry.nonce))
                    )
                    continue
                effects.append(Deliver(CacheKept(result, kept[0], kept[1])))
            else:
                effects.append(Deliver(result))
        return effects + self._next_job(now)

    def _renumber(self, request_id: str, uid: int) -> None:
        s = self.seqs.get(request_id)
        if s is None or s.uid is None:
            self.to_remove.append(uid)
            return
        self.by_uid.pop(s.uid, None)
        s.uid = uid
        self.by_uid[uid] = request_id

    def compute_failed(self, job_id: int, why: str, now: float) -> list[Effect]:
        """A job raised: every sequence fails (the batch state is suspect)."""
        if job_id != self.job:
            return []
        resetting, self.job = self.resetting, None
        if not self.recoverable:
            return self._end(f"engine step failed: {why}")
        if resetting:
            return self._end(f"could not reset after a failed step: {why}")
        return self._fail_all(f"engine step failed: {why}", now)

    def on_timer(self, now: float) -> list[Effect]:
        due = self.next_timer()
        if due is None or now < due:
            return []
        if self.job is None:  # the start of a job
            return self._next_job(now)
        assert self.step_timeout is not None
        why = f"engine step took longer than {self.step_timeout:g}s"
        self.job = None  # abandoned: whatever it returns later is ignored
        if not self.recoverable or self.resetting:
            return self._end(why)
        return self._fail_all(why, now)

    def next_timer(self) -> float | None:
        if self.job is None:
            return self.start_due
        if self.step_timeout is None:
            return None
        return self.job_started + self.step_timeout

    def abort(self, why: str) -> list[Effect]:
        """The engine cannot go on (a tensor-parallel rank died): end it now, without
        waiting for the job under way, which may never return."""
        if self.failure is not None:
            return []
        self.job = self.start_due = None
        return self._end(why)

    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]:
        return []  # the engine sends nothing over the network

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        return []

    # --- results and failures ------------------------------------------------------------------
    def _result(self, seq: EngineSeq, items: list[StepToken]) -> RunResult:
        """One message for what a job produced for ``seq`` (in order; a finish can only be
        the last): fewer hops per token than a message each, the same tokens."""
        first = seq.generated == 0
        seq.generated += len(items)
        finish = items[-1][2]
        if finish is not None:
            del self.seqs[seq.entry.request_id]
            if seq.uid is not None:
                self.by_uid.pop(seq.uid, None)  # its row left the batch as it finished
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

    def _fail_one(self, request_id: str, why: str) -> list[Effect]:
        """One sequence failed inside a step the others completed: end it, keep the rest."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return []
        self._forget(seq)
        self.sequence_failures += 1
        return [
            Warn("warning", f"engine: request {request_id} failed alone: {why}"),
            Deliver(Error(ErrorCode.SAMPLING_FAILED, why, request_id, seq.entry.nonce)),
        ]

    def _not_cached(self, request_id: str, n: int) -> list[Effect]:
        """A continuation whose cache no longer holds what it needs: it ends, unrun."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return []
        self._forget(seq)
        why = (
            f"the prompt cache holds {n} of this prompt's tokens, fewer than the "
            f"{seq.min_cached} expected (evicted); nothing was prefilled"
        )
        return [Deliver(Error(ErrorCode.PREFIX_NOT_CACHED, why, request_id, seq.entry.nonce))]

    def _fail_every(self, why: str) -> list[Effect]:
        seqs, self.seqs = self.seqs, {}
        self.by_uid.clear()
        self.to_remove.clear()
        text = f"{self.failure_prefix}{why}"
        return [Deliver(Error(self.failure_code, text, r, s.entry.nonce)) for r, s in seqs.items()]

    def _fail_all(self, why: str, now: float) -> list[Effect]:
        """After a failed step the batch state is suspect: drop it all, reset, go on. The
        reset runs on the compute side after whatever step may still run there (an
        abandoned one): its state is reset by it, never under it."""
        effects: list[Effect] = [Warn("warning", f"{why}; failing every running sequence")]
        effects += self._fail_every(why)
        self._jobs += 1
        self._start(self._jobs, now, reset=True)
        return effects + [StartCompute(ResetJob(self._jobs))]

    def _end(self, why: str) -> list[Effect]:
        self.failure = f"{self.failure_prefix}{why}"
        effects: list[Effect] = [Warn("warning", f"{self.failure}; the engine stops")]
        return effects + self._fail_every(why) + [Stopped()]
