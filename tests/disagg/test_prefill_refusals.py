"""Every refusal, lease ending and bound of the prefill node's core, compared exactly.

The whole effect list is compared: what the router is told (code, text, id, nonce), what the
decode node is told (the verdict and its reason), what the compute side frees, and the
counters. See tests/disagg/test_router_refusals.py for why.
"""

from __future__ import annotations

import dataclasses

from mlxcel.base.effects import FreeCache, Send, StartCompute, Warn
from mlxcel.base.handoff import Packed, digest_of, tensor_digest
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    HandoffAck,
    HandoffVerdict,
    KvHandoff,
    PrefillRequest,
    Progress,
    QueryState,
    RunEntry,
    SamplingParams,
    SlotAnswer,
    SlotRequest,
    State,
    Tensor,
    TokenResult,
)
from mlxcel.disagg.prefill_core import PrefillConfig, PrefillCore
from mlxcel.disagg.protocol import MAX_PARTS, MAX_TOMBSTONES, PrefillJob

R = "127.0.0.6:9000"  # the router
D0, D1 = "127.0.0.4:9000", "127.0.0.5:9000"
STRANGER = "127.0.0.9:9000"
NONCE = 42
K = Tensor("float32", (1, 1, 3, 2), bytes(range(24)))
PACKED = Packed(3, 9, (K,), (K,), tensor_digest((K,), (K,)))


def core(**kw: object) -> PrefillCore:
    base: dict = dict(decode_peers=(D0,), vocab=100, max_len=64, lease=5.0, max_sequences=2)
    return PrefillCore(PrefillConfig(**{**base, **kw}))


def request(
    rid: str = "r1",
    target: str = D1,
    tokens: tuple[int, ...] = (1, 2, 3),
    max_tokens: int = 4,
    nonce: int = NONCE,
) -> PrefillRequest:
    return PrefillRequest(rid, tokens, SamplingParams(max_tokens=max_tokens), target, nonce)


def admit(c: PrefillCore, m: PrefillRequest, now: float = 0.0, slot: bool = True) -> int:
    """Admitted: the decode node is asked for a slot as the prompt starts (and, ``slot``,
    says yes before the prompt is done)."""
    out = c.handle(m, R, now)
    e = out[-1]
    assert isinstance(e, StartCompute) and isinstance(e.job, PrefillJob)
    if m.sampling.max_tokens > 1:
        assert out[0] == Send(m.decode_target or D0, SlotRequest(m.request_id, e.job.lease, R))
        if slot:
            ok = SlotAnswer(m.request_id, e.job.lease, True)
            assert c.handle(ok, m.decode_target or D0, now) == []
    return e.job.lease


def handoff_of(m: PrefillRequest, lease: int, target_sampling: int, key_state=()) -> KvHandoff:
    h = KvHandoff(
        m.request_id,
        lease,
        R,
        m.nonce,
        9,
        SamplingParams(max_tokens=target_sampling),
        key_state,
        3,
        (K,),
        (K,),
        b"",
        context=m.token_ids[-20:],  # the prompt's tail: what the decode node's penalties see
    )
    return dataclasses.replace(h, digest=digest_of(h, PACKED.tensors))


def leased(c: PrefillCore, m: PrefillRequest, now: float = 0.0) -> int:
    lease = admit(c, m, now)
    c.compute_done(lease, (9,), "length", None, PACKED, (), now)
    return lease


def refused(m: PrefillRequest, code: str, why: str) -> list:
    return [Send(R, Error(code, why, m.request_id, m.nonce))]


