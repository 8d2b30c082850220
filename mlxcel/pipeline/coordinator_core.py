"""The coordinator protocol as a pure state machine: no I/O, no clock, no MLX.

For each local RunEntry the core prepares the sequence on every stage (each answers Ack),
then per step sends the entry stage one message -- a RunEntry per prompt chunk, a StepEntry
per micro-batch decode step (a row per request) -- and waits for the final stage's RunResult
or StepResult row. The prompt runs as mlx-lm's: ``prefill_step_size`` chunks that only fill caches
(``sample=False``), then its last token as the first sampling step. A request that ends is
released on every stage. At most ``max_in_flight`` sequences are in the stages (the rest
wait in order); decode steps travel in micro-batches (``MicroBatches``, one per stage).

Every exchange has a fresh nonce and an absolute deadline. What the core accepts from the
network: Ack/State only from the stage it addressed; RunResult only from the final stage,
with the nonce of the exchange that is waiting, for the same request and micro-batch (and,
with ``return_logits``, logits of shape ``[1, seq_len, vocab]``); Error carrying a waiting
exchange's nonce from any stage (a stage downstream reports a bad activation that way).
Everything else is dropped and counted (by a fixed reason, never by peer text), while the
exchange keeps waiting on its deadline.

Per-request states and their transitions: :mod:`mlxcel.pipeline.coordinator_protocol`.
"""

from __future__ import annotations

import collections
from collections import Counter

from mlxcel.base.defaults import PREFILL_STEP_SIZE
from mlxcel.base.effects import Answer, Deliver, Effect, ResetPeer, Send, Warn
from mlxcel.base.errors import PipelineError
from mlxcel.base.membership import MembershipLog
from mlxcel.base.messages import (
    LOCAL,
    MAX_EVICTIONS,
    Ack,
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
    RunResult,
    State,
    StepEntry,
    StepResult,
    Undecodable,
)
from mlxcel.base.prefix_index import PrefixIndex
from mlxcel.pipeline.coordinator_protocol import (
    REQ_TABLE,
    Exchange,
    Exchanges,
    MicroBatches,
    Picked,
    PickToken,
    Req,
    ReqEvent,
    ReqState,
    admission_problem,
    claim,
    for_client,
    fresh,
    match_result,
    missed_text,
    picked,
    sends_first,
    step_entries,
    step_rows,
)

Missed = tuple[int, str] | None  # a timed-out exchange: its nonce, and why
# What a stage may send the coordinator, and the method that takes it.
_FROM_STAGE = dict.fromkeys((Ack, State), "_on_reply") | {Progress: "_on_progress"}
_FROM_STAGE |= {RunResult: "_on_result", StepResult: "_on_step_result", Error: "_on_error"}

__all__ = ["CoordinatorCore", "PipelineError", "REQ_TABLE", "ReqEvent", "ReqState"]


