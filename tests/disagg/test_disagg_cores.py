"""The disaggregated role cores as tables: no model, no loop, no sockets.

Each test drives a core with messages and times and compares the effects it returns.
"""

from __future__ import annotations

import dataclasses

import pytest

from mlxcel.base.effects import Deliver, FreeCache, Send, StartCompute, Warn
from mlxcel.base.errors import IllegalTransition
from mlxcel.base.handoff import Packed, digest_of, join, part_of, plan_parts, tensor_digest
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
    RunResult,
    SamplingParams,
    SlotAnswer,
    State,
    Tensor,
    TokenResult,
)
from mlxcel.disagg.decode_core import DecodeConfig, DecodeCore
from mlxcel.disagg.prefill_core import PrefillConfig, PrefillCore
from mlxcel.disagg.protocol import (
    LEASE_TABLE,
    ROUTE_TABLE,
    SLOT_TABLE,
    LeaseEvent,
    LeaseState,
    PrefillJob,
    ResumeJob,
    RouteEvent,
    RouteState,
    SlotEvent,
    SlotState,
    VerifyJob,
    parse_allowlist,
)
from mlxcel.disagg.router_core import RouterCore

P0, P1 = "127.0.0.2:9000", "127.0.0.3:9000"
D0, D1 = "127.0.0.4:9000", "127.0.0.5:9000"
R = "127.0.0.6:9000"
STRANGER = "127.0.0.9:9000"


def sends(effects: list, cls: type | None = None) -> list[Send]:
    return [e for e in effects if isinstance(e, Send) and (cls is None or isinstance(e.msg, cls))]


def delivered(effects: list) -> list:
    return [e.msg for e in effects if isinstance(e, Deliver)]


# --- router ----------------------------------------------------------------------------------
def online_router(**kw: object) -> RouterCore:
    r = RouterCore([P0, P1], [D0, D1], **kw)  # type: ignore[arg-type]
    for a in (P0, P1, D0, D1):
        r.probe_result(a, True, "", 0.0)
    return r


def entry(rid: str, n: int = 3, max_tokens: int = 4) -> RunEntry:
    return RunEntry(rid, 0, tuple(range(1, n + 1)), 0, SamplingParams(max_tokens=max_tokens), 7)


def test_router_round_robins_both_pools_and_ships_the_decode_target() -> None:
    r = online_router()
    picks = []
    for i in range(4):
        (s,) = sends(r.handle(entry(f"r{i}"), "local", 0.0), PrefillRequest)
        picks.append((s.dest, s.msg.decode_target))
    assert picks == [(P0, D0), (P1, D1), (P0, D0), (P1, D1)]
    assert {n.id: n.dispatched for n in r.nodes.values()} == {
        "prefill-0": 2,
        "prefill-1": 2,
        "decode-0": 2,
        "decode-1": 2,
    }


def test_router_admission_answers_no_node_available_when_a_pool_is_down() -> None:
    r = RouterCore([P0], [D0])
    r.probe_result(P0, True, "", 0.0)  # the decode node never answered
    (err,) = delivered(r.handle(entry("r1"), "local", 0.0))
    assert isinstance(err, Error) and err.code == ErrorCode.NO_NODE_AVAILABLE
    assert "no decode node" in err.message and "decode-0: down" in err.message
    assert r.active == 0


def test_router_streams_tokens_in_order_even_when_decode_overtakes_prefill() -> None:
    r = online_router()
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    n, p, d, w = s.msg.nonce, s.dest, s.msg.decode_target, s.msg.request_id
    assert w.startswith("r1@") and w != "r1"  # unique across router restarts
    assert r.handle(TokenResult(w, 1, (11,), None, n), d, 0.1) == []  # held back
    out = r.handle(TokenResult(w, 0, (10,), None, n), p, 0.2)
    assert [m.token_ids for m in delivered(out)] == [(10,), (11,)]
    assert all(m.request_id == "r1" for m in delivered(out))
    assert r.nodes[p].active == 0 and r.nodes[d].active == 1  # the prefill's part is done
    out = r.handle(TokenResult(w, 2, (12,), "length", n), d, 0.3)
    (last,) = delivered(out)
    assert isinstance(last, RunResult) and last.finish_reason == "length" and last.nonce == 7
    assert r.active == 0 and r.counts["completed"] == 1


def test_router_drops_results_from_unconfigured_and_wrong_senders() -> None:
    r = online_router()
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    n, w = s.msg.nonce, s.msg.request_id
    out = r.handle(TokenResult(w, 0, (66,), "stop", n), STRANGER, 0.1)
    assert delivered(out) == []
    (warn,) = [e for e in out if isinstance(e, Warn)]
    assert warn.kind == "router-drop" and STRANGER in warn.text
    # A configured peer this request was not given to, and the right node with a wrong
    # nonce: dropped, and each gets a cancel back (if that node is generating for this id, it
    # stops). The request's own decode node claiming index 0 (the prefill node's token):
    # dropped without a cancel -- it is the node this request still needs.
    other = P1 if s.dest == P0 else P0
    for msg, src in (
        (TokenResult(w, 0, (66,), None, n), other),
        (TokenResult(w, 0, (66,), None, n + 1), s.dest),
    ):
        (c,) = r.handle(msg, src, 0.1)
        assert isinstance(c, Send) and c.dest == src and isinstance(c.msg, CancelRequest)
        assert c.msg.request_id == w  # the forged frames named the live request
    assert r.handle(TokenResult(w, 0, (66,), None, n), s.msg.decode_target, 0.1) == []
    assert r.counts["stale"] == 3 and r.counts["router_drop"] == 1
    # ... and the forged frames end it only through the timeout.
    out = r.on_timer(1e6)
    (err,) = delivered(out)
    assert err.code == ErrorCode.HANDOFF_TIMEOUT