def test_each_refusal_comes_before_any_work_with_its_own_code_and_reason() -> None:
    c = core(decode_peers=())
    ctx = "exceeds the model's context of 64"
    cases = [
        (
            request(target=""),
            ErrorCode.HANDOFF_FAILED,
            "no decode target: the request names none and this node has no --decode-peers",
        ),
        (request("e", tokens=()), ErrorCode.BAD_REQUEST, "empty prompt"),
        (
            request("n", tokens=(0, -1)),
            ErrorCode.BAD_REQUEST,
            "token id outside the vocabulary [0, 100)",
        ),
        (
            request("v", tokens=(100,)),
            ErrorCode.BAD_REQUEST,
            "token id outside the vocabulary [0, 100)",
        ),
        (request("z", max_tokens=0), ErrorCode.BAD_REQUEST, "max_tokens must be >= 1"),
        (
            request("l", tokens=(1,) * 60, max_tokens=5),
            ErrorCode.BAD_REQUEST,
            f"prompt (60 tokens) + max_tokens (5) {ctx}",
        ),
    ]
    for m, code, why in cases:
        assert c.handle(m, R, 0.0) == refused(m, code, why)
    assert c.counts == {"refused": len(cases)} and c.active == 0
    # The edges pass: token 0 and 99, max_tokens 1, prompt + max_tokens == the context.
    for m in (request("lo", tokens=(0, 99), max_tokens=1), request("fit", tokens=(1,) * 60)):
        lease = len(c.leases) + 1
        one = SamplingParams(max_tokens=1)
        ask = [Send(D1, SlotRequest(m.request_id, lease, R))] if m.sampling.max_tokens > 1 else []
        assert c.handle(m, R, 0.0) == [
            *ask,
            StartCompute(PrefillJob(lease, m.request_id, m.token_ids, one)),
        ]
    # Full at max_sequences (2): refused, and the next after one ends is accepted.
    assert c.handle(request("x"), R, 0.0) == refused(
        request("x"), ErrorCode.TOO_MANY_SEQUENCES, "this prefill node is full"
    )
    assert c.counts == {"refused": len(cases) + 1, "accepted": 2}


def test_an_unsupported_model_and_an_allowlist_refuse_with_their_reasons() -> None:
    why = "model family 'gemma3' keeps RotatingKVCache state"
    c = core(unsupported=why)
    assert c.handle(request(), R, 0.0) == refused(request(), ErrorCode.UNSUPPORTED_MODEL, why)
    c = core(allowlist=frozenset({D0}))
    why = f"decode target {D1} is not in MLXCEL_DECODE_ALLOWLIST; the KV cache was not sent"
    # The operator hears of it too (rate limited), not only the router.
    assert c.handle(request(target=D1), R, 0.0) == [
        Warn("diagnostic", f"prefill: refused request 'r1' from {R}: {why}"),
        *refused(request(), ErrorCode.DECODE_TARGET_REFUSED, why),
    ]


def test_a_request_repeated_while_it_runs_or_after_it_ended_never_runs_twice() -> None:
    c = core()
    lease = admit(c, request())
    assert c.handle(request(), R, 0.1) == []  # the same request again: it runs already
    assert c.handle(request(nonce=NONCE + 1), R, 0.1) == refused(
        request(nonce=NONCE + 1), ErrorCode.BAD_REQUEST, "request 'r1' is already running"
    )
    assert list(c.leases) == [lease]
    # A request's id is its one id on this node while it runs, whichever router names it
    # (the engine knows the prompt by it): another router's request under it is refused.
    assert c.handle(request(), STRANGER, 0.2) == [
        Send(STRANGER, Error(ErrorCode.BAD_REQUEST, "request 'r1' is already running", "r1", NONCE))
    ]
    c.compute_done(lease, (5,), "stop", None, PACKED, (), 0.3)
    assert c.handle(request(), R, 0.4) == []  # ran already: never again
    lease2 = admit(c, request(nonce=NONCE + 1), 0.5)  # a new nonce is a new request
    assert lease2 == lease + 1


def test_the_first_tokens_alternatives_go_back_with_it_and_the_handoff_carries_the_prompt() -> None:
    c = core()
    m = request(tokens=tuple(range(30)))
    lease = admit(c, m)
    out = c.compute_done(lease, (9,), "length", (-0.5,), PACKED, (), 1.0, ((9, 4), (-0.5, -1.5)))
    assert out[0] == Send(R, TokenResult("r1", 0, (9,), None, NONCE, (-0.5,), (9, 4), (-0.5, -1.5)))
    handoff = out[1].msg  # type: ignore[union-attr]
    # All of it: penalties look back on it, and a decode node keeps the conversation under it
    assert handoff.context == tuple(range(30)) and handoff.cache_ns == m.cache_ns


