"""Every refusal, deadline, ending and bound of the decode node's core, compared exactly.

The whole effect list is compared: the ack the prefill node gets (and its reason), what the
router gets, what the compute side starts or frees, and the counters. See
tests/disagg/test_router_refusals.py for why.
"""

from __future__ import annotations

import dataclasses

from mlxcel.base.effects import FreeCache, Send, StartCompute, Warn
from mlxcel.base.handoff import digest_of, part_of, plan_parts, tensor_digest
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    HandoffAck,
    HandoffVerdict,
    KvHandoff,
    QueryState,
    RunEntry,
    RunResult,
    SamplingParams,
    SlotAnswer,
    SlotRequest,
    State,
    Tensor,
    TokenResult,
)
from mlxcel.disagg.decode_core import MAX_ROUTERS, DecodeConfig, DecodeCore
from mlxcel.disagg.protocol import (
    MAX_PARTS,
    MAX_TOMBSTONES,
    PREFILL_TIMEOUT,
    ResumeJob,
    SlotState,
    VerifyJob,
)

P0, P1 = "127.0.0.2:9000", "127.0.0.3:9000"  # prefill nodes
R = "127.0.0.6:9000"  # the router the handoffs name
STRANGER = "127.0.0.9:9000"
NONCE = 42
K = Tensor("float32", (1, 1, 3, 2), bytes(range(24)))


def core(**kw: object) -> DecodeCore:
    base: dict = dict(vocab=100, max_len=64, max_sequences=2, verdict_wait=15.0)
    c = DecodeCore(DecodeConfig(**{**base, **kw}))
    c.handle(QueryState(0), R, 0.0)  # the router has spoken to it (its figures poll)
    return c


def handoff(
    rid: str = "r1",
    lease: int = 5,
    first: int = 9,
    max_tokens: int = 3,
    prompt_len: int = 3,
    layers: int = 1,
) -> KvHandoff:
    keys = (K,) * layers
    h = KvHandoff(
        rid,
        lease,
        R,
        NONCE,
        first,
        SamplingParams(max_tokens=max_tokens),
        (),
        prompt_len,
        keys,
        keys,
        b"",
    )
    return dataclasses.replace(h, digest=digest_of(h, tensor_digest(keys, keys)))


def cut(h: KvHandoff, part_bytes: int = 24) -> list[KvHandoff]:
    """``h`` in parts as a prefill node cuts it (24 bytes: one tensor a part)."""
    plan = plan_parts(h, part_bytes)
    return [part_of(h, plan, i) for i in range(len(plan))]


def no(h: KvHandoff, why: str, dest: str = P0, what: str = "handoff") -> list:
    """The refusal: a line in the node's log (rate limited) naming the sender, and the ack."""
    return [
        Warn(
            "decode-refusal",
            f"decode: refused a {what} from {dest} (request {h.request_id!r}): {why}",
        ),
        Send(dest, HandoffAck(h.request_id, h.lease, False, why)),
    ]


def staged(c: DecodeCore, h: KvHandoff, src: str = P0, now: float = 0.0) -> int:
    (e,) = c.handle(h, src, now)
    assert isinstance(e, StartCompute) and isinstance(e.job, VerifyJob)
    assert c.verified(e.job.slot, None, now) == [Send(src, HandoffAck(h.request_id, h.lease, True))]
    return e.job.slot


def decoding(c: DecodeCore, h: KvHandoff, src: str = P0, now: float = 0.0) -> int:
    slot = staged(c, h, src, now)
    (e,) = c.handle(HandoffVerdict(h.request_id, h.lease, True), src, now)
    assert isinstance(e, StartCompute) and isinstance(e.job, ResumeJob)
    return slot


