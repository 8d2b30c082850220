"""The stage protocol as a pure state machine: no I/O, no clock, no MLX.

:class:`StageCore` decides; :class:`mlxcel.pipeline.stage.StageService` (over the bus) and
:mod:`mlxcel.sim` (on a virtual clock) carry out what it decides. Every entry point takes the
current time as an argument and returns a list of :mod:`mlxcel.base.effects`.

Authorization (by the authenticated source of each message) is the table ``MAY_SEND``:

* commands -- PrepareSequence, RunEntry, StepEntry, CancelRequest, ReleaseSequence,
  BeginDrain, Shutdown, QueryState -- only from the configured coordinator (``not_coordinator``);
* activations (Activation, StepActivation) only from the upstream stage (``not_upstream``,
  told to the sequence's owner without the sender's nonce, so a stranger cannot fail a live
  exchange by guessing it);
* a StepEntry or StepActivation (a micro-batch's decode step, one row per sequence; see
  :mod:`.stage_batch`) is refused whole only when malformed as a whole (rows over the bound,
  columns of different lengths, an id twice, a tensor of another row count); otherwise each
  row is authorised, checked and answered as a RunEntry or Activation of its own would be;
* the identity that prepared a request id owns it here: a command for that id from anyone
  else is answered ``not_owner`` and changes nothing; re-preparing discards older caches;
* results go to the owner (the authenticated source of PrepareSequence), never to an address
  named in a payload; other replies go to the authenticated source.

Each sequence is a small state machine (``SEQ_TABLE``): IDLE -> QUEUED (a step arrived) ->
RUNNING (in a compute job) -> IDLE, or FAILED when its step failed (a failed sequence stays
failed until released). A step must start where the sequence's cache ends (``start_pos``),
so a duplicated or replayed step cannot run twice on one cache. The node itself is SERVING,
DRAINING (no new sequences), STOPPING (drain, then stop) or STOPPED (``NODE_TABLE``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from mlxcel.base.effects import (
    DropPrefixes,
    Effect,
    FreeCache,
    KeepPrefix,
    LoadPrefix,
    Send,
    StartCompute,
    Stopped,
    Warn,
)
from mlxcel.base.errors import ProtocolError
from mlxcel.base.messages import (
    MAX_EVICTIONS,
    MAX_STEP_ROWS,
    Ack,
    Activation,
    BeginDrain,
    CancelRequest,
    Error,
    ErrorCode,
    EvictPrefixes,
    Message,
    PrepareSequence,
    Progress,
    QueryState,
    ReleaseSequence,
    RunEntry,
    SamplingParams,
    Shutdown,
    State,
    StepActivation,
    StepEntry,
    Undecodable,
)
from mlxcel.pipeline.stage_batch import Passing, rows_problem
from mlxcel.pipeline.stage_gate import StageGate
from mlxcel.pipeline.stage_protocol import (
    MAY_SEND,
    NODE_TABLE,
    SEQ_TABLE,
    ComputeJob,
    KeepAlive,
    Seq,
    SeqEvent,
    SeqKey,
    SeqState,
    StageConfig,
    StageEvent,
    StageState,
    StageStats,
    Step,
    StepFailed,
    StepOutput,
    pick_job,
)

__all__ = ["StageConfig", "StageCore", "StageState"]

# A row's sampling on a stage that does not sample (only the final stage reads it).
NOT_SAMPLING = SamplingParams()


class StageCore(StageGate):
    """The stage protocol."""

    def __init__(
        self,
        config: StageConfig,
        *,
        width: int,
        vocab: int,
        layers: tuple[int, int],
        counters: Callable[[], dict[str, int | str]] = dict,
    ) -> None:
        self.config = config
        self.width = width
        self.vocab = vocab
        self.layers = layers
        self.counters = counters  # State fields the node keeps: wire bytes, timing, model
        self.state = StageState.SERVING
        self._drain_ends: float | None = None  # a BeginDrain's bound (None: none asked)
        self.seqs: dict[str, Seq] = {}
        self.stats = StageStats()
        self._queue: collections.deque[Seq] = collections.deque()
        self._generation = 0
        self._job_ids = 0
        self._job: ComputeJob | None = None
        self._job_deadline = 0.0
        self._last_was_decode = False
        self._keepalive = KeepAlive(config.progress_interval)
        self._stuck: int | None = None  # a timed-out job the compute thread has not returned
        self._owners: set[str] = set()  # identities whose prompt-cache entries this stage holds

    @property
    def is_first(self) -> bool:
        return self.config.index == 0

    @property
    def is_last(self) -> bool:
        return self.config.index == self.config.n_stages - 1

    @property
    def busy(self) -> bool:
        return self._job is not None

    # --- entry points -------------------------------------------------------------------------
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        """One message from ``source`` (an authenticated identity) at time ``now``."""
        return self.handle_many((msg,), source, now)

    def handle_many(self, msgs: tuple[Message, ...], source: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        for msg in msgs:
            self._handle_one(msg, source, now, out)
        self._start_next(now, out)
        self._maybe_stopped(out)
        return out

    def _handle_one(self, msg: Message, source: str, now: float, out: list[Effect]) -> None:
        if isinstance(msg, Undecodable):
            self._on_undecodable(msg, source, out)
        elif type(msg) not in MAY_SEND:
            self._refuse(out, msg, source, ErrorCode.BAD_MESSAGE, "not a stage message")
        elif isinstance(msg, RunEntry | StepEntry) and not self.is_first:
            self._refuse(out, msg, source, ErrorCode.NOT_ENTRY, "this stage is not the entry stage")
        elif not self._sender_ok(msg, source):
            self._refused_sender(out, msg, source)
        else:
            try:
                getattr(self, f"_on_{type(msg).__name__}")(msg, source, now, out)
            except ProtocolError as exc:
                self._refuse(out, msg, source, exc.code, str(exc))

    def compute_done(
        self, job_id: int, outputs: list[StepOutput], took: float, now: float
    ) -> list[Effect]:
        """The backend finished job ``job_id`` in ``took`` seconds of compute."""
        out: list[Effect] = []
        job = self._job
        self._stuck = None if job_id == self._stuck else self._stuck  # the thread is back
        if job is None or job.id != job_id:
            return out  # a job that timed out and was abandoned: its requests already failed
        self._job = None
        self.stats.ran(len(job.steps), took)
        spent = int(took * 1e6)
        passing = Passing(self.config.downstream, self.is_last)
        for step, result in zip(job.steps, outputs, strict=True):
            seq = self._live(step.key)
            if seq is None:
                continue  # released while it ran
            seq.touched = now
            seq.step = None
            if isinstance(result, StepFailed):
                seq.state = SEQ_TABLE.next(seq.state, SeqEvent.FAIL)
                self._fail_to_owner(out, seq, step, result.code, result.why)
                continue
            seq.state = SEQ_TABLE.next(seq.state, SeqEvent.DONE)
            seq.tokens += step.n
            passing.add(step, result, step.compute_us + spent)
        for dest, msg in passing.messages():
            self._send(out, dest, msg)
        self._start_next(now, out)
        self._maybe_stopped(out)
        return out

    def compute_failed(self, job_id: int, why: str, now: float) -> list[Effect]:
        """The backend raised while running job ``job_id``: its sequences fail."""
        self._stuck = None if job_id == self._stuck else self._stuck
        return self._fail_job(job_id, ErrorCode.FORWARD_FAILED, why, now)

    def on_timer(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        if self._job is not None and now >= self._job_deadline:
            why = f"a step took longer than {self.config.forward_timeout:g}s"
            self._stuck = self._job.id
            out += self._fail_job(self._job.id, ErrorCode.FORWARD_TIMEOUT, why, now)
        if self._drain_ends is not None and now >= self._drain_ends:
            self._drain_ends = None
            if self.state is StageState.DRAINING:
                self.state = NODE_TABLE.next(self.state, StageEvent.RESUME)
                bound = self.config.drain_bound
                self._say(out, f"the drain asked for {bound:g}s ago ended with no Shutdown "
                          "after it: serving again")  # fmt: skip
        if self._keepalive.at is not None and now >= self._keepalive.at:
            held = {(s.owner, s.step.nonce) for s in self.seqs.values() if s.step is not None}
            report = self._keepalive.tick(held, now)
            for owner, nonces in report.items() if self._stuck is None else ():
                self._send(out, owner, Progress(nonces))  # a stuck compute thread: silence
        lease = self.config.lease  # the same sum next_timer() reports, so a timer never misses
        idle = [
            rid
            for rid, seq in self.seqs.items()
            if seq.touched + lease <= now and SEQ_TABLE.allows(seq.state, SeqEvent.EXPIRE)
        ]
        if idle:
            self.stats.leases_expired += len(idle)
            self._free(out, idle)
        self._maybe_stopped(out)
        return out

    def next_timer(self) -> float | None:
        """When ``on_timer`` has something to do next (None: nothing pending)."""
        times = [
            s.touched + self.config.lease
            for s in self.seqs.values()
            if SEQ_TABLE.allows(s.state, SeqEvent.EXPIRE)
        ]
        if self._job is not None:
            times.append(self._job_deadline)
        if self._keepalive.at is not None:
            times.append(self._keepalive.at)
        if self._drain_ends is not None:
            times.append(self._drain_ends)
        return min(times) if times else None

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        """A connection with ``identity`` closed: nobody is left to release what it owns, or
        to evict the prompt-cache entries it asked this stage to keep (a coordinator that
        comes back starts a fresh index; one that asks for an entry gone meanwhile gets
        ``prefix_not_cached`` and prefills in full)."""
        out: list[Effect] = []
        self._free(out, [rid for rid, seq in self.seqs.items() if seq.owner == identity])
        if identity in self._owners:
            self._owners.discard(identity)
            out.append(DropPrefixes(identity))
        self._start_next(now, out)
        self._maybe_stopped(out)
        return out

    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]:
        """The adapter could not deliver ``send``: a lost activation fails its request."""
        out: list[Effect] = []
        self.stats.dropped += 1
        out.append(Warn("stage-drop", f"{self._me}: could not send to {send.dest}: {reason}"))
        msg = send.msg
        rows: list[tuple[str, int]] = []
        if isinstance(msg, Activation):
            rows = [(msg.request_id, msg.nonce)]
        elif isinstance(msg, StepActivation):
            rows = list(zip(msg.request_ids, msg.nonces, strict=False))
        for rid, nonce in rows:
            if (seq := self.seqs.get(rid)) is not None:
                why = f"{self._me} cannot reach {send.dest}"
                self._send(out, seq.owner, Error(ErrorCode.DOWNSTREAM_UNREACHABLE, why, rid, nonce))
        return out

    def shutdown(self, now: float) -> list[Effect]:
        """Drain, then stop once the last sequence is released (a ``Stopped`` effect)."""
        out: list[Effect] = []
        self._drain_ends = None
        self.state = NODE_TABLE.next(self.state, StageEvent.SHUTDOWN)
        self._maybe_stopped(out)
        return out

    # --- commands -----------------------------------------------------------------------------
    def _on_PrepareSequence(
        self, m: PrepareSequence, source: str, now: float, out: list[Effect]
    ) -> None:
        old = self._owned(m, source)
        if old is not None and old.nonce == m.nonce and old.owner == source:
            self.stats.duplicates += 1  # a copy of the claim that made it: keep the cache
            self._send(out, source, Ack(m.request_id, m.nonce))
            return
        self.state = NODE_TABLE.next(self.state, StageEvent.PREPARE)
        if old is None and len(self.seqs) >= self.config.max_sequences:
            raise ProtocolError(
                ErrorCode.TOO_MANY_SEQUENCES,
                f"stage holds its maximum of {self.config.max_sequences} sequences",
            )
        if (m.prefix == 0) != (m.prefix_len == 0) or not 0 <= m.prefix_len < m.max_len:
            why = f"a cached prefix of {m.prefix_len} positions does not fit {m.max_len}"
            raise ProtocolError(ErrorCode.BAD_REQUEST, why)
        if old is not None:  # a fresh claim: whatever was cached under this id is discarded
            self._free(out, [m.request_id], quiet=True)
        self._generation += 1
        key = (m.request_id, self._generation)
        seq = Seq(key, source, m.max_len, now, nonce=m.nonce, context=m.context,
                  sampling=m.sampling, tokens=m.prefix_len)  # fmt: skip
        self.seqs[m.request_id] = seq
        if m.prefix:  # queued on the compute thread before any step of this sequence
            self._owners.add(source)
            out.append(LoadPrefix(key, source, m.prefix, m.prefix_len))
        self._send(out, source, Ack(m.request_id, m.nonce))

    def _on_ReleaseSequence(
        self, m: CancelRequest | ReleaseSequence, source: str, now: float, out: list[Effect]
    ) -> None:
        if (seq := self._owned(m, source)) is None:
            return
        if isinstance(m, ReleaseSequence) and m.keep:
            if seq.state is SeqState.IDLE and m.keep_len == seq.tokens > 0:
                self._owners.add(source)
                out.append(KeepPrefix(seq.key, source, m.keep, m.keep_len))
            else:  # the coordinator's view and ours differ: keep nothing rather than a guess
                why = (f"not keeping {m.request_id!r} as prompt-cache entry {m.keep}: it holds "
                       f"{seq.tokens} positions ({seq.state.value}), not {m.keep_len}")  # fmt: skip
                out.append(Warn("prefix-mismatch", f"{self._me}: {why}"))
        self._free(out, [m.request_id], quiet=seq.state is not SeqState.QUEUED)

    def _on_CancelRequest(
        self, m: CancelRequest, source: str, now: float, out: list[Effect]
    ) -> None:
        if (seq := self._owned(m, source)) is not None:  # logged only if queued work is lost
            self._free(out, [m.request_id], quiet=seq.state is not SeqState.QUEUED)

    def _on_EvictPrefixes(
        self, m: EvictPrefixes, source: str, now: float, out: list[Effect]
    ) -> None:
        if len(m.entries) > MAX_EVICTIONS:
            why = f"EvictPrefixes names {len(m.entries)} entries (at most {MAX_EVICTIONS})"
            raise ProtocolError(ErrorCode.BAD_REQUEST, why)
        if m.entries:  # entries are the sender's own: another owner's cannot be named
            out.append(DropPrefixes(source, tuple(m.entries)))

    def _on_BeginDrain(self, m: BeginDrain, source: str, now: float, out: list[Effect]) -> None:
        if self.state is StageState.SERVING:
            self._drain_ends = now + self.config.drain_bound
            self._say(out, f"draining on BeginDrain from {source}: no new sequences for "
                      f"{self.config.drain_bound:g}s unless a Shutdown follows")  # fmt: skip
        self.state = NODE_TABLE.next(self.state, StageEvent.DRAIN)
        self._send(out, source, Ack("", 0))

    def _on_Shutdown(self, m: Shutdown, source: str, now: float, out: list[Effect]) -> None:
        if self.state is not StageState.STOPPING:
            self._say(out, f"stopping on Shutdown from {source}")
        self._drain_ends = None
        self.state = NODE_TABLE.next(self.state, StageEvent.SHUTDOWN)

    def _on_QueryState(self, m: QueryState, source: str, now: float, out: list[Effect]) -> None:
        state = State(
            self.config.node_id,
            self.layers,
            len(self.seqs),
            self.state is not StageState.SERVING,
            m.nonce,
            compute_us=int(self.stats.compute_s * 1e6),
            largest_batch=self.stats.largest_batch,
            **self.counters(),
        )
        self._send(out, source, state)

    # --- the data path ------------------------------------------------------------------------
    def _on_RunEntry(self, m: RunEntry, source: str, now: float, out: list[Effect]) -> None:
        seq = self._owned(m, source)
        if seq is None:
            raise ProtocolError(ErrorCode.NOT_PREPARED, f"no sequence {m.request_id!r} here")
        if not m.token_ids or any(not 0 <= t < self.vocab for t in m.token_ids):
            problem = f"token ids empty or outside the vocabulary [0, {self.vocab})"
            raise ProtocolError(ErrorCode.BAD_REQUEST, problem)
        step = Step(seq.key, m.micro_batch, tuple(m.token_ids), None, len(m.token_ids), m.start_pos,
                    m.sampling, m.nonce, m.sample, owner=seq.owner, context=seq.context)  # fmt: skip
        self._accept_step(seq, step, now)

    def _on_Activation(self, m: Activation, source: str, now: float, out: list[Effect]) -> None:
        seq = self.seqs.get(m.request_id)
        problem = self._check_hidden(m.hidden)
        if seq is not None and problem is not None:
            self.stats.errors += 1
            err = Error(ErrorCode.BAD_ACTIVATION, problem, m.request_id, m.nonce)
            self._send(out, seq.owner, err)
            return
        seq = self._joinable(m.request_id, m.owner, out)
        if seq is None:
            return
        step = Step(seq.key, m.micro_batch, None, m.hidden, m.hidden.shape[1], m.start_pos,
                    m.sampling, m.nonce, m.sample, m.compute_us, seq.owner, seq.context)  # fmt: skip
        self._accept_from_upstream(seq, step, now, out)

    def _accept_from_upstream(self, seq: Seq, step: Step, now: float, out: list[Effect]) -> None:
        try:
            self._accept_step(seq, step, now)
        except ProtocolError as exc:  # told to the owner: the sender is the upstream stage
            self.stats.errors += 1
            self._send(out, seq.owner, Error(exc.code, str(exc), step.request_id, step.nonce))

    def _on_StepEntry(self, m: StepEntry, source: str, now: float, out: list[Effect]) -> None:
        """A micro-batch's decode step: each row is checked and refused on its own, exactly as
        a RunEntry of its own would be; the rest run."""
        problem = rows_problem(m)
        if problem is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, problem)
        for i, rid in enumerate(m.request_ids):  # columns of one length (rows_problem)
            token, start, nonce = m.token_ids[i], m.start_pos[i], m.nonces[i]
            try:
                seq = self._owned_id(rid, source)
                if seq is None:
                    raise ProtocolError(ErrorCode.NOT_PREPARED, f"no sequence {rid!r} here")
                if not 0 <= token < self.vocab:
                    why = f"token id outside the vocabulary [0, {self.vocab})"
                    raise ProtocolError(ErrorCode.BAD_REQUEST, why)
                if seq.sampling is None and self.is_last:
                    why = f"{rid!r} was prepared without sampling parameters"
                    raise ProtocolError(ErrorCode.BAD_REQUEST, why)
                sampling = seq.sampling or NOT_SAMPLING
                step = Step(seq.key, m.micro_batch, (token,), None, 1, start, sampling, nonce,
                            owner=seq.owner, context=seq.context, batched=True)  # fmt: skip
                self._accept_step(seq, step, now)
            except ProtocolError as exc:
                self._refuse_row(out, m, source, exc.code, str(exc), rid, nonce)

    def _on_StepActivation(
        self, m: StepActivation, source: str, now: float, out: list[Effect]
    ) -> None:
        problem = rows_problem(m) or self._check_hidden(m.hidden, len(m.request_ids))
        if problem is not None:  # the whole message: every row's owner hears it
            self.stats.errors += 1
            for i in range(min(len(m.request_ids), len(m.nonces), MAX_STEP_ROWS)):
                rid, nonce = m.request_ids[i], m.nonces[i]
                if (seq := self.seqs.get(rid)) is not None:
                    err = Error(ErrorCode.BAD_ACTIVATION, problem, rid, nonce)
                    self._send(out, seq.owner, err)
            return
        for i, rid in enumerate(m.request_ids):  # columns of one length (rows_problem)
            start, nonce = m.start_pos[i], m.nonces[i]
            seq = self._joinable(rid, m.owner, out)
            if seq is None:
                continue
            if seq.sampling is None and self.is_last:
                why = f"{rid!r} was prepared without sampling parameters"
                self._send(out, seq.owner, Error(ErrorCode.BAD_REQUEST, why, rid, nonce))
                continue
            sampling = seq.sampling or NOT_SAMPLING
            step = Step(seq.key, m.micro_batch, None, m.hidden, 1, start, sampling, nonce, True,
                        m.compute_us, seq.owner, seq.context, row=i, batched=True)  # fmt: skip
            self._accept_from_upstream(seq, step, now, out)

    def _accept_step(self, seq: Seq, step: Step, now: float) -> None:
        if step.nonce == seq.step_nonce:
            # A copy of a step already accepted (each exchange has a fresh nonce): whether it
            # is still queued, running or done, it runs once and is answered once.
            self.stats.duplicates += 1
            return
        new_state = SEQ_TABLE.next(seq.state, SeqEvent.STEP)
        if step.start_pos != seq.tokens:
            # The cache holds exactly the positions before start_pos; anything else would
            # attend to the wrong history (or run a replayed step twice).
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"start_pos {step.start_pos} does not follow the {seq.tokens} positions cached "
                f"for {step.request_id!r}",
            )
        if seq.tokens + step.n > seq.max_len:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "token ids beyond the prepared length")
        seq.state = new_state
        seq.step = step
        seq.step_nonce = step.nonce
        seq.touched = now
        self._queue.append(seq)
        self._keepalive.arm(now)

    def _start_next(self, now: float, out: list[Effect]) -> None:
        """Start one job if none runs: decode steps batch; prompt chunks alternate with them."""
        if self._job is not None:
            return
        queued = [s for s in self._queue if s.state is SeqState.QUEUED and self._live(s.key) is s]
        self._queue.clear()
        if not queued:
            return
        chosen = pick_job(queued, self.config.max_batch, self._last_was_decode)
        self._last_was_decode = bool(chosen[0].step and chosen[0].step.decode)
        self._queue.extend(s for s in queued if s not in chosen)
        for seq in chosen:
            seq.state = SEQ_TABLE.next(seq.state, SeqEvent.START)
        self._job_ids += 1
        steps = tuple(s.step for s in chosen if s.step is not None)
        self._job = ComputeJob(
            self._job_ids, steps, self.is_first, self.is_last, self.config.return_logits
        )
        self._job_deadline = now + self.config.forward_timeout
        out.append(StartCompute(self._job))

    def _fail_job(self, job_id: int, code: str, why: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        job = self._job
        if job is None or job.id != job_id:
            return out
        self._job = None  # abandoned: a late answer for it is ignored
        for step in job.steps:
            seq = self._live(step.key)
            if seq is not None:
                seq.step = None
                seq.state = SEQ_TABLE.next(seq.state, SeqEvent.FAIL)
                self._fail_to_owner(out, seq, step, code, why)
        self._start_next(now, out)
        return out

    # --- helpers ------------------------------------------------------------------------------
    def _live(self, key: SeqKey) -> Seq | None:
        seq = self.seqs.get(key[0])
        return seq if seq is not None and seq.key == key else None

    def _free(self, out: list[Effect], request_ids: list[str], quiet: bool = False) -> None:
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is None:
                continue
            if seq.state is SeqState.QUEUED:
                self.stats.discarded += 1
            out.append(FreeCache(seq.key))
        if request_ids and not quiet:
            out.append(Warn("info", f"{self._me}: freed {len(request_ids)} sequence(s)"))

    def _maybe_stopped(self, out: list[Effect]) -> None:
        if not self.seqs and NODE_TABLE.allows(self.state, StageEvent.EMPTY):
            self.state = NODE_TABLE.next(self.state, StageEvent.EMPTY)
            out.append(Stopped())