def test_the_first_token_ends_the_request_on_stop_or_a_one_token_budget() -> None:
    c = core()
    for rid, finish, budget in (("a", "stop", 4), ("b", "length", 1)):
        m = request(rid, max_tokens=budget)
        lease = admit(c, m)
        out = c.compute_done(lease, (7,), finish, (-0.25,), PACKED, (), 0.1)
        first = TokenResult(rid, 0, (7,), finish, NONCE, (-0.25,))
        # The slot the decode node held for it (asked only with more than one token to go)
        # is given back.
        why = "no handoff: the request ended at its first token"
        give_back = [Send(D1, HandoffVerdict(rid, lease, False, why))] if budget > 1 else []
        assert out == [Send(R, first), FreeCache(rid), *give_back]
    assert c.counts == {"accepted": 2, "finished": 2} and c.active == 0


def test_a_decode_node_that_refuses_a_slot_fails_the_request_before_its_first_token() -> None:
    """Asked as the prompt starts, the decode node says it is full: the router hears it with
    a retryable code before any token went out (it starts the request elsewhere), and the
    prompt's result, when it comes, is dropped."""
    c = core()
    m = request()
    lease = admit(c, m, slot=False)
    assert c.handle(SlotAnswer("r1", lease, False, "x"), STRANGER, 0.1) == []  # not its target
    assert c.handle(SlotAnswer("other", lease, False, "x"), D1, 0.1) == []  # not its request
    why = f"decode node {D1} will not take the handoff: decode node full (256 sequences)"
    assert c.handle(
        SlotAnswer("r1", lease, False, "decode node full (256 sequences)"), D1, 0.2
    ) == [
        Send(R, Error(ErrorCode.DECODE_REFUSED, why, "r1", NONCE)),
        FreeCache("r1"),
    ]
    assert c.compute_done(lease, (9,), "length", None, PACKED, (), 0.3) == []
    assert c.counts["decode_refused"] == 1 and c.counts["stray_slot_answers"] == 2


def test_a_prompt_done_before_the_slot_answer_does_not_wait_for_it() -> None:
    """On a slow or busy link the answer may come after the prompt ran: token 0 and the
    handoff go at once (a round trip held back would be latency on every request), behind
    the slot request on the same connection; a late refusal is the handoff's to answer."""
    c = core()
    m = request()
    lease = admit(c, m, slot=False)
    out = c.compute_done(lease, (9,), "length", None, PACKED, (), 1.0)
    assert out == [
        Send(R, TokenResult("r1", 0, (9,), None, NONCE)),
        Send(D1, handoff_of(m, lease, 3), deadline=601.0, notify=True),
    ]
    assert c.handle(SlotAnswer("r1", lease, False, "full"), D1, 1.5) == []  # too late: stray
    assert c.counts["stray_slot_answers"] == 1 and c.leases[lease].state.value == "leased"


def test_the_handoff_carries_the_rest_of_the_request_under_a_lease_deadline() -> None:
    c = core()
    m = request()
    lease = admit(c, m)
    out = c.compute_done(lease, (9,), "length", (-0.5,), PACKED, (1, 2), 2.0)
    h = handoff_of(m, lease, 3, (1, 2))
    assert out == [
        Send(R, TokenResult("r1", 0, (9,), None, NONCE, (-0.5,))),
        Send(D1, h, deadline=602.0, notify=True),
    ]
    assert c.next_timer() == 7.0 and c.counts == {"accepted": 1, "handed_off": 1}
    # Written: the ack is awaited, with a second per 100 MB for the decode node's checks.
    assert c.sent(Send(D1, h, deadline=602.0, notify=True), 3.0) == [Send(R, Progress((NONCE,)))]
    assert c.next_timer() == 3.0 + 5.0 + PACKED.nbytes / 100e6