def test_handoffs_outside_the_model_or_the_nodes_limits_are_refused_with_the_reason() -> None:
    c = core()
    ctx = "prompt and max_tokens exceed the model's context of 64"
    rng = "first token or max_tokens out of range"
    cases = [
        (handoff(lease=1, first=-1), rng),
        (handoff(lease=2, first=100), rng),
        (handoff(lease=3, max_tokens=0), rng),
        (handoff(lease=4, prompt_len=0), ctx),
        (handoff(lease=6, prompt_len=60, max_tokens=4), ctx),  # 60 + 1 + 4 > 64
    ]
    for h, why in cases:
        assert c.handle(h, P0, 0.0) == no(h, why)
        assert c.handle(h, P0, 0.1) == []  # a repeat of a refused handoff opens nothing
    assert c.counts == {"refused": len(cases)} and c.active == 0
    # The edges pass: first token 0 and 99, max_tokens 1, prompt_len 1, exactly the context.
    ok = [
        handoff("a", 10, first=0, max_tokens=1, prompt_len=1),
        handoff("b", 11, first=99, prompt_len=60),
    ]
    for slot, h in enumerate(ok, start=1):
        assert c.handle(h, P0, 0.0) == [StartCompute(VerifyJob(slot, h))]
    # Full at max_sequences; one request at a time per router and id.
    h = handoff("c", 12)
    assert c.handle(h, P0, 0.0) == no(h, "decode node full (2 sequences)")
    c.handle(CancelRequest("a", "x"), R, 0.0)
    h = handoff("b", 13)
    assert c.handle(h, P1, 0.0) == no(h, "this node already decodes that request", P1)


def test_malformed_parts_are_refused_before_anything_is_kept() -> None:
    c = core(max_sequences=8)
    k2 = Tensor("float32", (1, 2, 3, 2), bytes(48))
    base = handoff()
    p0 = cut(base)[0]
    cases = [
        (
            dataclasses.replace(base, lease=1, part=1, parts=1),
            f"part 1 of 1 (at most {MAX_PARTS} parts)",
        ),
        (
            dataclasses.replace(base, lease=2, part=-1, parts=2),
            f"part -1 of 2 (at most {MAX_PARTS} parts)",
        ),
        (
            dataclasses.replace(base, lease=3, parts=MAX_PARTS + 1),
            f"part 0 of {MAX_PARTS + 1} (at most {MAX_PARTS} parts)",
        ),
        (
            dataclasses.replace(base, lease=4, keys=(), values=()),
            "0 key and 0 value layers (the model has 0)",
        ),
        (
            dataclasses.replace(base, lease=6, values=(K, K)),
            "1 key and 2 value layers (the model has 1)",
        ),
        (
            dataclasses.replace(base, lease=7, pieces=(0,)),
            "a handoff in one message carries whole tensors, not pieces",
        ),
        (dataclasses.replace(p0, lease=8, layout=p0.layout[:1]), "a handoff layout of 1 tensors"),
        (
            dataclasses.replace(p0, lease=9, values=p0.keys),
            "a handoff part must hold pieces, each naming its tensor",
        ),
        (
            dataclasses.replace(p0, lease=10, pieces=(5,)),
            "a piece of tensor 5, which the layout does not have",
        ),
        (
            dataclasses.replace(p0, lease=11, keys=(K,)),
            "a piece of shape [1, 1, 3, 2] for a tensor 2 wide",
        ),
    ]
    for h, why in cases:
        assert c.handle(h, P0, 0.0) == no(h, why)
    assert c.counts == {"refused": len(cases)}
    # Against the model's dims: other layer counts or tensor shapes, whole or in parts.
    m = core(dims=(2, 1, 2, 2))
    two = handoff(layers=2)
    q0 = cut(two)[0]
    cases = [
        (dataclasses.replace(base, lease=1), "1 key and 1 value layers (the model has 2)"),
        (
            dataclasses.replace(two, lease=3, keys=(k2, K)),
            "handoff tensor shape [1, 2, 3, 2], expected [1, 1, 3, 2]",
        ),
        (dataclasses.replace(q0, lease=4, layout=q0.layout[:2]), "a handoff layout of 2 tensors"),
        (
            dataclasses.replace(q0, lease=5, layout=((1, 2, 3, 2),) * 4),
            "handoff tensor shape [1, 2, 3, 2], expected [1, 1, 3, 2]",
        ),
    ]
    for h, why in cases:
        assert m.handle(h, P0, 0.0) == no(h, why)
    fine = dataclasses.replace(two, lease=6)
    assert m.handle(fine, P0, 0.0) == [StartCompute(VerifyJob(1, fine))]