class CoordinatorCore:
    """The coordinator protocol."""

    def __init__(
        self,
        stages: list[str],
        *,
        eos: set[int],
        vocab: int,
        max_len: int,
        step_timeout: float = 30.0,
        return_logits: bool = False,
        max_in_flight: int = 64,
        micro_batch_size: int | None = None,
        stage_max_batch: int | None = None,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        pick_token: PickToken | None = None,
        first_nonce: int = 1,
        prompt_cache_tokens: int = 0,
        first_entry: int = 1,
    ) -> None:
        if return_logits and pick_token is None:
            raise ValueError("return_logits needs a pick_token function")
        self.stages = list(stages)
        self._stage_set = frozenset(stages)
        self._heard: dict[str, float] = {}  # stage -> when it last sent us anything
        # Stages the probe found unreachable, and why: nothing is admitted while any is.
        self.down: dict[str, str] = {}
        self.membership = MembershipLog("coordinator")
        self.eos = eos
        self.vocab = vocab
        self.max_len = max_len
        self.step_timeout = step_timeout
        self.return_logits = return_logits
        self.max_in_flight = max_in_flight
        # By default one micro-batch per stage, but never more than a stage runs at once (a
        # larger one would be split there, and its batch cache regrouped, every step).
        fit = min(-(-max_in_flight // len(stages)), stage_max_batch or max_in_flight)
        self.micro_batch_size = micro_batch_size or max(1, fit)
        self.micro = MicroBatches(max(1, -(-max_in_flight // self.micro_batch_size)))
        self.prefill_step_size = prefill_step_size
        self.pick_token = pick_token
        # The prompt cache's index (which prefixes the stages hold, for whom): the stages
        # keep the KV of their own layers under its entry ids. ``prompt_cache_tokens``: the
        # positions every stage's budget holds (0: no prompt cache). Entry ids start from a
        # random point (the adapter's), as nonces do: never an earlier coordinator's.
        self.prefixes = (
            PrefixIndex(prompt_cache_tokens, first_entry) if prompt_cache_tokens > 0 else None
        )
        self.refilled = 0  # requests prefilled in full after a stage lacked their prefix
        self.reqs: dict[str, Req] = {}
        self._waiting: collections.deque[str] = collections.deque()
        self.exchanges = Exchanges(first_nonce, step_timeout)
        self._exchanges = self.exchanges.by_nonce
        self.peak_in_flight = 0
        # Keyed by a fixed reason (never by peer-supplied text), so it cannot grow unbounded.
        self.dropped: Counter[str] = Counter()
        self.completed = self.failed = self.steps = 0
        # Decode steps measured at the hand-offs: wall time from sending the RunEntry to
        # receiving its RunResult, and the stages' compute for it. The difference is protocol.
        self.decode_steps, self.decode_wall_s, self.decode_compute_s = 0, 0.0, 0.0

    @property
    def final(self) -> str:
        return self.stages[-1]

    @property
    def active(self) -> int:
        return len(self.reqs)

    @property
    def held(self) -> int:
        """In-flight slots taken: requests admitted into the stages."""
        return len(self._in_stages())

    # --- entry points -------------------------------------------------------------------------
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        if isinstance(msg, (RunEntry, CancelRequest)):
            if source != LOCAL:
                self._drop(out, f"{type(msg).__name__} is only accepted locally", msg, source)
            elif isinstance(msg, RunEntry):
                self._on_entry(msg, now, out)
            else:
                self._cancel(msg.request_id, now, out)
        elif source == LOCAL:
            pass  # our own Deliver effects, when a bus routes them back
        elif source not in self._stage_set:
            self._drop(out, "not from a stage of this pipeline", msg, source)
        elif isinstance(msg, Undecodable):
            why = f"undecodable message (kind {msg.kind}): {msg.reason}"
            for rid, nonce in msg.rows or ((msg.request_id, msg.nonce),):
                self._on_error(Error(ErrorCode.BAD_MESSAGE, why, rid, nonce), source, now, out)
        elif (on := _FROM_STAGE.get(type(msg))) is None:
            self._drop(out, "not a coordinator message", msg, source)
        else:
            self._heard[source] = now
            getattr(self, on)(msg, source, now, out)
        return out

    def on_timer(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        for nonce, ex in self.exchanges.missed(now):
            missed = missed_text(ex, self.final, self.step_timeout, now)
            # Nothing back on that path since the exchange was sent: the stream may be wedged
            # mid-frame. Replace it, so the next request dials afresh. The stage frees what it
            # holds for us when the connection closes, so every request in the stages fails
            # now (not one deadline at a time); those admitted after this point are unharmed.
            if not (ex.reset and not self._heard_since(ex)):
                self._close(nonce, out, ErrorCode.DEADLINE_EXCEEDED, missed, now)
                continue
            out.append(ResetPeer(ex.dest))
            why = f"the connections to stage {ex.dest} were reset after a missed deadline"
            self._lose(ex.dest, why, now, out, (nonce, missed))
        return out

    def next_timer(self) -> float | None:
        return self.exchanges.next_deadline()

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        """A stage connection closed: the stage frees what it held for us, so every request
        in the stages fails now (and every query to that stage)."""
        out: list[Effect] = []
        if identity in self.stages:
            # Not down yet: a reconnect may work (the probe that follows decides).
            self._lose(identity, f"lost the connection to stage {identity}", now, out, None)
        return out

    def stage_health(
        self, stage: str, ok: bool, why: str, now: float, detail: str = ""
    ) -> list[Effect]:
        """The liveness probe's verdict on ``stage`` (a round trip, run by the adapter;
        ``detail``: its id and layers, for the log). Going down fails every request now (in
        the stages and waiting) and refuses new ones until it answers again."""
        out: list[Effect] = []
        if stage not in self._stage_set:
            return out
        if ok and stage not in self.down:
            return list(self.membership.joined(f"stage {stage}", detail, now))
        if ok:
            return list(self.membership.back(f"stage {stage}", self.down.pop(stage), now))
        first, self.down[stage] = stage not in self.down, why
        if first:
            out += self.membership.lost(f"stage {stage}", why, now)
            text = f"stage {stage} is unreachable: {why}"
            self._lose(stage, text, now, out, None)
            for req in [r for r in map(self.reqs.get, self._waiting) if r and not r.admitted]:
                self._fail(req, out, ErrorCode.STAGE_UNREACHABLE, text, now)
        return out

    def _in_stages(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.admitted]

    def _lose(self, stage: str, why: str, now: float, out: list[Effect], missed: Missed) -> None:
        """Fail every request in the stages and queries to ``stage``, after ``missed`` (nonce,
        why): the exchange whose deadline gave the stage up. No parked step goes out meanwhile."""
        victims = self._in_stages()  # a snapshot: requests admitted while failing these live
        if self.prefixes is not None:  # the stage forgets our entries as the connection goes
            self._evict(self.prefixes.clear(), now, out)
        self.micro.holding = True
        try:
            if missed is not None:
                self._close(missed[0], out, ErrorCode.DEADLINE_EXCEEDED, missed[1], now)
            for nonce, ex in list(self._exchanges.items()):
                if not ex.request_id and ex.dest == stage:
                    self._close(nonce, out, ErrorCode.STAGE_UNREACHABLE, why, now)
            for req in victims:
                if req.admitted and req.pending:  # not ended meanwhile
                    self._close(min(req.pending), out, ErrorCode.STAGE_UNREACHABLE, why, now)
                elif req.admitted and req.parked:  # its caches there are gone too
                    self._fail(req, out, ErrorCode.STAGE_UNREACHABLE, why, now)
        finally:
            self.micro.holding = False
        for mb in range(len(self.micro.parked)):
            self._flush(mb, now, out)  # requests admitted meanwhile, if any are ready

    def _heard_since(self, ex: Exchange) -> bool:
        """Whether anything came back on the exchange's path after it was sent."""
        last = self._heard.get(ex.dest, float("-inf"))
        if ex.kind is RunResult:
            last = max(last, self._heard.get(self.final, float("-inf")))
        return last > ex.sent_at

    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        msg = send.msg
        nonces = msg.nonces if isinstance(msg, StepEntry) else (getattr(msg, "nonce", None),)
        if any(n in self._exchanges for n in nonces):
            for nonce in nonces:
                self._close(nonce, out, ErrorCode.STAGE_UNREACHABLE, reason, now)
        else:
            what = f"coordinator: {type(send.msg).__name__} to {send.dest}: {reason}"
            out.append(Warn("debug", what))
        return out

    def query(
        self, stage: str, now: float, timeout: float, reset: bool = True
    ) -> tuple[int, list[Effect]]:
        """Ask ``stage`` for its State; the answer comes as ``Answer(token, State | error)``."""
        nonce = self.exchanges.open(State, stage, "", 0, now, timeout=timeout, reset=reset)
        return nonce, [self._send(stage, QueryState(nonce))]

    def decode_overhead_ms(self) -> float:
        """Mean protocol time per decode step: wall time minus the stages' compute for it."""
        protocol_s = self.decode_wall_s - self.decode_compute_s
        return 1e3 * protocol_s / self.decode_steps if self.decode_steps else 0.0

    # --- the local side -----------------------------------------------------------------------
    def _on_entry(self, m: RunEntry, now: float, out: list[Effect]) -> None:
        rid = m.request_id
        if rid and rid in self.reqs:  # refused, not counted: that id's request runs on
            why = "request id already running"
            out.append(Deliver(Error(ErrorCode.BAD_REQUEST, why, rid, m.nonce)))
            return
        refused = admission_problem(m, self.down, self.vocab, self.max_len)
        if refused is not None:
            self.failed += 1
            out.append(Deliver(Error(*refused, rid, m.nonce)))
            return
        hit = None
        if self.prefixes is not None:  # only the request's own namespace: its tenant's
            hit = self.prefixes.lookup(m.cache_ns, m.token_ids, now)
        self.reqs[rid] = fresh(m, hit)
        self._waiting.append(rid)
        self._admit(now, out)

    def _admit(self, now: float, out: list[Effect]) -> None:
        while self._waiting and self.held < self.max_in_flight and not self.down:
            rid = self._waiting.popleft()
            req = self.reqs.get(rid)
            if req is None or req.state is not ReqState.WAITING:
                continue
            req.state = REQ_TABLE.next(req.state, ReqEvent.ADMIT)
            req.admitted = True
            self.micro.join(req)
            self.peak_in_flight = max(self.peak_in_flight, self.held)
            for stage in self.stages:
                nonce = self.exchanges.open(Ack, stage, rid, 0, now)
                req.pending.add(nonce)
                out.append(self._send(stage, claim(req, nonce)))

    def _cancel(self, rid: str, now: float, out: list[Effect]) -> None:
        req = self.reqs.get(rid)
        if req is not None:
            req.state = REQ_TABLE.next(req.state, ReqEvent.CANCEL)
            self._end(req, now, out)

    def _next_step(self, req: Req, now: float, out: list[Effect]) -> None:
        e = req.entry
        rid = e.request_id
        if not req.prefix:
            self.micro.park(req)
            self._flush(req.micro_batch, now, out)
            return
        step = self.prefill_step_size
        piece, req.prefix = req.prefix[:step], req.prefix[step:]
        req.state = REQ_TABLE.next(req.state, ReqEvent.SEND_CHUNK)
        nonce = self.exchanges.open(
            RunResult, self.stages[0], rid, req.micro_batch, now, len(piece), 0
        )
        msg = RunEntry(rid, req.micro_batch, piece, req.pos, e.sampling, nonce, sample=False)
        req.pending = {nonce}
        out.append(self._send(self.stages[0], msg))

    def _flush(self, mb: int, now: float, out: list[Effect]) -> None:
        """Micro-batch ``mb``'s parked decode steps as one StepEntry, once none is out."""
        ready = self.micro.release(mb)
        if not ready:
            return
        nonces = []
        for req in ready:
            req.state = REQ_TABLE.next(req.state, ReqEvent.SEND_STEP)
            nonce = self.exchanges.open(RunResult, self.stages[0], req.entry.request_id, mb, now, 1)
            req.pending = {nonce}
            nonces.append(nonce)
        for msg in step_entries(mb, ready, nonces):
            out.append(self._send(self.stages[0], msg))

    def _end(self, req: Req, now: float, out: list[Effect], keep: tuple[int, int] = (0, 0)) -> None:
        """The request left (finished, failed or cancelled): free its slot and its stages
        (each keeping its cache as the prompt-cache entry ``keep``: (id, positions))."""
        rid = req.entry.request_id
        self.reqs.pop(rid, None)
        self._leave(req, now, out, keep)
        self._flush(req.micro_batch, now, out)  # it may have been the step others waited for
        self._admit(now, out)

    def _leave(self, req: Req, now: float, out: list[Effect], keep: tuple[int, int]) -> None:
        rid = req.entry.request_id
        for nonce in req.pending:
            self._exchanges.pop(nonce, None)
        req.pending = set()
        self.micro.leave(req, req.admitted)
        self._unpin(req)
        if req.admitted:
            req.admitted = False
            # Best effort, briefly: a stage that misses it frees the sequence at its lease.
            release = ReleaseSequence(rid, *keep)
            out.extend(Send(s, release, deadline=now + 5.0) for s in self.stages)

    # --- the prompt cache ---------------------------------------------------------------------
    def _unpin(self, req: Req) -> None:
        if self.prefixes is not None and req.from_entry:
            self.prefixes.unpin(req.from_entry)
            req.from_entry = 0

    def _kept_as(self, req: Req, now: float, out: list[Effect]) -> tuple[int, int]:
        """A finished request's cache as a new prompt-cache entry: (id, positions), or (0, 0)
        when it is not kept (no cache, or its tokens are held already). What the entry makes
        redundant or pushes out is evicted everywhere first."""
        if self.prefixes is None or req.pos < 1:
            return 0, 0
        self._unpin(req)  # the entry it started from may be what its own entry replaces
        fed = (*req.entry.token_ids, *req.sampled)[: req.pos]  # the last token was never fed
        entry, gone = self.prefixes.insert(req.entry.cache_ns, fed, now)
        self._evict(gone, now, out)
        return (entry, req.pos) if entry else (0, 0)

    def _evict(self, entries: list[int], now: float, out: list[Effect]) -> None:
        """Every stage forgets ``entries``: ordered before any later keep on each stage's
        connection, with no deadline (an eviction lost would leave a stage holding what the
        index no longer names; a connection lost drops them all there anyway)."""
        for i in range(0, len(entries), MAX_EVICTIONS):
            msg = EvictPrefixes(tuple(entries[i : i + MAX_EVICTIONS]))
            out.extend(Send(s, msg) for s in self.stages)

    def _refill(self, req: Req, source: str, why: str, now: float, out: list[Effect]) -> None:
        """A stage lacks the cached prefix ``req`` started from (it restarted, or dropped the
        entry to stay within its own budget): the entry is forgotten everywhere and the request prefills in
        full, from the front of the queue. Never an error, never wrong tokens."""
        assert self.prefixes is not None
        entry = req.from_entry
        self.refilled += 1
        text = f"coordinator: {source} lacks prompt-cache entry {entry} ({why}): prefilling "
        out.append(Warn("prefix-mismatch", text + f"{req.entry.request_id} in full"))
        self._leave(req, now, out, (0, 0))
        self.prefixes.drop(entry)
        self._evict([entry], now, out)
        rid = req.entry.request_id
        self.reqs[rid] = fresh(req.entry)
        self._waiting.appendleft(rid)
        self._flush(req.micro_batch, now, out)
        self._admit(now, out)

    # --- exchanges ----------------------------------------------------------------------------
    @property
    def kept_alive(self) -> int:
        return self.exchanges.kept_alive

    def _send(self, dest: str, msg: PrepareSequence | RunEntry | StepEntry | QueryState) -> Send:
        """A message that opens exchanges: not worth sending after their deadline."""
        nonce = msg.nonces[0] if isinstance(msg, StepEntry) else msg.nonce
        return Send(dest, msg, deadline=self._exchanges[nonce].deadline)

    def _close(self, nonce: int, out: list[Effect], code: str, why: str, now: float) -> None:
        """Fail the exchange ``nonce``: its query is answered, or its request fails."""
        ex = self._exchanges.pop(nonce, None)
        if ex is None:
            return
        if not ex.request_id:
            out.append(Answer(nonce, PipelineError(code, why)))
            return
        req = self.reqs.get(ex.request_id)
        if req is not None and nonce in req.pending:
            self._fail(req, out, code, why, now)

    def _fail(self, req: Req, out: list[Effect], code: str, why: str, now: float) -> None:
        self.failed += 1
        e = req.entry
        out.append(Warn("warning", f"coordinator: request {e.request_id} failed: {why}"))
        out.append(Deliver(Error(code, why, e.request_id, e.nonce)))
        req.state = REQ_TABLE.next(req.state, ReqEvent.FAIL)
        self._end(req, now, out)

    def _drop(
        self, out: list[Effect], why: str, msg: Message, source: str, detail: str = ""
    ) -> None:
        self.dropped[why] += 1
        text = f"coordinator: dropping {type(msg).__name__} from {source}: {why}"
        out.append(Warn("coordinator-drop", text + (f" ({detail})" if detail else "")))

    # --- replies ------------------------------------------------------------------------------
    def _on_result(self, m: RunResult, source: str, now: float, out: list[Effect]) -> None:
        matched, problem = match_result(
            m, source == self.final, self._exchanges, self.return_logits, self.vocab
        )
        if matched is None:
            assert problem is not None
            return self._drop(out, problem[0], m, source, problem[1])
        self._took(*matched, picked(m), now, out)

    def _on_step_result(self, m: StepResult, source: str, now: float, out: list[Effect]) -> None:
        """A micro-batch's tokens: each row answers its own exchange (or is dropped alone)."""
        rows, dropped = step_rows(m, source == self.final, self._exchanges, self.return_logits)
        for why in dropped:
            self._drop(out, why, m, source)
        took: list[Effect] = []
        for nonce, ex, answer in rows:
            if nonce in self._exchanges:  # not ended by an earlier row's effects
                self._took(nonce, ex, answer, now, took)
        out += sends_first(took)

    def _took(self, nonce: int, ex: Exchange, m: Picked, now: float, out: list[Effect]) -> None:
        """Exchange ``nonce`` was answered by ``m``: the request moves on."""
        del self._exchanges[nonce]
        req = self.reqs[ex.request_id]
        req.state = REQ_TABLE.next(req.state, ReqEvent.RESULT)
        req.pending.discard(nonce)
        self.steps += 1
        if ex.tokens == 0:  # a prompt chunk filled the caches
            req.pos += ex.seq_len
            self._next_step(req, now, out)
            return
        self.micro.out[req.micro_batch].discard(ex.request_id)
        self.decode_steps += 1
        self.decode_wall_s += now - ex.sent_at
        self.decode_compute_s += m.compute_us / 1e6
        e = req.entry
        if self.return_logits:
            assert m.logits is not None and self.pick_token is not None
            token, req.picker = self.pick_token(m.logits, e.sampling, req.picker)
            lp = None
        else:
            assert m.token is not None
            token, lp = m.token, m.logprobs
        req.pos += ex.seq_len
        req.generated += 1
        req.sampled.append(token)
        rid = e.request_id
        cached = req.cached if req.generated == 1 else 0
        if token in self.eos:
            out.append(Deliver(RunResult(rid, e.micro_batch, (), "stop", e.nonce,
                                         cached_tokens=cached)))  # fmt: skip
        else:
            finish = "length" if req.generated >= e.sampling.max_tokens else None
            out.append(Deliver(for_client(e, token, finish, lp, m, cached)))
            if finish is None:
                req.next_tokens = (token,)
                self._next_step(req, now, out)
                return
        req.state = REQ_TABLE.next(req.state, ReqEvent.FINISH)
        self.completed += 1
        self._end(req, now, out, self._kept_as(req, now, out))

    def _on_reply(self, m: Ack | State, source: str, now: float, out: list[Effect]) -> None:
        ex = self._exchanges.get(m.nonce)
        if ex is None or ex.kind is not type(m):
            self._drop(out, "stale or unknown nonce", m, source)
            return
        if source != ex.dest:
            self._drop(out, "not from the stage the exchange addressed", m, source, ex.dest)
            return
        del self._exchanges[m.nonce]
        if isinstance(m, State):
            out.append(Answer(m.nonce, m))
            return
        req = self.reqs[ex.request_id]
        req.state = REQ_TABLE.next(req.state, ReqEvent.ACK)
        req.pending.discard(m.nonce)
        if not req.pending:
            self._next_step(req, now, out)

    def _on_progress(self, m: Progress, source: str, now: float, out: list[Effect]) -> None:
        """A stage still holds these steps: slow, not silent, so their deadlines restart."""
        if len(m.nonces) > len(self._exchanges):  # bounded work for any list it is sent
            return self._drop(out, "Progress names more exchanges than are waiting", m, source)
        for nonce in set(m.nonces):  # one that crossed its result is ignored
            if (ex := self._exchanges.get(nonce)) is not None and ex.kind is RunResult:
                ex.deadline, ex.reported = now + self.step_timeout, True

    def _on_error(self, m: Error, source: str, now: float, out: list[Effect]) -> None:
        ex = self._exchanges.get(m.nonce) if m.nonce is not None else None
        if (
            ex is None
            or source not in self.stages
            or ex.request_id != (m.request_id or ex.request_id)
        ):
            self._drop(out, "unmatched error", m, source, f"{m.code}: {m.message[:200]}")
            return
        if ex.kind is not RunResult and source != ex.dest:
            self._drop(out, "not from the stage the exchange addressed", m, source, ex.dest)
            return
        assert m.nonce is not None
        req = self.reqs.get(ex.request_id)
        if m.code == ErrorCode.PREFIX_NOT_CACHED and req is not None and req.from_entry:
            if m.nonce in req.pending and not req.generated:
                return self._refill(req, source, m.message[:200], now, out)
        self._close(m.nonce, out, m.code, f"{source}: {m.message}", now)