def test_a_handoff_in_parts_goes_a_part_at_a_time_and_each_part_written_renews_its_lease() -> None:
    c = core(part_bytes=8, lease_max=100.0)  # 8 bytes: 6 parts of one row
    m = request()
    lease = admit(c, m)
    out = c.compute_done(lease, (9,), "length", None, PACKED, (), 0.0)
    parts = [e for e in out if isinstance(e, Send) and isinstance(e.msg, KvHandoff)]
    assert [(p.msg.part, p.msg.parts, p.deadline, p.notify) for p in parts] == [(0, 6, 100.0, True)]
    assert c.sent(Send(STRANGER, parts[0].msg), 0.5) == []  # not where it went: nothing
    nxt = c.sent(parts[0], 0.5)  # written at 0.5 s: the next part goes, the lease renewed
    assert [(e.msg.part, e.deadline) for e in nxt] == [(1, 100.0)]
    assert c.next_timer() == 5.5
    more = c.sent(nxt[0], 1.5)  # a second later: the router hears the handoff moves
    assert [type(e.msg).__name__ for e in more] == ["KvHandoff", "Progress"]
    assert more[1] == Send(R, Progress((NONCE,)))
    # No part written for the lease's 5 s: it expires, naming where it stood.
    why = (
        f"handoff lease expired: no part of the KV cache could be written to decode node {D1} "
        "for 5s (part 2 of 6; --handoff-lease)"
    )
    assert c.on_timer(6.5) == [
        Send(R, Error(ErrorCode.HANDOFF_TIMEOUT, why, "r1", NONCE)),
        FreeCache("r1"),
        Send(D1, HandoffVerdict("r1", lease, False, why[:200])),
    ]
    assert c.sent(more[0], 7.0) == []  # a part of a lease that ended: nothing more goes


def test_a_handoff_that_keeps_moving_still_ends_at_its_maximum() -> None:
    c = core(part_bytes=8, lease_max=12.0)
    lease = admit(c, request())
    out = c.compute_done(lease, (9,), "length", None, PACKED, (), 0.0)
    pending = [e for e in out if isinstance(e, Send) and isinstance(e.msg, KvHandoff)]
    t = 0.0
    while pending:  # a part written every 4 s: each renews the lease, up to 12 s in all
        t += 4.0
        if c.next_timer() is not None and c.next_timer() <= t:  # type: ignore[operator]
            break
        pending += [e for e in c.sent(pending.pop(0), t) if isinstance(e.msg, KvHandoff)]
    assert c.next_timer() == 12.0
    (err, *_) = c.on_timer(12.0)
    assert err.msg.code == ErrorCode.HANDOFF_TIMEOUT and "within 12s" in err.msg.message


def test_a_prompt_that_left_no_cache_or_no_token_fails_without_a_handoff() -> None:
    c = core(max_sequences=4)
    for rid, tokens, packed in (("a", (9,), None), ("b", (), PACKED)):
        m = request(rid)
        lease = admit(c, m)
        out = c.compute_done(lease, tokens, "length", None, packed, (), 0.1)
        assert out == [
            Send(R, TokenResult(rid, 0, tokens, None, NONCE)),
            Send(R, Error(ErrorCode.FORWARD_FAILED, "the prompt left no KV cache", rid, NONCE)),
            FreeCache(rid),
            Send(D1, HandoffVerdict(rid, lease, False, "the prompt left no KV cache")),
        ]
    assert c.active == 0