def test_a_split_handoff_is_kept_part_by_part_and_checked_as_it_comes() -> None:
    c = core(dims=(2, 1, 2, 2))
    whole = handoff(layers=2)
    parts = cut(whole)
    assert [(p.part, p.parts, p.pieces) for p in parts] == [(i, 4, (i,)) for i in range(4)]
    assert c.handle(parts[3], P0, 1.0) == [] and c.next_timer() == 16.0
    assert c.handle(parts[3], P0, 2.0) == []  # a repeat changes nothing...
    assert c.counts == {"parts": 1} and c.next_timer() == 16.0  # ...not even the deadline
    assert c.handle(parts[1], P0, 5.0) == [] and c.next_timer() == 20.0  # progress moves it
    assert c.handle(parts[0], P0, 6.0) == []
    assert c.handle(parts[2], P0, 10.0) == [StartCompute(VerifyJob(1, whole))]
    assert c.counts == {"parts": 4} and c.next_timer() == 25.0  # verifying: a fresh wait
    assert c.handle(parts[0], P0, 11.0) == []  # the slot is verifying: parts are over
    # A part with a bad piece, that disagrees, or that carries more than the layout holds
    # ends the handoff unread.
    q = [dataclasses.replace(p, lease=7) for p in parts]
    wide = Tensor("float32", (3, 4), bytes(48))
    for bad, why in (
        (
            dataclasses.replace(q[1], keys=(wide,)),
            "a piece of shape [3, 4] for a tensor 2 wide",
        ),
        (dataclasses.replace(q[1], first_token=8), "the parts of the handoff disagree"),
        (
            dataclasses.replace(q[1], keys=(Tensor("float32", (4, 2), bytes(32)),) * 4,
                                pieces=(1, 1, 1, 1)),
            "the parts hold more than the handoff's tensors",
        ),
    ):  # fmt: skip
        fresh = core(dims=(2, 1, 2, 2))
        assert fresh.handle(q[0], P0, 0.0) == []
        assert fresh.handle(bad, P0, 0.1) == no(bad, why, what="handoff part") + [
            FreeCache(bad.request_id)
        ]
        assert fresh.counts == {"parts": 1, "corrupt": 1} and fresh.active == 0
    # Every part arrived, but one tensor's pieces do not add up to its shape: refused.
    short = core(dims=(2, 1, 2, 2))
    thin = [*q[:3], dataclasses.replace(q[3], keys=(Tensor("float32", (2, 2), bytes(16)),))]
    for p in thin[:3]:
        assert short.handle(p, P0, 0.0) == []
    why = "handoff tensor 3: tensor float32[1, 1, 3, 2] needs 24 bytes, got 16"
    assert short.handle(thin[3], P0, 0.1) == no(thin[3], why, what="handoff part") + [
        FreeCache(thin[3].request_id)
    ]


def test_verification_results_and_verdicts_exactly() -> None:
    c = core()
    h = handoff()
    (e,) = c.handle(h, P0, 0.0)
    slot = e.job.slot
    assert c.verified(slot, "handoff digest mismatch", 0.1) == no(h, "handoff digest mismatch") + [
        FreeCache("r1")
    ]
    assert c.verified(slot, None, 0.2) == []  # gone: its loaded cache goes with the call
    assert c.counts == {"corrupt": 1}
    # Verified: acked, deadline renewed, the payload dropped; then committed and resumed.
    h = handoff("r2", 6)
    (e,) = c.handle(h, P0, 1.0)
    slot = e.job.slot
    assert c.verified(slot, None, 2.0) == [Send(P0, HandoffAck("r2", 6, True))]
    assert c.next_timer() == 17.0
    # Not its prefill node: changes nothing, and the line names the sender.
    assert c.handle(HandoffVerdict("r2", 6, True), P1, 2.1) == [
        Warn("decode-refusal", f"decode: refused a verdict from {P1} (request 'r2'): no handoff "
             "of that lease from that node is here")
    ]  # fmt: skip
    light = dataclasses.replace(h, keys=(), values=())
    assert c.handle(HandoffVerdict("r2", 6, True), P0, 2.2) == [
        StartCompute(ResumeJob(slot, light))
    ]
    assert c.next_timer() is None and list(c.reads) == [(P0, 6)]
    assert c.handle(HandoffVerdict("r2", 6, True), P0, 2.3) == []  # a repeat
    assert c.handle(HandoffVerdict("r2", 6, False), P0, 2.3) == []  # too late to abort
    assert c.counts == {"corrupt": 1, "committed": 1, "stray_verdicts": 1}
    assert c.reads.maxlen == 100_000