def test_router_fails_over_an_unsent_request_and_marks_the_node_down() -> None:
    r = online_router()
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    out = r.undeliverable(s, "connection refused", 0.1, unsent=True)
    (again,) = sends(out, PrefillRequest)
    assert again.dest != s.dest and again.msg.decode_target == s.msg.decode_target
    assert not r.nodes[s.dest].online and r.counts["failovers"] == 1
    # Both prefill nodes down: the next one fails with a 503-class error.
    out = r.undeliverable(again, "connection refused", 0.2, unsent=True)
    (err,) = delivered(out)
    assert err.code == ErrorCode.NODE_UNREACHABLE


def test_a_send_that_may_have_arrived_is_never_sent_again() -> None:
    """A timeout after the bytes left: the prefill node may be running the prompt, so a second
    node must not run it too; the request fails instead."""
    r = online_router()
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    out = r.undeliverable(s, "send timed out", 0.1, unsent=False)
    assert sends(out, PrefillRequest) == []
    (err,) = delivered(out)
    assert err.code == ErrorCode.NODE_UNREACHABLE and r.counts["failovers"] == 0
    assert {c.dest for c in sends(out, CancelRequest)} == {s.msg.decode_target}


def test_cancels_go_out_even_to_a_node_marked_down() -> None:
    r = online_router()
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    r.probe_result(s.msg.decode_target, False, "probe timed out", 0.5)  # it may still run
    out = r.handle(CancelRequest("r1", "client went away"), "local", 0.6)
    assert {c.dest for c in sends(out, CancelRequest)} == {s.dest, s.msg.decode_target}
    assert all(c.msg.request_id == s.msg.request_id for c in sends(out, CancelRequest))


def test_router_fails_requests_on_a_lost_decode_node_and_uses_it_again_after_a_probe() -> None:
    r = online_router()
    for i in range(4):
        r.handle(entry(f"r{i}"), "local", 0.0)
    # A dropped connection alone fails nothing (another secret holder on the node's IP can
    # open and drop one under its address); a probe that then succeeds clears it.
    assert r.peer_lost(D0, 1.0) == [] and r.probe_result(D0, True, "", 1.0) == []
    assert r.active == 4
    # A routine failed probe marks the node down without failing its requests...
    r.probe_result(D1, False, "probe timed out", 1.0)
    assert r.active == 4 and not r.nodes[D1].online
    r.probe_result(D1, True, "", 1.0)
    # ... a failed probe right after a lost connection means it is gone.
    assert r.peer_lost(D0, 1.0) == []
    out = r.probe_result(D0, False, "connection refused", 1.0)
    # Its requests had no token out yet: they start over on the other decode node, and the
    # nodes that held them are told to free what they hold. The clients see nothing.
    assert delivered(out) == []
    moved = sends(out, PrefillRequest)
    assert {s.msg.decode_target for s in moved} == {D1} and len(moved) == 2
    assert sorted(r.wire_ids[s.msg.request_id] for s in moved) == ["r0", "r2"]
    assert {s.dest for s in sends(out, CancelRequest)} == {P0, D0}
    # Once a request streams, losing its decode node ends it with an error.
    for s in moved:
        r.handle(TokenResult(s.msg.request_id, 0, (1,), None, s.msg.nonce), s.dest, 1.5)
    r.peer_lost(D1, 1.6)
    errs = delivered(r.probe_result(D1, False, "connection refused", 1.6))
    codes = sorted((e.request_id, e.code) for e in errs if isinstance(e, Error))
    streaming, waiting = ErrorCode.NODE_UNREACHABLE, ErrorCode.NO_NODE_AVAILABLE  # D0 is down
    assert codes == [("r0", streaming), ("r1", waiting), ("r2", streaming), ("r3", waiting)]
    r.probe_result(D1, True, "", 1.7)
    (s,) = sends(r.handle(entry("r9"), "local", 2.0), PrefillRequest)
    assert s.msg.decode_target == D1
    r.probe_result(D0, True, "", 3.0)
    targets = {sends(r.handle(entry(f"x{i}"), "local", 4.0))[0].msg.decode_target for i in range(2)}
    assert targets == {D0, D1}


def test_router_cancel_reaches_both_nodes() -> None:
    r = online_router()
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    out = r.handle(CancelRequest("r1", "client went away"), "local", 0.5)
    assert {c.dest for c in sends(out, CancelRequest)} == {s.dest, s.msg.decode_target}
    assert r.active == 0


def test_router_error_from_the_prefill_ends_the_request_with_its_code() -> None:
    r = online_router()
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    err = Error(ErrorCode.HANDOFF_TIMEOUT, "handoff lease expired", s.msg.request_id, s.msg.nonce)
    out = r.handle(err, s.dest, 0.5)
    (d,) = delivered(out)
    assert d.code == ErrorCode.HANDOFF_TIMEOUT and "prefill-" in d.message
    assert not sends(out, PrefillRequest)  # never sent again
    assert sum(n["dispatched"] for n in r.stats()["nodes"] if n["role"] == "prefill") == 1


def test_route_table_refuses_a_second_first_token() -> None:
    with pytest.raises(IllegalTransition):
        ROUTE_TABLE.next(RouteState.DECODING, RouteEvent.FIRST_TOKEN)


# --- prefill ---------------------------------------------------------------------------------
def prefill(**kw: object) -> PrefillCore:
    cfg = PrefillConfig(decode_peers=(D0,), vocab=100, max_len=64, lease=5.0, **kw)  # type: ignore[arg-type]
    return PrefillCore(cfg)


def request(rid: str = "r1", target: str = D1, max_tokens: int = 4) -> PrefillRequest:
    return PrefillRequest(rid, (1, 2, 3), SamplingParams(max_tokens=max_tokens), target, 42)


def packed(first: int = 9) -> Packed:
    k = Tensor("float32", (1, 1, 3, 2), bytes(24))
    return Packed(3, first, (k,), (k,), tensor_digest((k,), (k,)))