def test_compute_that_fails_or_ends_after_a_cancel_frees_the_cache() -> None:
    c = core()
    lease = admit(c, request())
    assert c.compute_failed(lease, "out of memory", 0.1) == [
        Send(R, Error(ErrorCode.FORWARD_FAILED, "prefill failed: out of memory", "r1", NONCE)),
        FreeCache("r1"),
        Send(D1, HandoffVerdict("r1", lease, False, "prefill failed: out of memory")),
    ]
    assert c.compute_failed(lease, "again", 0.2) == []
    lease = admit(c, request("r2"))
    assert c.handle(CancelRequest("r2", "x"), STRANGER, 0.3) == []  # not its router
    assert c.handle(CancelRequest("r2", "client went away"), R, 0.3) == [
        FreeCache("r2"),
        Send(D1, HandoffVerdict("r2", lease, False, "cancelled")),  # its slot given back
    ]
    assert c.compute_done(lease, (9,), "length", None, PACKED, (), 0.4) == []
    lease = leased(c, request("r3"))
    assert c.handle(CancelRequest("r3", "client went away"), R, 0.5) == [
        FreeCache("r3"),
        Send(D1, HandoffVerdict("r3", lease, False, "cancelled")),
    ]
    assert c.counts["cancelled"] == 2 and c.active == 0


def test_acks_commit_only_the_lease_they_name_from_its_decode_node() -> None:
    c = core()
    lease = leased(c, request())
    no = Send(D0, HandoffVerdict("r1", lease, False, "no such lease"))
    assert c.handle(HandoffAck("r1", lease, True), D0, 0.1) == [no]  # another node
    assert c.handle(HandoffAck("r1", lease + 9, True), D1, 0.1) == [
        Send(D1, HandoffVerdict("r1", lease + 9, False, "no such lease"))
    ]
    computing = admit(c, request("r2"))
    assert c.handle(HandoffAck("r2", computing, True), D1, 0.1) == [
        Send(D1, HandoffVerdict("r2", computing, False, "no such lease"))  # not handed off yet
    ]
    assert c.counts["late_acks"] == 3
    assert c.handle(HandoffAck("r1", lease, True), D1, 0.2) == [
        Send(D1, HandoffVerdict("r1", lease, True)),
        FreeCache("r1"),
    ]
    assert c.counts["committed"] == 1 and list(c.leases) == [computing]


def test_a_refused_ack_fails_the_request_and_aborts_with_a_bounded_reason() -> None:
    c = core()
    lease = leased(c, request())
    reason = "digest mismatch " + "x" * 300
    why = f"decode node {D1} refused the handoff: {reason}"
    assert c.handle(HandoffAck("r1", lease, False, reason), D1, 0.1) == [
        Send(R, Error(ErrorCode.HANDOFF_FAILED, why, "r1", NONCE)),
        FreeCache("r1"),
        Send(D1, HandoffVerdict("r1", lease, False, why[:200])),
    ]


def test_leases_expire_at_their_deadline_each_with_an_error_and_an_abort() -> None:
    c = core()
    a, b = leased(c, request("a")), leased(c, request("b"))
    when = c.next_timer()
    assert when is not None and c.on_timer(when - 1e-6) == []
    why = (
        f"handoff lease expired: no part of the KV cache could be written to decode node {D1} "
        "for 5s (part 0 of 1; --handoff-lease)"
    )
    assert c.on_timer(when) == [
        Send(R, Error(ErrorCode.HANDOFF_TIMEOUT, why, "a", NONCE)),
        FreeCache("a"),
        Send(D1, HandoffVerdict("a", a, False, why[:200])),
        Send(R, Error(ErrorCode.HANDOFF_TIMEOUT, why, "b", NONCE)),
        FreeCache("b"),
        Send(D1, HandoffVerdict("b", b, False, why[:200])),
    ]
    assert c.counts["expired"] == 2 and c.next_timer() is None
    admit(c, request("c"))
    assert c.next_timer() is None and c.on_timer(1e9) == []  # a computing lease has no timer
    # Written whole, then no ack within the lease: that is what the error says.
    d = leased(c, request("d"), 10.0)
    assert len(c.leases[d].plan) == 1
    c.sent(Send(D1, handoff_of(request("d"), d, 3)), 11.0)
    late = f"handoff lease expired: decode node {D1} never acknowledged the KV cache after its "
    (err, *_) = c.on_timer(c.next_timer())  # type: ignore[arg-type]
    assert err.msg.message == late + "last byte was written"