def test_a_commit_before_the_ack_is_refused_with_a_warning_and_an_abort_frees() -> None:
    c = core()
    h = handoff()
    (e,) = c.handle(h, P0, 0.0)
    want = "decode handoff: COMMIT is not allowed in state VERIFYING"
    assert c.handle(HandoffVerdict("r1", 5, True), P0, 0.1) == [
        Warn("decode-refusal", f"decode: refused a verdict from {P0} (request 'r1'): {want}")
    ]
    assert c.handle(HandoffVerdict("r1", 5, False, "lease expired"), P0, 0.2) == [FreeCache("r1")]
    assert c.counts == {"aborted": 1} and not c.reads and c.active == 0


def test_tokens_errors_and_finish_go_to_the_router_the_handoff_names() -> None:
    c = core()
    slot = decoding(c, handoff())
    assert c.token(slot, RunResult("x", 0, (21,), None, 0, (-0.1,)), 1.0) == [
        Send(R, TokenResult("r1", 1, (21,), None, NONCE, (-0.1,)))
    ]
    assert c.token(slot, RunResult("x", 0, (22,), "length", 0), 1.1) == [
        Send(R, TokenResult("r1", 2, (22,), "length", NONCE)),
        FreeCache("r1"),
    ]
    assert c.token(slot, RunResult("x", 0, (23,), None, 0), 1.2) == []  # ended
    slot = decoding(c, handoff("r2", 6))
    assert c.token(slot, Error(ErrorCode.FORWARD_FAILED, "boom"), 2.0) == [
        Send(R, Error(ErrorCode.FORWARD_FAILED, "decode failed: boom", "r2", NONCE)),
        FreeCache("r2"),
    ]
    s3 = staged(c, handoff("r3", 7))
    assert c.token(s3, RunResult("x", 0, (1,), None, 0), 3.0) == []  # not committed: no tokens
    assert c.counts == {"committed": 2, "completed": 1}


def test_verdicts_and_parts_that_never_come_time_out_at_their_deadline() -> None:
    c = core(max_sequences=8)
    staged(c, handoff("a", 1), now=0.0)
    staged(c, handoff("b", 2), now=0.0)
    p = cut(handoff("c", 3), 8)[0]  # 8 bytes a part: 6 parts
    assert c.handle(p, P0, 0.0) == []
    decoding(c, handoff("d", 4), now=0.0)
    assert c.on_timer(14.999) == []
    never = "the prefill node never committed the handoff within 15s; it was not read"
    parts = "only 1 of 6 handoff parts came in 15s; it was not read"
    assert c.on_timer(15.0) == [
        Send(R, Error(ErrorCode.HANDOFF_TIMEOUT, never, "a", NONCE)),
        FreeCache("a"),
        Send(R, Error(ErrorCode.HANDOFF_TIMEOUT, never, "b", NONCE)),
        FreeCache("b"),
        Send(R, Error(ErrorCode.HANDOFF_TIMEOUT, parts, "c", NONCE)),
        FreeCache("c"),
    ]
    assert c.counts["verdict_timeouts"] == 3 and c.active == 1  # the decoding one stays
    assert c.on_timer(1e9) == []


def test_a_lost_prefill_node_ends_only_its_uncommitted_handoffs() -> None:
    c = core(max_sequences=8)
    staged(c, handoff("a", 1))
    (e,) = c.handle(handoff("b", 2), P0, 0.0)  # still verifying
    decoding(c, handoff("c", 3))
    staged(c, handoff("d", 4), src=P1)
    assert c.peer_lost(R, 1.0) == []  # a lost router changes nothing here
    why = "the prefill node was lost before it committed the handoff; not read"
    assert c.peer_lost(P0, 1.0) == [
        Send(R, Error(ErrorCode.HANDOFF_FAILED, why, "a", NONCE)),
        FreeCache("a"),
        Send(R, Error(ErrorCode.HANDOFF_FAILED, why, "b", NONCE)),
        FreeCache("b"),
    ]
    assert c.active == 2


