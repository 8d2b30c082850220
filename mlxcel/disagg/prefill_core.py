"""The prefill node's protocol core: admit a prompt, hand its cache off under a lease.

Per request, in order and before any compute: the model's cache family must be handoff-able;
the decode target (the request's, else the first ``--decode-peers``) must exist and, when the
request named it and ``MLXCEL_DECODE_ALLOWLIST`` is set, be on the allowlist; the tokens must
fit the model. Then the prompt runs (``StartCompute``); the first token goes to the router and
the packed cache to the decode node. The cache stays held (the lease) until the decode node
acknowledges it -- then the prefill commits and frees it -- or the lease expires, the send
fails, the decode node refuses it or is lost, or the router cancels: each of those ends the
request with an error at the router and an abort verdict to the decode node.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from mlxcel.base.effects import Effect, FreeCache, Send, StartCompute, Warn
from mlxcel.base.handoff import Packed, Piece, digest_of, part_of, plan_parts
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    HandoffAck,
    HandoffVerdict,
    KvHandoff,
    Message,
    PrefillRequest,
    Progress,
    QueryState,
    SlotAnswer,
    SlotRequest,
    State,
    TokenResult,
    prompt_problem,
)
from mlxcel.disagg.protocol import (
    LEASE,
    LEASE_BYTES_PER_S,
    LEASE_MAX,
    LEASE_TABLE,
    MAX_PARTS,
    MAX_TOMBSTONES,
    PART_BYTES,
    PART_WINDOW,
    LeaseEvent,
    LeaseState,
    PrefillJob,
)


@dataclass
class Lease:
    id: int
    router: str
    request: PrefillRequest
    target: str
    state: LeaseState = LeaseState.COMPUTING
    expires: float | None = None
    held: Packed | None = None  # the cache, while the lease lasts
    sent_at: float = 0.0  # when its handoff went out (for the handoff time)
    handoff: KvHandoff | None = None  # the whole handoff, cut into parts as they go out
    plan: list[list[Piece]] = dataclasses.field(default_factory=list)
    next_part: int = 0  # the next part to hand to the outbox
    writing: int = 0  # parts handed over and not yet written
    told_router: float = 0.0  # when a Progress last told the router it moves
    slot: bool | None = None  # the decode node holds a slot for it (None: not answered yet)


@dataclass(frozen=True)
class PrefillConfig:
    decode_peers: tuple[str, ...] = ()
    allowlist: frozenset[str] | None = None  # None: permissive
    unsupported: str | None = None  # why this model cannot hand off (None: it can)
    vocab: int = 1 << 30
    max_len: int = 1 << 30
    lease: float = LEASE  # a handoff's lease past its last progress (--handoff-lease)
    lease_max: float = LEASE_MAX  # and its whole life at most (--handoff-lease-max)
    max_sequences: int = 64
    # Tensor bytes in one handoff message (0: 1/64 of the cache, within PART_BYTES): small
    # parts let other handoffs to the same node through between them.
    part_bytes: int = 0


class PrefillCore:
    def __init__(
        self,
        config: PrefillConfig,
        *,
        first_lease: int = 1,
        counters: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.config = config
        self.counters = counters  # State fields the node keeps: its KV cache
        self.draining = False  # shutting down: no new prompts (the router stops sending)
        self.told_draining = False  # a State saying so went out
        self.queried = False  # a router asked for a State: one may be sending it work
        self.handoff_s = 0.0  # total time of acknowledged handoffs, send to ack
        self.leases: dict[int, Lease] = {}
        # A request's one id (its router's) -> its lease: unique on this node, whichever
        # router named it, so the engine knows the prompt by that id too.
        self._by_id: dict[str, int] = {}
        self._ids = itertools.count(first_lease)
        self._finished: dict[tuple[str, str, int], None] = {}  # bounded, oldest first
        self.counts: Counter[str] = Counter()

    @property
    def finished(self) -> int:
        """How many finished requests it remembers (bounded: a late duplicate is refused)."""
        return len(self._finished)

    @property
    def active(self) -> int:
        return len(self.leases)

    def next_timer(self) -> float | None:
        return min((x.expires for x in self.leases.values() if x.expires), default=None)

    # --- inputs -----------------------------------------------------------------------------
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        if isinstance(msg, PrefillRequest):
            return self._request(msg, source)
        if isinstance(msg, HandoffAck):
            return self._ack(msg, source, now)
        if isinstance(msg, SlotAnswer):
            return self._slot_answer(msg, source)
        if isinstance(msg, QueryState):  # figures for the router's stats (no secrets)
            st = State(
                "prefill", (), self.active, self.draining, msg.nonce, **self.counters(),
                handoffs=self.counts["committed"], handoff_us=int(self.handoff_s * 1e6),
            )  # fmt: skip
            self.told_draining |= self.draining
            self.queried = True
            return [Send(source, st)]
        if isinstance(msg, CancelRequest):
            lid = self._by_id.get(msg.request_id)
            if lid is None or self.leases[lid].router != source:
                return []  # unknown, ended, or another router's: changes nothing
            self.counts["cancelled"] += 1
            return self._end(self.leases[lid], LeaseEvent.CANCELLED, abort="cancelled")
        return [Warn("debug", f"prefill: ignoring {type(msg).__name__} from {source}")]

    def _request(self, m: PrefillRequest, source: str) -> list[Effect]:
        c = self.config

        def refuse(code: str, why: str) -> list[Effect]:
            self.counts["refused"] += 1
            return [Send(source, Error(code, why, m.request_id, m.nonce))]

        if c.unsupported is not None:
            return refuse(ErrorCode.UNSUPPORTED_MODEL, c.unsupported)
        if (source, m.request_id, m.nonce) in self._finished:
            return []  # a repeat of a request this node already ran: never run a prompt twice
        held = self._by_id.get(m.request_id)
        if held is not None:
            x = self.leases[held]
            if x.router == source and x.request.nonce == m.nonce:
                return []  # the same request again: it is running already
            return refuse(ErrorCode.BAD_REQUEST, f"request {m.request_id!r} is already running")
        if self.draining:
            return refuse(ErrorCode.DRAINING, "this prefill node is shutting down")
        target = m.decode_target or (c.decode_peers[0] if c.decode_peers else "")
        if not target:
            return refuse(
                ErrorCode.HANDOFF_FAILED,
                "no decode target: the request names none and this node has no --decode-peers",
            )
        if m.decode_target and c.allowlist is not None and m.decode_target not in c.allowlist:
            why = (
                f"decode target {m.decode_target} is not in MLXCEL_DECODE_ALLOWLIST; the KV "
                "cache was not sent"
            )
            log = Warn(
                "diagnostic", f"prefill: refused request {m.request_id!r} from {source}: {why}"
            )
            return [log, *refuse(ErrorCode.DECODE_TARGET_REFUSED, why)]
        problem = prompt_problem(m.token_ids, m.sampling.max_tokens, c.vocab, c.max_len)
        if problem is not None:
            return refuse(ErrorCode.BAD_REQUEST, problem)
        if len(self.leases) >= c.max_sequences:
            return refuse(ErrorCode.TOO_MANY_SEQUENCES, "this prefill node is full")
        lease = Lease(next(self._ids), source, m, target)
        self.leases[lease.id] = lease
        self._by_id[m.request_id] = lease.id
        self.counts["accepted"] += 1
        one = dataclasses.replace(m.sampling, max_tokens=1)
        # The decode node is asked for a slot as the prompt starts: a full one says so while
        # the prompt runs -- before the first token reaches the client -- and the router
        # starts the request elsewhere.
        ask = SlotRequest(m.request_id, lease.id, source) if m.sampling.max_tokens > 1 else None
        lease.slot = None if ask is not None else False
        return ([Send(target, ask)] if ask else []) + [
            StartCompute(PrefillJob(lease.id, m.request_id, m.token_ids, one, m.cache_ns))
        ]

    def _lease_at(
        self, lease: int, request_id: str, source: str, state: LeaseState
    ) -> Lease | None:
        """Lease ``lease``, if it is ``request_id``'s, in ``state``, and ``source`` its decode
        node: what an answer from a decode node must name (anything else is not for it)."""
        x = self.leases.get(lease)
        if x is None or x.target != source or x.request.request_id != request_id:
            return None
        return x if x.state is state else None

    def _slot_answer(self, a: SlotAnswer, source: str) -> list[Effect]:
        x = self._lease_at(a.lease, a.request_id, source, LeaseState.COMPUTING)
        if x is None or x.slot is not None:
            self.counts["stray_slot_answers"] += 1
            return []
        if not a.ok:
            self.counts["decode_refused"] += 1
            why = f"decode node {x.target} will not take the handoff: {a.reason}"
            x.slot = False
            return self._fail(x, ErrorCode.DECODE_REFUSED, why)  # before token 0: retryable
        x.slot = True
        return []

    def compute_done(
        self,
        lease_id: int,
        token_ids: tuple[int, ...],
        finish: str | None,
        logprobs: tuple[float, ...] | None,
        packed: Packed | None,
        key_state: tuple[int, ...],
        now: float,
        top: tuple[tuple[int, ...], tuple[float, ...]] | None = None,
        cached: int = 0,
        kept: bool = False,
    ) -> list[Effect]:
        """The prompt ran: ``token_ids`` is the first token (empty at end of sequence);
        ``top``: its top_logprobs alternatives (ids, logprobs), when asked for; ``cached``:
        the prompt tokens the prompt cache supplied; ``kept``: the engine keeps the prompt
        in its cache now (told to the router, which routes the next turn by it)."""
        x = self.leases.get(lease_id)
        if x is None:
            return []  # cancelled (or refused by the decode node) as it ran: freed then
        m = x.request
        final = finish == "stop" or m.sampling.max_tokens == 1
        # No answer from the decode node yet (a slow or busy link): go on rather than hold
        # token 0 for a round trip. The slot request is ahead of the handoff on the same
        # connection, so the decode node has answered it by the time the handoff arrives.
        first = TokenResult(
            m.request_id,
            0,
            token_ids,
            finish if final else None,
            m.nonce,
            logprobs,
            *(top or (None, None)),
            cached_tokens=cached,
            kept=kept,
        )
        out: list[Effect] = [Send(x.router, first)]
        if final:
            self.counts["finished"] += 1
            return out + self._end(x, LeaseEvent.FINISHED)
        if packed is None or not token_ids:
            return out + self._fail(x, ErrorCode.FORWARD_FAILED, "the prompt left no KV cache")
        rest = dataclasses.replace(
            m.sampling,
            max_tokens=m.sampling.max_tokens - 1,
            min_tokens=max(0, m.sampling.min_tokens - 1),  # the first token was held too
        )
        h = KvHandoff(
            m.request_id,
            x.id,
            x.router,
            m.nonce,
            packed.first_token,
            rest,
            key_state,
            packed.prompt_len,
            packed.keys,
            packed.values,
            b"",
            context=m.token_ids,  # penalties look back on it; a decode node keeps it
            cache_ns=m.cache_ns,
        )
        h = dataclasses.replace(h, digest=digest_of(h, packed.tensors))
        plan = plan_parts(h, self._part_bytes(packed.nbytes))
        if len(plan) > MAX_PARTS:  # half a terabyte: no decode node would take it
            why = f"this prompt's KV cache ({packed.nbytes} bytes) needs {len(plan)} parts"
            return out + self._fail(x, ErrorCode.HANDOFF_FAILED, f"{why}; at most {MAX_PARTS}")
        x.state = LEASE_TABLE.next(x.state, LeaseEvent.HANDED_OFF)
        x.held, x.sent_at, x.told_router = packed, now, now
        x.handoff, x.plan = h, plan
        x.expires = now + self.config.lease  # renewed by every part written
        self.counts["handed_off"] += 1
        return out + self._write_parts(x)

    def _part_bytes(self, nbytes: int) -> int:
        if self.config.part_bytes:
            return self.config.part_bytes
        low, high = PART_BYTES
        return min(high, max(low, nbytes // 256))

    def _write_parts(self, x: Lease) -> list[Effect]:
        """Hand the outbox the next parts, up to PART_WINDOW of them unwritten: parts of other
        handoffs to the same node queue between them, so none waits for a whole cache."""
        out: list[Effect] = []
        assert x.handoff is not None
        while x.next_part < len(x.plan) and x.writing < PART_WINDOW:
            part = part_of(x.handoff, x.plan, x.next_part)
            # Queued behind other handoffs' parts, it may wait longer than a lease (which
            # every part written to that node renews); never past the handoff's maximum.
            cap = x.sent_at + self.config.lease_max
            out.append(Send(x.target, part, deadline=cap, notify=True))
            x.next_part += 1
            x.writing += 1
        return out

    def sent(self, send: Send, now: float) -> list[Effect]:
        """A part of a handoff was written: its lease is renewed, and the next part goes."""
        m = send.msg
        x = self.leases.get(m.lease) if isinstance(m, KvHandoff) else None
        if x is None or x.state is not LeaseState.LEASED or x.target != send.dest:
            return []
        x.writing -= 1
        cap = x.sent_at + self.config.lease_max
        # Bytes move on the link to that node: every handoff still being written to it is
        # making progress too (theirs wait in the same queue), so all their leases renew.
        for other in self.leases.values():
            if other is not x and other.target == x.target and other.handoff is not None:
                other.expires = min(other.sent_at + self.config.lease_max, now + self.config.lease)
        if x.next_part < len(x.plan) or x.writing:
            x.expires = min(cap, now + self.config.lease)
            out = self._write_parts(x)
        else:  # all written: the ack comes once the decode node has checked every byte
            assert x.held is not None
            x.expires = min(cap, now + self.config.lease + x.held.nbytes / LEASE_BYTES_PER_S)
            x.handoff, x.plan = None, []
            out = []
        if now - x.told_router >= 1.0:  # the router's handoff deadline moves with it
            x.told_router = now
            out.append(Send(x.router, Progress((x.request.nonce,))))
        return out

    def compute_failed(self, lease_id: int, why: str, now: float) -> list[Effect]:
        x = self.leases.get(lease_id)
        if x is None:
            return []  # ended as it ran: freed then
        return self._fail(x, ErrorCode.FORWARD_FAILED, f"prefill failed: {why}")

    def _ack(self, a: HandoffAck, source: str, now: float) -> list[Effect]:
        x = self._lease_at(a.lease, a.request_id, source, LeaseState.LEASED)
        if x is None:
            # Not a lease held for that node (expired, cancelled, someone else's): the decode
            # node must not read it.
            self.counts["late_acks"] += 1
            return [Send(source, HandoffVerdict(a.request_id, a.lease, False, "no such lease"))]
        if not a.ok:
            return self._fail(
                x,
                ErrorCode.HANDOFF_FAILED,
                f"decode node {x.target} refused the handoff: {a.reason}",
                event=LeaseEvent.REFUSED,
            )
        self.counts["committed"] += 1
        self.handoff_s += now - x.sent_at
        commit = HandoffVerdict(a.request_id, a.lease, True)
        return [Send(x.target, commit)] + self._end(x, LeaseEvent.ACKED)

    def on_timer(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        for x in [x for x in self.leases.values() if x.expires and x.expires <= now]:
            self.counts["expired"] += 1
            out += self._fail(
                x,
                ErrorCode.HANDOFF_TIMEOUT,
                self._expiry(x, now),
                event=LeaseEvent.EXPIRED,
            )
        return out

    def _expiry(self, x: Lease, now: float) -> str:
        if now >= x.sent_at + self.config.lease_max:
            return (
                f"handoff lease expired: the KV cache did not reach decode node {x.target} "
                f"and get acknowledged within {self.config.lease_max:g}s (--handoff-lease-max)"
            )
        if x.handoff is not None:
            return (
                f"handoff lease expired: no part of the KV cache could be written to decode "
                f"node {x.target} for {self.config.lease:g}s (part {x.next_part - x.writing} "
                f"of {len(x.plan)}; --handoff-lease)"
            )
        return (
            f"handoff lease expired: decode node {x.target} never acknowledged the KV cache "
            f"after its last byte was written"
        )

    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]:
        m = send.msg
        if isinstance(m, KvHandoff):
            x = self.leases.get(m.lease)
            if x is not None and x.state is LeaseState.LEASED:
                # The decode node cannot be reached: retryable (503), not a broken handoff.
                return self._fail(
                    x, ErrorCode.NODE_UNREACHABLE, f"handoff to decode node {x.target}: {reason}"
                )
        return []

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        # A lost router changes nothing: its cancels still reach us, and the lease timer bounds
        # every handoff. A lost decode node fails the handoffs it had not acknowledged.
        for x in list(self.leases.values()):
            if x.target == identity and x.state is LeaseState.LEASED:
                why = f"decode node {x.target} was lost before it acknowledged the handoff"
                m = x.request
                err = Error(ErrorCode.NODE_UNREACHABLE, why, m.request_id, m.nonce)
                # No abort verdict: the node is gone, and a send to it would only wait.
                out += [Send(x.router, err)] + self._end(x, LeaseEvent.FAILED)
        return out

    # --- endings ----------------------------------------------------------------------------
    def _fail(
        self, x: Lease, code: str, why: str, event: LeaseEvent = LeaseEvent.FAILED
    ) -> list[Effect]:
        m = x.request
        err = Error(code, why, m.request_id, m.nonce)
        return [Send(x.router, err)] + self._end(x, event, abort=why)

    def _end(self, x: Lease, event: LeaseEvent, abort: str | None = None) -> list[Effect]:
        leased = x.state is LeaseState.LEASED
        x.state = LEASE_TABLE.next(x.state, event)
        self.leases.pop(x.id, None)
        self._by_id.pop(x.request.request_id, None)
        self._finished[(x.router, x.request.request_id, x.request.nonce)] = None
        if len(self._finished) > MAX_TOMBSTONES:
            self._finished.pop(next(iter(self._finished)))
        x.held, x.handoff, x.plan = None, None, []
        out: list[Effect] = [FreeCache(x.request.request_id)]
        if not leased and x.slot is not False:  # a slot held (or asked for) there: free it
            abort = abort or "no handoff: the request ended at its first token"
        if (leased or x.slot is not False) and abort is not None:
            verdict = HandoffVerdict(x.request.request_id, x.id, False, abort[:200])
            out.append(Send(x.target, verdict))
        return out