def test_a_handoff_that_cannot_be_delivered_fails_its_lease_only() -> None:
    c = core()
    m = request()
    lease = leased(c, m)
    h = Send(D1, handoff_of(m, lease, 3))
    why = f"handoff to decode node {D1}: connection refused"
    # An unreachable decode node is retryable (503 at the client), not a broken handoff.
    assert c.undeliverable(h, "connection refused", 1.0) == [
        Send(R, Error(ErrorCode.NODE_UNREACHABLE, why, "r1", NONCE)),
        FreeCache("r1"),
        Send(D1, HandoffVerdict("r1", lease, False, why)),
    ]
    assert c.undeliverable(h, "again", 1.1) == []  # that lease is gone
    assert c.undeliverable(Send(R, TokenResult("r1", 0, (9,), None, NONCE)), "x", 1.2) == []


def test_a_lost_decode_node_fails_every_lease_waiting_on_it_and_only_those() -> None:
    c = core(max_sequences=8)
    leased(c, request("a"))
    leased(c, request("b"))
    other = leased(c, request("o", target=D0))
    running = admit(c, request("c"))
    assert c.peer_lost(R, 1.0) == []  # a lost router changes nothing
    why = f"decode node {D1} was lost before it acknowledged the handoff"
    assert c.peer_lost(D1, 1.0) == [
        Send(R, Error(ErrorCode.NODE_UNREACHABLE, why, "a", NONCE)),
        FreeCache("a"),
        Send(R, Error(ErrorCode.NODE_UNREACHABLE, why, "b", NONCE)),
        FreeCache("b"),
    ]
    assert sorted(c.leases) == sorted([other, running])


def test_other_messages_are_ignored_with_a_debug_line() -> None:
    c = core()
    entry = RunEntry("r", 0, (1,), 0, SamplingParams(), 1)
    assert c.handle(entry, STRANGER, 0.0) == [
        Warn("debug", f"prefill: ignoring RunEntry from {STRANGER}")
    ]
    assert c.handle(CancelRequest("nothing", "x"), R, 0.0) == [] and c.counts == {}


def test_the_memory_of_finished_requests_is_bounded_and_forgets_the_oldest() -> None:
    c = core(max_sequences=1)
    for i in range(MAX_TOMBSTONES + 1):
        lease = admit(c, request(f"q{i}", max_tokens=1))
        c.compute_done(lease, (1,), "length", None, PACKED, (), 0.0)
    assert c.finished == MAX_TOMBSTONES
    assert c.handle(request("q1", max_tokens=1), R, 1.0) == []  # still remembered
    (e,) = c.handle(request("q0", max_tokens=1), R, 1.0)  # forgotten: runs again
    assert isinstance(e, StartCompute)


def test_handoffs_and_commits_are_counted_one_by_one() -> None:
    c = core()
    a, b = leased(c, request("a")), leased(c, request("b"))
    c.handle(HandoffAck("a", a, True), D1, 0.1)
    c.handle(HandoffAck("b", b, True), D1, 0.1)
    assert c.counts == {"accepted": 2, "handed_off": 2, "committed": 2}


def test_a_part_written_to_a_node_renews_every_handoff_still_going_to_it() -> None:
    """Handoffs to one decode node share its queue: while any of their parts is written, the
    link moves, and none of them expires for waiting its turn."""
    c = core(part_bytes=8, lease_max=100.0)
    a, b = admit(c, request("a")), admit(c, request("b"))
    (pa,) = [e for e in c.compute_done(a, (9,), "length", None, PACKED, (), 0.0)
             if isinstance(e, Send) and isinstance(e.msg, KvHandoff)]  # fmt: skip
    c.compute_done(b, (9,), "length", None, PACKED, (), 0.0)
    assert c.leases[b].expires == 5.0
    c.sent(pa, 4.0)  # a's part written: b's lease moves too
    assert c.leases[a].expires == 9.0 and c.leases[b].expires == 9.0