def test_an_unreachable_router_ends_the_slot_it_was_decoding_for() -> None:
    c = core()
    decoding(c, handoff())
    t = Send(R, TokenResult("r1", 1, (5,), None, NONCE))
    assert c.undeliverable(Send(STRANGER, t.msg), "refused", 1.0) == []  # not its router
    assert c.undeliverable(Send(R, HandoffAck("r1", 5, True)), "refused", 1.0) == []
    assert c.undeliverable(t, "connection refused", 1.0) == [FreeCache("r1")]
    assert c.undeliverable(t, "connection refused", 1.1) == [] and c.active == 0
    decoding(c, handoff("r2", 6))
    err = Send(R, Error(ErrorCode.FORWARD_FAILED, "x", "r2", NONCE))
    assert c.undeliverable(err, "refused", 2.0) == [FreeCache("r2")]


def test_cancels_free_the_slot_and_refuse_the_handoff_until_the_tombstone_expires() -> None:
    c = core()
    decoding(c, handoff())
    # Not its router: nothing held is touched, and the line names the sender.
    assert c.handle(CancelRequest("r1", "x"), STRANGER, 1.0) == [
        Warn("decode-refusal", f"decode: refused a cancel from {STRANGER} (request 'r1'): no "
             "router of this node sent it; remembered, nothing held was touched")
    ]  # fmt: skip
    assert c.handle(CancelRequest("r1", "gone"), R, 1.0) == [FreeCache("r1")]
    assert c.counts == {"committed": 1, "cancelled": 1}
    # The request id stays refused for a minute: a late handoff of it is not read.
    h = handoff("r1", 9)
    assert c.handle(h, P1, 2.0) == no(h, "the router cancelled this request", P1)
    assert c.handle(CancelRequest("r7", "early"), R, 3.0) == []
    assert c.next_timer() == 61.0
    assert c.on_timer(62.9) == []
    h7 = handoff("r7", 10)
    assert c.handle(h7, P0, 62.95) == no(h7, "the router cancelled this request")
    c.on_timer(63.0)  # the early cancel's tombstone is gone at 3 + 60 s
    h7 = handoff("r7", 11)
    assert c.handle(h7, P0, 63.1) == [StartCompute(VerifyJob(2, h7))]


def test_other_messages_are_ignored_with_a_debug_line() -> None:
    c = core()
    assert c.handle(RunEntry("r", 0, (1,), 0, SamplingParams(), 1), P0, 0.0) == [
        Warn("debug", f"decode: ignoring RunEntry from {P0}")
    ]
    assert c.handle(HandoffVerdict("r", 1, True), P0, 0.0) == [
        Warn("decode-refusal", f"decode: refused a verdict from {P0} (request 'r'): no handoff "
             "of that lease from that node is here")
    ]  # fmt: skip
    assert c.counts == {"stray_verdicts": 1}


def test_the_memories_of_cancels_and_ended_handoffs_are_bounded() -> None:
    c = core()
    for i in range(MAX_TOMBSTONES + 1):
        c.handle(CancelRequest(f"q{i}", "x"), R, 0.0)
    assert c.tombstones == MAX_TOMBSTONES
    h1, h0 = handoff("q1", 1), handoff("q0", 2)
    assert c.handle(h1, P0, 1.0) == no(h1, "the router cancelled this request")
    assert c.handle(h0, P0, 1.0) == [StartCompute(VerifyJob(1, h0))]  # forgotten
    d = core()
    for i in range(MAX_TOMBSTONES + 1):
        d.handle(handoff(f"e{i}", lease=1000 + i, first=-1), P0, 0.0)
    assert d.ended == MAX_TOMBSTONES
    assert d.handle(handoff("e1", 1001, first=-1), P0, 1.0) == []  # still remembered
    again = handoff("e0", 1000, first=-1)
    assert d.handle(again, P0, 1.0) == no(again, "first token or max_tokens out of range")


def test_a_handoff_whose_verification_never_returns_still_times_out() -> None:
    c = core()
    h = handoff()
    (e,) = c.handle(h, P0, 2.0)
    assert c.next_timer() == 17.0  # verifying counts against the verdict wait too
    why = "the prefill node never committed the handoff within 15s; it was not read"
    assert c.on_timer(17.0) == [
        Send(R, Error(ErrorCode.HANDOFF_TIMEOUT, why, "r1", NONCE)),
        FreeCache("r1"),
    ]