def start(core: PrefillCore, now: float = 0.0, **kw: object) -> tuple[int, list]:
    m = request(**kw)  # type: ignore[arg-type]
    (job,) = [e.job for e in core.handle(m, R, now) if isinstance(e, StartCompute)]
    assert isinstance(job, PrefillJob) and job.sampling.max_tokens == 1
    core.handle(SlotAnswer(m.request_id, job.lease, True), m.decode_target or D0, now)
    out = core.compute_done(job.lease, (9,), "length", None, packed(), (), now)
    return job.lease, out


def admitted(core: PrefillCore, m: PrefillRequest | None = None) -> PrefillJob:
    """``m`` admitted, and its decode node's slot granted."""
    m = m or request()
    (job,) = [e.job for e in core.handle(m, R, 0.0) if isinstance(e, StartCompute)]
    assert isinstance(job, PrefillJob)
    core.handle(SlotAnswer(m.request_id, job.lease, True), m.decode_target or D0, 0.0)
    return job


def test_prefill_refuses_unsupported_families_before_any_work() -> None:
    core = prefill(unsupported="model family 'gemma3' keeps RotatingKVCache state")
    out = core.handle(request(), R, 0.0)
    (s,) = sends(out)
    assert s.dest == R and s.msg.code == ErrorCode.UNSUPPORTED_MODEL
    assert not [e for e in out if isinstance(e, StartCompute)] and core.active == 0
    # ... and keeps serving: the next request gets the same clean answer.
    assert sends(core.handle(request("r2"), R, 0.1))[0].msg.code == ErrorCode.UNSUPPORTED_MODEL


def test_prefill_allowlist_refuses_targets_outside_it_and_never_sends_the_cache() -> None:
    allow, skipped = parse_allowlist(f"{D0}, decode.example:9000, 300.1.1.1:5, {D0}")
    assert allow == frozenset({D0}) and skipped == ["decode.example:9000", "300.1.1.1:5"]
    core = prefill(allowlist=allow)
    out = core.handle(request(target=D1), R, 0.0)
    (s,) = sends(out)
    assert s.msg.code == ErrorCode.DECODE_TARGET_REFUSED and D1 in s.msg.message
    assert not [e for e in out if isinstance(e, StartCompute)]
    # Inside the list: accepted. No target: the first --decode-peers, without validation.
    assert [e for e in core.handle(request("r2", target=D0), R, 0.0) if isinstance(e, StartCompute)]
    strict = prefill(allowlist=frozenset({D1}))
    lease, out = start(strict, target="")
    assert sends(out, KvHandoff)[0].dest == D0