def test_a_query_is_answered_with_the_nodes_figures_and_its_handoff_time() -> None:
    c = PrefillCore(
        PrefillConfig(decode_peers=(D0,), vocab=100, max_len=64, lease=5.0),
        counters=lambda: {"wire_bytes_out": 7},
    )
    assert not c.queried and not c.told_draining
    a, b = leased(c, request("a"), now=1.0), leased(c, request("b"), now=1.0)
    c.handle(HandoffAck("a", a, True), D1, 2.0)  # 1 s from the handoff to its ack
    c.handle(HandoffAck("b", b, True), D1, 1.5)  # and half a second
    assert c.handle(QueryState(3), R, 2.0) == [
        Send(R, State("prefill", (), 0, False, 3, wire_bytes_out=7, handoffs=2,
                      handoff_us=1_500_000))
    ]  # fmt: skip
    assert c.queried and not c.told_draining
    c.draining = True
    assert c.handle(QueryState(4), R, 2.1)[0].msg.draining and c.told_draining
    m = request("c")
    assert c.handle(m, R, 2.2) == refused(
        m, ErrorCode.DRAINING, "this prefill node is shutting down"
    )


def test_a_request_for_two_tokens_asks_for_a_slot_and_answers_count_once() -> None:
    c = core()
    m = request(max_tokens=2)
    lease = admit(c, m)  # asks the decode node, which says yes
    assert c.handle(SlotAnswer("r1", lease, True), D1, 0.1) == []  # a repeat: a stray
    assert c.counts["stray_slot_answers"] == 1
    for rid in ("x", "y"):
        lx = admit(c, request(rid), slot=False)
        c.handle(SlotAnswer(rid, lx, False, "full"), D1, 0.2)
    assert c.counts["decode_refused"] == 2


def test_a_cache_is_cut_in_parts_of_a_256th_within_the_bounds() -> None:
    """4 MiB of cache: parts of 16 KiB, 32 rows of 512 bytes."""
    rows = 4096
    big = Tensor("float32", (1, 1, rows, 128), bytes(rows * 512))
    packed = Packed(rows, 9, (big,), (big,), tensor_digest((big,), (big,)))
    c = core(max_len=1 << 20, lease_max=100.0)
    lease = admit(c, request())
    out = c.compute_done(lease, (9,), "length", None, packed, (), 0.0)
    (part,) = [e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, KvHandoff)]
    assert (part.parts, part.pieces, [t.shape for t in part.keys]) == (256, (0,), [(32, 128)])


def test_a_cache_needing_more_parts_than_a_handoff_may_have_is_not_sent() -> None:
    """One float32 row a part (4 bytes): 2 x 8,192 rows is the most, one row more is not."""
    for rows, parts in ((MAX_PARTS // 2, MAX_PARTS), (MAX_PARTS // 2 + 1, MAX_PARTS + 2)):
        t = Tensor("float32", (1, 1, rows, 1), bytes(4 * rows))
        packed = Packed(3, 9, (t,), (t,), tensor_digest((t,), (t,)))
        c = core(part_bytes=4)
        lease = admit(c, request())
        out = c.compute_done(lease, (9,), "length", None, packed, (), 0.0)
        if parts <= MAX_PARTS:
            assert out[-1].msg.parts == parts
            continue
        why = f"this prompt's KV cache ({8 * rows} bytes) needs {parts} parts; at most {MAX_PARTS}"
        assert out[1:] == [
            Send(R, Error(ErrorCode.HANDOFF_FAILED, why, "r1", NONCE)),
            FreeCache("r1"),
            Send(D1, HandoffVerdict("r1", lease, False, why)),
        ]


def test_the_router_hears_of_progress_at_most_once_a_second() -> None:
    c = core(part_bytes=8, lease_max=100.0)
    lease = admit(c, request())
    out = c.compute_done(lease, (9,), "length", None, PACKED, (), 0.0)
    (p,) = [e for e in out if isinstance(e, Send) and isinstance(e.msg, KvHandoff)]
    said = []
    for t in (1.0, 1.5, 1.9, 2.0):
        nxt = c.sent(p, t)
        said += [t for e in nxt if isinstance(e.msg, Progress)]
        p = nxt[0]
    assert said == [1.0, 2.0]