def test_a_reassembled_handoff_is_acked_and_read_like_a_whole_one() -> None:
    c = core(dims=(2, 1, 2, 2))
    whole = handoff(layers=2)
    *first, last = cut(whole, 40)  # pieces that straddle tensors
    for p in first:
        c.handle(p, P0, 0.0)
    (e,) = c.handle(last, P0, 0.1)
    assert e.job.handoff == whole
    assert c.verified(e.job.slot, None, 0.2) == [Send(P0, HandoffAck("r1", 5, True))]
    light = dataclasses.replace(whole, keys=(), values=())
    assert c.handle(HandoffVerdict("r1", 5, True), P0, 0.3) == [
        StartCompute(ResumeJob(e.job.slot, light))
    ]


def test_every_ending_is_counted_one_by_one() -> None:
    c = core(max_sequences=8)
    for i in (1, 2):
        decoding(c, handoff(f"c{i}", i))
        c.handle(CancelRequest(f"c{i}", "x"), R, 1.0)
        (e,) = c.handle(handoff(f"v{i}", 10 + i), P0, 1.0)
        c.verified(e.job.slot, "digest mismatch", 1.1)
        staged(c, handoff(f"a{i}", 20 + i))
        c.handle(HandoffVerdict(f"a{i}", 20 + i, False), P0, 1.2)
        slot = decoding(c, handoff(f"d{i}", 30 + i))
        c.token(slot, RunResult("x", 0, (1,), "stop", 0), 1.3)
        bad = cut(handoff(f"p{i}", 40 + i))
        c.handle(bad[0], P0, 1.4)
        c.handle(dataclasses.replace(bad[1], first_token=1), P0, 1.5)
    assert c.counts == {
        "committed": 4,
        "cancelled": 2,
        "corrupt": 4,
        "aborted": 2,
        "completed": 2,
        "parts": 2,
    }


def test_a_slot_is_held_before_the_prompt_runs_and_refused_when_full_or_foreign() -> None:
    """Asked as a prompt starts: a slot is held (and counted) until its handoff comes, an
    abort frees it, it lapses after the longest a prompt may take; a full or draining node,
    or a request for a router that never spoke to this node, is refused and logged."""
    c = core(max_sequences=2)
    assert c.handle(SlotRequest("a", 1, R), P0, 0.0) == [Send(P0, SlotAnswer("a", 1, True))]
    assert c.handle(SlotRequest("a", 1, R), P0, 0.1) == [Send(P0, SlotAnswer("a", 1, True))]
    assert c.handle(SlotRequest("b", 2, R), P1, 0.0) == [Send(P1, SlotAnswer("b", 2, True))]
    full = "decode node full (2 sequences)"
    assert c.handle(SlotRequest("c", 3, R), P0, 0.2) == [
        Warn("decode-refusal", f"decode: refused a slot request from {P0} (request 'c'): {full}"),
        Send(P0, SlotAnswer("c", 3, False, full)),
    ]
    # A handoff with no slot held for it finds the node full too; the held one gets its slot.
    h = handoff("z", 9)
    assert c.handle(h, P0, 0.3) == no(h, full)
    mine = handoff("a", 1)
    assert c.handle(mine, P0, 0.3) == [StartCompute(VerifyJob(1, mine))]
    assert (P0, 1) not in c.held and c.active == 1
    # An abort for a held slot frees it (the prompt ended at its first token).
    assert c.handle(HandoffVerdict("b", 2, False, "ended"), P1, 0.4) == [] and not c.held
    # A router that never spoke to this node: its tokens would go to an address a payload names.
    stranger = f"router {STRANGER} is not a router of this decode node"
    assert c.handle(SlotRequest("d", 4, STRANGER), P0, 0.5)[1] == Send(
        P0, SlotAnswer("d", 4, False, stranger)
    )
    foreign = dataclasses.replace(handoff("e", 5), router=STRANGER)
    assert c.handle(foreign, P0, 0.5) == no(foreign, stranger)
    # A held slot lapses; a lost prefill node's are freed at once.
    assert c.handle(SlotRequest("f", 6, R), P0, 1.0)[0] == Send(P0, SlotAnswer("f", 6, True))
    assert c.held[(P0, 6)] == 1.0 + PREFILL_TIMEOUT  # the longest a prompt may take
    c.on_timer(1.0 + PREFILL_TIMEOUT)
    assert not c.held
    c.handle(SlotRequest("g", 7, R), P1, 2.0)
    c.peer_lost(P1, 2.1)
    assert not c.held
    c.draining = True
    why = "this decode node is shutting down"
    assert c.handle(SlotRequest("h", 8, R), P0, 3.0)[1] == Send(P0, SlotAnswer("h", 8, False, why))
    assert c.counts["slots_refused"] == 3