def test_the_handoff_carries_what_is_left_of_min_tokens() -> None:
    """The prefill node held EOS back for the first token: the decode node holds it for the
    rest (and for every token with ignore_eos)."""
    core = prefill()
    for sampling, left in (
        (SamplingParams(max_tokens=4, min_tokens=3), 2),
        (SamplingParams(max_tokens=4, min_tokens=1), 0),
        (SamplingParams(max_tokens=4), 0),
    ):
        m = dataclasses.replace(request(f"r{left}{sampling.min_tokens}"), sampling=sampling)
        (job,) = [e.job for e in core.handle(m, R, 0.0) if isinstance(e, StartCompute)]
        assert job.sampling.min_tokens == sampling.min_tokens  # the first token held too
        core.handle(SlotAnswer(m.request_id, job.lease, True), D1, 0.0)
        out = core.compute_done(job.lease, (9,), "length", None, packed(), (), 0.0)
        assert sends(out, KvHandoff)[0].msg.sampling.min_tokens == left
    m = dataclasses.replace(request("ig"), sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    lease = [e.job for e in core.handle(m, R, 0.0) if isinstance(e, StartCompute)][0].lease
    core.handle(SlotAnswer("ig", lease, True), D1, 0.0)
    out = core.compute_done(lease, (9,), "length", None, packed(), (), 0.0)
    assert sends(out, KvHandoff)[0].msg.sampling.ignore_eos


def test_unset_or_empty_allowlist_is_permissive() -> None:
    assert parse_allowlist(None) == (None, []) and parse_allowlist(" , ") == (None, [])
    assert parse_allowlist("host:1")[0] is None
    lease, out = start(prefill(allowlist=None), target=D1)
    assert sends(out, KvHandoff)[0].dest == D1


def test_prefill_sends_token_zero_then_the_handoff_and_commits_on_ack() -> None:
    core = prefill()
    lease, out = start(core)
    (first,) = sends(out, TokenResult)
    assert first.dest == R and first.msg.index == 0 and first.msg.finish_reason is None
    (h,) = sends(out, KvHandoff)
    assert h.dest == D1 and h.msg.router == R and h.msg.sampling.max_tokens == 3
    assert core.leases[lease].state is LeaseState.LEASED and core.leases[lease].held
    out = core.handle(HandoffAck("r1", lease, True), D1, 1.0)
    (v,) = sends(out, HandoffVerdict)
    assert v.dest == D1 and v.msg.commit
    assert FreeCache("r1") in out and core.active == 0


def test_prefill_reports_its_handoffs_their_time_and_its_kv_cache_in_state() -> None:
    core = PrefillCore(
        PrefillConfig(decode_peers=(D0,), vocab=100, max_len=64),
        counters=lambda: {"kv_tokens": 3, "kv_capacity": 1000},
    )
    lease, _ = start(core, now=10.0)
    core.handle(HandoffAck("r1", lease, True), D1, 10.25)
    (s,) = sends(core.handle(QueryState(5), R, 11.0))
    assert s.dest == R and s.msg == State(
        "prefill", (), 0, False, 5, kv_tokens=3, kv_capacity=1000, handoffs=1, handoff_us=250000
    )
    # A refused handoff is not one: the count and the time stay.
    lease, _ = start(core, now=12.0, rid="r2")
    core.handle(HandoffAck("r2", lease, False, "full"), D1, 19.0)
    (s,) = sends(core.handle(QueryState(6), R, 20.0))
    assert s.msg.handoffs == 1 and s.msg.handoff_us == 250000


def test_a_draining_prefill_refuses_new_prompts_and_both_roles_say_they_drain() -> None:
    core = prefill()
    core.draining = True
    out = core.handle(request(), R, 0.0)
    (s,) = sends(out)
    assert s.msg.code == ErrorCode.DRAINING and "shutting down" in s.msg.message
    assert not [e for e in out if isinstance(e, StartCompute)] and core.active == 0
    assert not core.told_draining
    assert sends(core.handle(QueryState(1), R, 0.0))[0].msg.draining and core.told_draining
    # A decode node is told its requests when they are admitted, before their prompts run:
    # a handoff that comes while it drains belongs to one of those, and is taken.
    dec = DecodeCore(DecodeConfig(vocab=100, max_len=64))
    dec.handle(QueryState(0), R, 0.0)  # its router
    dec.draining = True
    k = Tensor("float32", (1, 1, 3, 2), bytes(24))
    h = KvHandoff("r1", 7, R, 42, 9, SamplingParams(max_tokens=3), (), 3, (k,), (k,), b"")
    (job,) = [e for e in dec.handle(h, P0, 0.0) if isinstance(e, StartCompute)]
    assert isinstance(job.job, VerifyJob) and dec.active == 1
    assert sends(dec.handle(QueryState(2), R, 0.0))[0].msg.draining and dec.told_draining


def test_a_prefill_repeat_is_ignored_even_while_draining() -> None:
    core = prefill()
    start(core)  # r1 ran to its first token and was handed off
    core.draining = True
    assert core.handle(request(), R, 1.0) == []  # the same request again: never run twice


def test_router_moves_a_prompt_a_draining_prefill_node_refused_and_sends_it_no_more() -> None:
    r = online_router()
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    assert s.dest == P0
    refused = Error(ErrorCode.DRAINING, "this prefill node is shutting down", s.msg.request_id,
                    s.msg.nonce)  # fmt: skip
    (moved,) = sends(r.handle(refused, P0, 0.1), PrefillRequest)
    assert moved.dest == P1 and moved.msg.request_id == s.msg.request_id
    assert r.counts["failovers"] == 1 and r.nodes[P0].draining and r.nodes[P0].active == 0
    # New requests avoid it until a State says it is no longer draining.
    picks = [
        sends(r.handle(entry(f"n{i}"), "local", 0.2), PrefillRequest)[0].dest for i in range(2)
    ]
    assert picks == [P1, P1]
    r.handle(State("prefill", (), 0, False, 0, kv_tokens=0, kv_capacity=9), P0, 0.3)
    assert not r.nodes[P0].draining
    stats = {n["id"]: n for n in r.stats()["nodes"]}
    assert stats["prefill-0"]["kv_capacity"] == 9 and "handoffs" not in stats["prefill-0"]
    # Another node's State, or a stranger's, changes nothing.
    assert r.handle(State("x", (), 0, True, 0), STRANGER, 0.4) == [
        Warn("debug", f"router: ignoring State from {STRANGER}")
    ]
    assert not any(n.draining for n in r.nodes.values())
    # After a successful probe the router asks an online node for its figures; a query that
    # cannot be sent says nothing about the node (the probe judges it).
    (q,) = r.ask_figures(D1, 1.0)
    assert q.dest == D1 and isinstance(q.msg, QueryState)
    assert r.ask_figures(STRANGER, 1.0) == []
    assert r.undeliverable(q, "send timed out", 3.0) == [] and r.nodes[D1].online
    # A node marked down loses its figures (/cluster must not show a dead node's cache),
    # and one that comes back is not draining until its State says so.
    r.handle(State("decode", (), 0, True, 0, kv_tokens=5, kv_capacity=9), D1, 3.1)
    assert r.nodes[D1].draining and r.nodes[D1].figures["kv_tokens"] == 5
    r.probe_result(D1, False, "refused", 4.0)
    assert r.nodes[D1].figures == {} and "kv_tokens" not in r.stats()["nodes"][3]
    r.probe_result(D1, True, "", 5.0)
    assert not r.nodes[D1].draining
    assert "decode-1: down" not in str(r.handle(entry("z"), "local", 5.1))


def test_the_router_routes_around_a_node_whose_handoffs_keep_failing() -> None:
    """Three handoffs in a row through D1 fail: it is routed around for 5 s (doubling after),
    while D0 can take the requests; when D0 cannot, D1 still serves; a completion through it
    trusts it again."""
    r = online_router()
    t = 0.0
    lines = []
    while r.nodes[D1].strikes < 3:
        t += 0.1
        (s,) = sends(r.handle(entry(f"x{t:.1f}"), "local", t), PrefillRequest)
        first = TokenResult(s.msg.request_id, 0, (10,), None, s.msg.nonce)
        r.handle(first, s.dest, t)
        if s.msg.decode_target == D1:
            why = "handoff lease expired: no part of the KV cache could be written"
            err = Error(ErrorCode.HANDOFF_TIMEOUT, why, s.msg.request_id, s.msg.nonce)
            lines += [e.text for e in r.handle(err, s.dest, t) if isinstance(e, Warn)]
        else:
            r.handle(TokenResult(s.msg.request_id, 1, (11,), "length", s.msg.nonce), D0, t)
    assert any("routing around decode-1 for 5s: 3 handoffs through it failed" in ln
               for ln in lines), lines  # fmt: skip
    targets = {sends(r.handle(entry(f"y{i}"), "local", t), PrefillRequest)[0].msg.decode_target
               for i in range(4)}  # fmt: skip
    assert targets == {D0}
    r.nodes[D0].active = r.capacity  # D0 full: D1 is all there is, and it serves
    (s,) = sends(r.handle(entry("z"), "local", t), PrefillRequest)
    assert s.msg.decode_target == D1
    r.handle(TokenResult(s.msg.request_id, 0, (10,), None, s.msg.nonce), s.dest, t)
    r.handle(TokenResult(s.msg.request_id, 1, (11,), "length", s.msg.nonce), D1, t)
    assert r.nodes[D1].strikes == 0 and not r.nodes[D1].avoided(t)


def test_a_decode_node_that_refuses_a_slot_sends_the_request_to_another_before_any_token() -> None:
    """The prefill node relays the decode node's refusal (full) before token 0: the client
    has seen nothing, so the request starts over on the other decode node, under a new wire
    id, and nothing runs twice under the old one."""
    r = online_router()
    (s,) = sends(r.handle(entry("q"), "local", 0.0), PrefillRequest)
    full = f"decode node {s.msg.decode_target} will not take the handoff: decode node full"
    out = r.handle(
        Error(ErrorCode.DECODE_REFUSED, full, s.msg.request_id, s.msg.nonce), s.dest, 0.1
    )
    assert delivered(out) == []  # the client hears nothing of it
    (again,) = sends(out, PrefillRequest)
    assert again.msg.decode_target != s.msg.decode_target
    assert again.msg.request_id != s.msg.request_id and r.counts["restarted"] == 1
    cancels = {c.dest for c in sends(out, CancelRequest)}
    assert cancels == {s.dest, s.msg.decode_target}  # what the old nodes hold of it is freed
    # Refused everywhere: after MAX_RESTARTS, the client gets the refusal.
    for _ in range(5):
        if not sends(out, PrefillRequest):
            break
        (s,) = sends(out, PrefillRequest)
        err = Error(ErrorCode.DECODE_REFUSED, "full", s.msg.request_id, s.msg.nonce)
        out = r.handle(err, s.dest, 0.2)
    (final,) = delivered(out)
    assert final.code == ErrorCode.DECODE_REFUSED and r.active == 0


def test_a_prefill_node_that_reports_progress_moves_the_handoff_deadline() -> None:
    r = online_router(handoff_timeout=10.0)
    (s,) = sends(r.handle(entry("p"), "local", 0.0), PrefillRequest)
    r.handle(TokenResult(s.msg.request_id, 0, (10,), None, s.msg.nonce), s.dest, 1.0)
    assert r.next_timer() == 11.0
    assert r.handle(Progress((s.msg.nonce,)), STRANGER, 5.0) == [
        Warn("debug", f"router: ignoring Progress from {STRANGER}")
    ]
    assert r.next_timer() == 11.0
    other = P1 if s.dest == P0 else P0
    r.handle(Progress((s.msg.nonce,)), other, 5.0)  # not its prefill node
    assert r.next_timer() == 11.0
    r.handle(Progress((s.msg.nonce + 1, s.msg.nonce)), s.dest, 5.0)
    assert r.next_timer() == 15.0


def test_lease_expiry_is_an_error_at_the_router_and_an_abort_at_decode() -> None:
    core = prefill()
    lease, _ = start(core)
    when = core.next_timer()
    assert when == 5.0  # 5 s with no part written (each one written renews it)
    out = core.on_timer(when)
    (err,) = sends(out, Error)
    assert err.dest == R and err.msg.code == ErrorCode.HANDOFF_TIMEOUT
    assert "lease expired" in err.msg.message
    (v,) = sends(out, HandoffVerdict)
    assert v.dest == D1 and not v.msg.commit
    assert FreeCache("r1") in out
    # The ack that comes too late gets an abort: the decode node must not read it.
    (late,) = sends(core.handle(HandoffAck("r1", lease, True), D1, 6.0))
    assert isinstance(late.msg, HandoffVerdict) and not late.msg.commit


def test_refused_handoff_digest_is_reported_to_the_router() -> None:
    core = prefill()
    lease, _ = start(core)
    out = core.handle(HandoffAck("r1", lease, False, "handoff digest mismatch"), D1, 1.0)
    (err,) = sends(out, Error)
    assert err.msg.code == ErrorCode.HANDOFF_FAILED and "digest mismatch" in err.msg.message
    assert FreeCache("r1") in out and core.active == 0


def test_an_ack_from_another_node_changes_nothing() -> None:
    core = prefill()
    lease, _ = start(core)
    (v,) = sends(core.handle(HandoffAck("r1", lease, True), D0, 1.0))
    assert v.dest == D0 and not v.msg.commit
    assert core.leases[lease].state is LeaseState.LEASED


def test_an_ack_naming_another_request_changes_nothing() -> None:
    """The right node and lease, but another request id: not an ack of this lease (a decode
    node that mixed two handoffs up must not commit either)."""
    core = prefill()
    lease, _ = start(core)
    (v,) = sends(core.handle(HandoffAck("r2", lease, True), D1, 1.0))
    assert v.dest == D1 and not v.msg.commit and v.msg.reason == "no such lease"
    assert core.leases[lease].state is LeaseState.LEASED and core.counts["late_acks"] == 1
    (v,) = sends(core.handle(HandoffAck("r1", lease, True), D1, 1.1), HandoffVerdict)
    assert v.msg.commit  # the real ack still commits


def test_cancel_while_leased_aborts_at_decode_and_frees() -> None:
    core = prefill()
    lease, _ = start(core)
    assert core.handle(CancelRequest("r1", "x"), STRANGER, 1.0) == []  # not its router
    out = core.handle(CancelRequest("r1", "client went away"), R, 1.0)
    (v,) = sends(out, HandoffVerdict)
    assert not v.msg.commit and FreeCache("r1") in out and core.active == 0


def test_undeliverable_handoff_and_lost_decode_are_errors() -> None:
    core = prefill()
    lease, out = start(core)
    (h,) = sends(out, KvHandoff)
    (err,) = sends(core.undeliverable(h, "connection refused", 1.0), Error)
    assert err.msg.code == ErrorCode.NODE_UNREACHABLE and "connection refused" in err.msg.message
    lease, _ = start(core, rid="r2")
    (err,) = sends(core.peer_lost(D1, 2.0), Error)
    assert "lost" in err.msg.message


def test_first_token_that_ends_the_stream_hands_nothing_off() -> None:
    core = prefill()
    lease, out = start(core, max_tokens=1)
    (t,) = sends(out)
    assert isinstance(t.msg, TokenResult) and t.msg.finish_reason == "length"
    assert FreeCache("r1") in out and core.active == 0


def test_lease_table_has_no_way_back_from_ended() -> None:
    with pytest.raises(IllegalTransition):
        LEASE_TABLE.next(LeaseState.ENDED, LeaseEvent.ACKED)


# --- decode ----------------------------------------------------------------------------------
def handoff(rid: str = "r1", lease: int = 5) -> KvHandoff:
    p = packed()
    h = KvHandoff(rid, lease, R, 42, 9, SamplingParams(max_tokens=3), (), 3, p.keys, p.values, b"")
    return dataclasses.replace(h, digest=digest_of(h, p.tensors))


def decode() -> DecodeCore:
    c = DecodeCore(DecodeConfig(vocab=100, max_len=64, max_sequences=4, verdict_wait=15.0))
    c.handle(QueryState(0), R, 0.0)  # the router has spoken to it (its figures poll)
    return c


def staged(core: DecodeCore, lease: int = 5) -> int:
    h = handoff(lease=lease)
    (job,) = [e.job for e in core.handle(h, P0, 0.0) if isinstance(e, StartCompute)]
    assert isinstance(job, VerifyJob)
    (ack,) = sends(core.verified(job.slot, None, 0.1))
    assert ack.dest == P0 and ack.msg.ok
    return job.slot


def test_decode_reads_a_handoff_only_after_the_commit() -> None:
    core = decode()
    slot = staged(core)
    assert core.reads == type(core.reads)() and core.slots[slot].state is SlotState.STAGED
    assert sends(core.handle(HandoffVerdict("r1", 5, True), P1, 0.2)) == []  # not its prefill
    out = core.handle(HandoffVerdict("r1", 5, True), P0, 0.2)
    (job,) = [e.job for e in out if isinstance(e, StartCompute)]
    assert isinstance(job, ResumeJob) and list(core.reads) == [(P0, 5)]
    out = core.token(slot, RunResult("slot", 0, (21,), None, 0), 0.3)
    (t,) = sends(out)
    assert t.dest == R and t.msg.index == 1 and t.msg.nonce == 42
    out = core.token(slot, RunResult("slot", 0, (22,), "length", 0), 0.4)
    assert sends(out)[0].msg.index == 2 and FreeCache("r1") in out and core.active == 0


def test_decode_frees_an_aborted_or_never_committed_handoff_unread() -> None:
    core = decode()
    staged(core)
    out = core.handle(HandoffVerdict("r1", 5, False, "lease expired"), P0, 1.0)
    assert out == [FreeCache("r1")] and not core.reads
    assert core.handle(handoff(), P0, 1.1) == []  # a late repeat of it opens nothing
    staged(core, lease=6)
    out = core.on_timer(0.1 + 15.0)
    (err,) = sends(out, Error)
    assert err.dest == R and err.msg.code == ErrorCode.HANDOFF_TIMEOUT
    assert FreeCache("r1") in out and not core.reads


def test_decode_refuses_a_corrupt_handoff() -> None:
    core = decode()
    (job,) = [e.job for e in core.handle(handoff(), P0, 0.0) if isinstance(e, StartCompute)]
    out = core.verified(job.slot, "handoff digest mismatch", 0.1)
    (ack,) = sends(out)
    assert not ack.msg.ok and "digest" in ack.msg.reason and FreeCache("r1") in out


def test_a_cancel_that_overtakes_its_handoff_refuses_it_later() -> None:
    core = decode()
    assert core.handle(CancelRequest("r1", "gone"), R, 0.0) == []
    (ack,) = sends(core.handle(handoff(), P0, 0.1))
    assert not ack.msg.ok and "cancelled" in ack.msg.reason and core.active == 0


def test_cancel_during_decode_frees_the_slot() -> None:
    core = decode()
    staged(core)
    core.handle(HandoffVerdict("r1", 5, True), P0, 0.2)
    assert sends(core.handle(CancelRequest("r1", "x"), STRANGER, 0.3)) == []  # not its router
    assert core.handle(CancelRequest("r1", "x"), R, 0.3) == [FreeCache("r1")]


def test_slot_table_refuses_a_commit_before_the_ack() -> None:
    with pytest.raises(IllegalTransition):
        SLOT_TABLE.next(SlotState.VERIFYING, SlotEvent.COMMIT)
    core = decode()
    core.handle(handoff(), P0, 0.0)
    (w,) = core.handle(HandoffVerdict("r1", 5, True), P0, 0.05)
    assert isinstance(w, Warn) and not core.reads


def test_a_verified_slot_keeps_no_payload_and_old_tombstones_do_not_match_new_ids() -> None:
    core = decode()
    slot = staged(core)
    assert core.slots[slot].handoff.keys == () and core.slots[slot].handoff.values == ()
    # A router restarted at the same address numbers its requests from 1 again, but the wire
    # ids carry its nonce: a cancel the old router sent refuses nothing of the new one.
    core.handle(CancelRequest("req-1@a1", "old router"), R, 1.0)
    (job,) = [
        e.job
        for e in core.handle(handoff("req-1@b7", lease=9), P0, 1.1)
        if isinstance(e, StartCompute)
    ]
    assert isinstance(job, VerifyJob)


def test_router_refuses_bad_requests_itself_and_redacts_addresses_for_clients() -> None:
    r = RouterCore([P0], [D0], vocab=100, max_len=64)
    for a in (P0, D0):
        r.probe_result(a, True, "", 0.0)
    for bad in (
        RunEntry("b1", 0, (1, 500), 0, SamplingParams(max_tokens=4), 1),
        RunEntry("b2", 0, (1,) * 60, 0, SamplingParams(max_tokens=8), 1),
    ):
        out = r.handle(bad, "local", 0.0)
        (err,) = delivered(out)
        assert err.code == ErrorCode.BAD_REQUEST and not sends(out)
    assert r.nodes[P0].dispatched == 0 and r.counts["failed"] == 0
    (s,) = sends(r.handle(entry("r1"), "local", 0.0), PrefillRequest)
    why = f"decode target {D0} is not in MLXCEL_DECODE_ALLOWLIST"
    out = r.handle(
        Error(ErrorCode.DECODE_TARGET_REFUSED, why, s.msg.request_id, s.msg.nonce), P0, 0.1
    )
    (err,) = delivered(out)
    assert D0 not in err.message and P0 not in err.message and "decode-0" in err.message
    (w,) = [e for e in out if isinstance(e, Warn)]
    assert D0 in w.text  # the operator's log keeps the address


def test_a_large_cache_travels_in_parts_and_is_reassembled_in_any_order() -> None:
    core = prefill(part_bytes=48)  # each 24-byte tensor is half a part: one layer a part
    k = Tensor("float32", (1, 1, 3, 2), bytes(range(24)))
    three = Packed(3, 9, (k, k, k), (k, k, k), tensor_digest((k, k, k), (k, k, k)))
    job = admitted(core)
    out = core.compute_done(job.lease, (9,), "length", None, three, (), 0.0)
    (first,) = sends(out, KvHandoff)  # one part at a time: the next once it is written
    (second,) = sends(core.sent(first, 0.01), KvHandoff)
    (third,) = sends(core.sent(second, 0.02), KvHandoff)
    assert sends(core.sent(third, 0.03), KvHandoff) == []
    parts = [s.msg for s in (first, second, third)]
    assert [(p.part, p.parts, p.pieces) for p in parts] == [
        (0, 3, (0, 1)),
        (1, 3, (2, 3)),
        (2, 3, (4, 5)),
    ]
    dec = decode()
    assert dec.handle(parts[2], P0, 0.1) == [] and dec.handle(parts[0], P0, 0.1) == []
    assert dec.handle(parts[0], P0, 0.1) == []  # a repeat changes nothing
    (job2,) = [e.job for e in dec.handle(parts[1], P0, 0.2) if isinstance(e, StartCompute)]
    assert isinstance(job2, VerifyJob) and job2.handoff.keys == (k, k, k)
    assert digest_of(job2.handoff, tensor_digest(job2.handoff.keys, job2.handoff.values)) == (
        job2.handoff.digest
    )
    # Parts that disagree, or that never all arrive, end the handoff unread.
    bad = decode()
    bad.handle(parts[0], P0, 0.0)
    (ack,) = sends(bad.handle(dataclasses.replace(parts[1], nonce=1), P0, 0.1))
    assert not ack.msg.ok and "disagree" in ack.msg.reason and bad.active == 0
    slow = decode()
    slow.handle(parts[0], P0, 0.0)
    (err,) = sends(slow.on_timer(15.0), Error)
    assert "only 1 of 3 handoff parts" in err.msg.message and not slow.reads


def test_a_tensor_larger_than_a_part_is_cut_into_row_ranges() -> None:
    """A part holds at most part_bytes: a layer larger than that goes as ranges of its rows
    (here parts of at most 20 bytes, of 8-byte rows, one straddling two tensors), joined
    exactly."""
    core = prefill(part_bytes=20)
    job = admitted(core)
    p = packed()
    out = core.compute_done(job.lease, (9,), "length", None, p, (), 0.0)
    pending, parts = sends(out, KvHandoff), []
    while pending:
        s = pending.pop(0)
        parts.append(s.msg)
        pending += sends(core.sent(s, 0.1), KvHandoff)
    assert [(m.pieces, [t.shape for t in m.keys]) for m in parts] == [
        ((0,), [(2, 2)]),
        ((0, 1), [(1, 2), (1, 2)]),
        ((1,), [(2, 2)]),
    ]
    whole = join(parts)
    assert not isinstance(whole, str) and whole.keys == p.keys and whole.values == p.values


def test_parts_are_checked_against_the_model_on_arrival() -> None:
    core = DecodeCore(DecodeConfig(vocab=100, max_len=64, dims=(2, 1, 2, 2)))
    core.handle(QueryState(0), R, 0.0)  # its router
    k = Tensor("float32", (1, 1, 3, 2), bytes(24))
    two = dataclasses.replace(handoff(), keys=(k, k), values=(k, k))
    plan = plan_parts(two, 24)
    h = part_of(two, plan, 0)
    assert [type(e) for e in core.handle(h, P0, 0.0)] == []  # part 0 of 4 kept
    # A layout of another model, or pieces of tensors it does not have: refused.
    for lease, bad in (
        (7, dataclasses.replace(h, lease=7, layout=h.layout[:2])),
        (8, dataclasses.replace(h, lease=8, layout=((1, 2, 3, 2),) * 4)),
        (9, dataclasses.replace(h, lease=9, pieces=(4,))),
    ):
        (ack,) = sends(core.handle(bad, P0, 0.0))
        assert not ack.msg.ok and ack.msg.lease == lease
    over = dataclasses.replace(part_of(two, plan, 1), keys=(Tensor("float32", (10, 2), bytes(80)),))
    (ack,) = sends(core.handle(over, P0, 0.1))
    assert not ack.msg.ok and "more than the handoff's tensors" in ack.msg.reason
    assert core.active == 0
    # ... and a late part of that handoff opens nothing.
    assert core.handle(part_of(two, plan, 2), P0, 0.2) == [] and core.active == 0


def test_router_bookkeeping_of_a_completed_a_failed_and_a_cancelled_request() -> None:
    """What the router counts and hands on, exactly: per request and per node, the
    logprobs and the client's nonce on what it delivers, the prefill node freed at the first
    token, and the handoff deadline moved forward by every token."""
    r = online_router(handoff_timeout=10.0)
    (s,) = sends(r.handle(entry("ok"), "local", 0.0), PrefillRequest)
    n, w, p, d = s.msg.nonce, s.msg.request_id, s.dest, s.msg.decode_target
    assert (r.nodes[p].active, r.nodes[d].active) == (1, 1)
    (first,) = delivered(r.handle(TokenResult(w, 0, (10,), None, n, (-0.5,)), p, 1.0))
    assert (first.micro_batch, first.nonce, first.logprobs) == (0, 7, (-0.5,))
    assert (r.nodes[p].active, r.nodes[d].active) == (1 - 1, 1)  # the prefill part is done
    assert r.on_timer(10.9) == []  # the deadline moved to 1.0 + 10 s with the first token
    r.handle(TokenResult(w, 1, (11,), None, n), d, 10.5)
    assert r.on_timer(20.4) == []  # ... and again with the next one
    r.handle(TokenResult(w, 2, (12,), "length", n), d, 20.5)
    assert r.counts["completed"] == 1 and r.nodes[p].completed == r.nodes[d].completed == 1
    assert (r.nodes[p].active, r.nodes[d].active) == (0, 0)
    # A failure: counted once, on both nodes, the client's nonce on the error.
    (s,) = sends(r.handle(entry("bad"), "local", 30.0), PrefillRequest)
    out = r.handle(
        Error(ErrorCode.FORWARD_FAILED, "boom", s.msg.request_id, s.msg.nonce), s.dest, 30.1
    )
    (err,) = delivered(out)
    assert err.nonce == 7 and err.code == ErrorCode.FORWARD_FAILED
    assert r.counts["failed"] == 1 and r.nodes[s.dest].failed == 1
    assert r.nodes[s.msg.decode_target].failed == 1
    assert [w.kind for w in out if isinstance(w, Warn)] == ["warning"]
    # A cancel: counted once, and both nodes told, with the reason.
    (s,) = sends(r.handle(entry("gone"), "local", 40.0), PrefillRequest)
    out = r.handle(CancelRequest("gone", "client went away"), "local", 40.1)
    assert r.counts["cancelled"] == 1 and r.active == 0
    assert {(c.dest, c.msg.reason) for c in sends(out, CancelRequest)} == {
        (s.dest, "cancelled"),
        (s.msg.decode_target, "cancelled"),
    }


# --- the router's cache-aware routing ----------------------------------------------------------
def chat_turn(r: RouterCore, rid: str, tokens: tuple[int, ...], ns: str, now: float) -> Send:
    e = RunEntry(rid, 0, tokens, 0, SamplingParams(max_tokens=1), 7, cache_ns=ns)
    (s,) = sends(r.handle(e, "local", now), PrefillRequest)
    assert s.msg.cache_ns == ns
    return s


def finish(r: RouterCore, s: Send, cached: int, kept: bool, now: float) -> RunResult:
    m = s.msg
    t = TokenResult(m.request_id, 0, (5,), "length", m.nonce, cached_tokens=cached, kept=kept)
    (out,) = delivered(r.handle(t, s.dest, now))
    return out


def test_a_turn_goes_to_the_prefill_node_that_reported_keeping_its_history() -> None:
    r = online_router()
    history = tuple(range(100, 140))
    first = chat_turn(r, "a1", history, "alice", 0.0)
    assert first.dest == P0
    assert finish(r, first, 0, True, 0.1).cached_tokens == 0
    # Round robin alone would now pick P1; the history is on P0.
    second = chat_turn(r, "a2", (*history, 7, 8), "alice", 0.2)
    assert second.dest == P0 and r.counts["cache_routed"] == 1
    assert finish(r, second, 40, True, 0.3).cached_tokens == 40  # passed on to the client
    # Another tenant's identical turn is routed by load, never by alice's records.
    assert chat_turn(r, "b1", (*history, 7, 8), "bob", 0.4).dest == P1
    assert r.counts["cache_routed"] == 1


def test_a_busier_node_or_a_node_that_evicted_the_history_is_not_chosen_for_it() -> None:
    r = online_router()
    history = tuple(range(100, 140))
    first = chat_turn(r, "a1", history, "alice", 0.0)
    finish(r, first, 0, True, 0.1)
    busy = [chat_turn(r, f"x{i}", (i + 1,), "", 0.2) for i in range(6)]  # 3 each, in flight
    assert {s.dest for s in busy[0::2]} == {P1} and {s.dest for s in busy[1::2]} == {P0}
    for s in busy[0::2]:  # P1's three end: P0 is now 3 busier than P1
        finish(r, s, 0, False, 0.3)
    assert chat_turn(r, "a2", (*history, 9), "alice", 0.4).dest == P1
    for s in busy[1::2]:
        finish(r, s, 0, False, 0.5)
    # P0 is free again and still holds the history; it serves less than promised (it evicted
    # it): the record goes, and the next turn is routed by load.
    s = chat_turn(r, "a3", (*history, 9, 9), "alice", 0.6)
    assert s.dest == P0
    finish(r, s, 0, False, 0.7)
    assert r.affinity.records(P0) == 0
    routed = r.counts["cache_routed"]
    chat_turn(r, "a4", (*history, 9, 9, 9), "alice", 0.8)
    assert r.counts["cache_routed"] == routed


def test_a_node_marked_down_loses_its_records_and_a_failover_drops_none_of_the_others() -> None:
    r = online_router()
    history = tuple(range(100, 140))
    finish(r, chat_turn(r, "a1", history, "alice", 0.0), 0, True, 0.1)  # on P0
    finish(r, chat_turn(r, "b1", tuple(range(200, 240)), "alice", 0.2), 0, True, 0.3)  # P1
    s = chat_turn(r, "a2", (*history, 1), "alice", 0.4)
    assert s.dest == P0  # P0 holds it ...
    out = r.undeliverable(s, "connection refused", 0.5, unsent=True)  # fails over to P1
    assert [x.dest for x in sends(out, PrefillRequest)] == [P1]
    assert r.affinity.records(P0) == 0  # marked down: its cache is not trusted when back
    (moved,) = sends(out, PrefillRequest)
    finish(r, moved, 0, True, 0.6)  # P1 served less than P0's record promised: not P1's
    assert r.affinity.records(P1) == 2