def test_routers_it_was_told_of_are_the_only_ones_it_streams_to() -> None:
    """With --router-peers, a router that polls the node is not enough: only those."""
    c = core(routers=frozenset({R}))
    c.handle(QueryState(0), STRANGER, 0.0)  # polls, but is not one of them
    why = f"router {STRANGER} is not a router of this decode node"
    assert c.handle(SlotRequest("a", 1, STRANGER), P0, 0.1)[1] == Send(
        P0, SlotAnswer("a", 1, False, why)
    )
    fresh = DecodeCore(DecodeConfig(vocab=100, max_len=64, routers=frozenset({R})))
    ok = fresh.handle(SlotRequest("b", 2, R), P0, 0.2)  # told of it: no poll needed first
    assert ok == [Send(P0, SlotAnswer("b", 2, True))]


def test_a_request_id_is_one_stream_on_the_node_whichever_router_names_it() -> None:
    """The engine knows a stream by its request's id: a handoff under an id this node
    decodes is refused, even from another router (which cannot then end the first one's
    stream by its cancel either)."""
    c = core(max_sequences=8)
    c.handle(QueryState(0), STRANGER, 0.0)  # a second router this node serves
    slot = decoding(c, handoff("r1", 5))
    other = dataclasses.replace(handoff("r1", 6), router=STRANGER)
    other = dataclasses.replace(
        other, digest=digest_of(other, tensor_digest(other.keys, other.values))
    )
    assert c.handle(other, P0, 1.0) == no(other, "this node already decodes that request")
    assert c.handle(CancelRequest("r1", "x"), STRANGER, 1.1) == []  # for its own "r1"
    assert c.slots[slot].state is SlotState.DECODING
    assert c.handle(CancelRequest("r1", "gone"), R, 1.2) == [FreeCache("r1")]


def test_the_abort_that_follows_a_refused_handoff_is_not_a_stray() -> None:
    """The prefill node answers a refusal with an abort verdict: that one is expected, and
    leaves no line (a verdict for a lease this node never saw does)."""
    c = core()
    bad = handoff(first=-1)
    c.handle(bad, P0, 0.0)  # refused: out of range
    assert c.handle(HandoffVerdict("r1", bad.lease, False, "refused"), P0, 0.1) == []
    assert "stray_verdicts" not in c.counts


def test_a_query_is_answered_with_the_nodes_figures_and_remembered() -> None:
    c = DecodeCore(DecodeConfig(vocab=100, max_len=64), counters=lambda: {"wire_bytes_out": 7})
    assert not c.queried and not c.told_draining
    assert c.handle(QueryState(3), R, 0.0) == [
        Send(R, State("decode", (), 0, False, 3, wire_bytes_out=7))
    ]
    assert c.queried and not c.told_draining  # it may be sent work now
    c.draining = True
    assert c.handle(QueryState(4), P0, 0.1) == [
        Send(P0, State("decode", (), 0, True, 4, wire_bytes_out=7))
    ]
    assert c.told_draining


def test_the_routers_it_serves_are_the_last_64_that_spoke() -> None:
    c = DecodeCore(DecodeConfig(vocab=100, max_len=64, max_sequences=200))
    routers = [f"127.0.1.{i}:9000" for i in range(MAX_ROUTERS)]
    for r in routers:
        c.handle(QueryState(0), r, 0.0)
    assert list(c.routers) == routers  # 64: every one kept
    c.handle(QueryState(0), routers[0], 0.1)  # it spoke again: the newest now
    c.handle(QueryState(0), "127.0.2.1:9000", 0.2)  # one more: the oldest is forgotten
    assert list(c.routers) == [*routers[2:], routers[0], "127.0.2.1:9000"]
    why = f"router {routers[1]} is not a router of this decode node"
    assert c.handle(SlotRequest("a", 1, routers[1]), P0, 0.3)[1] == Send(
        P0, SlotAnswer("a", 1, False, why)
    )
    assert c.handle(SlotRequest("b", 2, routers[0]), P0, 0.3) == [
        Send(P0, SlotAnswer("b", 2, True))
    ]


def test_parts_are_checked_against_the_key_and_the_value_width() -> None:
    """Keys and values of a layer may differ in width: even layout entries are keys."""
    v = Tensor("float32", (1, 1, 3, 3), bytes(range(36)))
    h = handoff(layers=2)
    h = dataclasses.replace(h, values=(v, v))
    h = dataclasses.replace(h, digest=digest_of(h, tensor_digest(h.keys, h.values)))
    c = core(dims=(2, 1, 2, 3))
    *first, last = cut(h)
    for p in first:
        assert c.handle(p, P0, 0.0) == []
    assert c.handle(last, P0, 0.0) == [StartCompute(VerifyJob(1, h))]
    whole = dataclasses.replace(h, request_id="r2", lease=6)
    whole = dataclasses.replace(whole, digest=digest_of(whole, tensor_digest(h.keys, h.values)))
    assert c.handle(whole, P0, 0.0) == [StartCompute(VerifyJob(2, whole))]


def test_more_malformed_parts_are_refused_by_name() -> None:
    c = core(max_sequences=8)
    p0 = cut(handoff())[0]
    row = Tensor("float32", (1, 2), bytes(8))
    cases = [
        (
            dataclasses.replace(p0, lease=1, pieces=(0, 1)),  # two pieces, one tensor
            "a handoff part must hold pieces, each naming its tensor",
        ),
        (
            dataclasses.replace(p0, lease=2, layout=((), ()), keys=(row,)),  # scalars: 1 wide
            "a piece of shape [1, 2] for a tensor 1 wide",
        ),
    ]
    for h, why in cases:
        assert c.handle(h, P0, 0.0) == no(h, why)
    # The most parts a handoff may have is still taken.
    most = dataclasses.replace(p0, lease=3, parts=MAX_PARTS)
    assert c.handle(most, P0, 0.0) == [] and c.active == 1


def test_a_refusal_line_names_at_most_80_characters_of_the_request_id() -> None:
    c = core()
    h = handoff("x" * 100, first=-1)
    why = "first token or max_tokens out of range"
    assert c.handle(h, P0, 0.0) == [
        Warn(
            "decode-refusal",
            f"decode: refused a handoff from {P0} (request {'x' * 80!r}): {why}",
        ),
        Send(P0, HandoffAck("x" * 100, 5, False, why)),
    ]


def test_after_a_refused_slot_request_its_abort_is_expected_and_strays_are_counted() -> None:
    c = core(max_sequences=1)
    c.handle(SlotRequest("a", 1, R), P0, 0.0)
    assert c.handle(SlotRequest("b", 2, R), P0, 0.0)[1].msg.ok is False  # full
    assert c.handle(HandoffVerdict("b", 2, False, "refused"), P0, 0.1) == []
    for lease in (7, 8):
        c.handle(HandoffVerdict("z", lease, True), P0, 0.2)
    assert c.counts == {"slots_refused": 1, "stray_verdicts": 2}


def test_a_held_slot_sets_the_timer_and_the_loaded_cache_goes_to_the_engine() -> None:
    c = core()
    c.handle(SlotRequest("a", 5, R), P0, 1.0)
    assert c.next_timer() == 1.0 + PREFILL_TIMEOUT
    h = handoff("a", 5)
    (e,) = c.handle(h, P0, 2.0)
    assert c.verified(e.job.slot, None, 2.1, cache="the loaded cache") == [
        Send(P0, HandoffAck("a", 5, True))
    ]
    light = dataclasses.replace(h, keys=(), values=())
    assert c.handle(HandoffVerdict("a", 5, True), P0, 2.2) == [
        StartCompute(ResumeJob(e.job.slot, light, "the loaded cache"))
    ]


def test_the_alternatives_go_to_the_router_with_each_token() -> None:
    c = core()
    slot = decoding(c, handoff())
    r = RunResult("x", 0, (21,), None, 0, (-0.1,), top_ids=(21, 4), top_logprobs=(-0.1, -2.5))
    assert c.token(slot, r, 1.0) == [
        Send(R, TokenResult("r1", 1, (21,), None, NONCE, (-0.1,), (21, 4), (-0.1, -2.5)))
    ]
