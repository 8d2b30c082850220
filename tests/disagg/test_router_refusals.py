"""Every refusal, deadline and bookkeeping path of the router core, compared exactly.

Each test drives :class:`RouterCore` with messages and times and compares the *whole* list of
effects -- the client's error (code, text, id, nonce), the operator's log line, the cancels
and their reasons -- and the counters ``/router/stats`` shows. An assertion on one field
would let a changed message, a lost cancel or a miscounted node through.
"""

from __future__ import annotations

import pytest

from mlxcel.base.effects import Deliver, Send, Warn
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    HandoffAck,
    PrefillRequest,
    QueryState,
    RunEntry,
    RunResult,
    SamplingParams,
    TokenResult,
)
from mlxcel.disagg.router_core import RouterCore

P0, P1 = "127.0.0.2:9000", "127.0.0.3:9000"
D0, D1 = "127.0.0.4:9000", "127.0.0.5:9000"
STRANGER = "127.0.0.9:9000"
NONCE = 7  # the frontend's nonce on every entry


def sp(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def entry(rid: str, tokens: tuple[int, ...] = (1, 2, 3), max_tokens: int = 4) -> RunEntry:
    return RunEntry(rid, 0, tokens, 0, sp(max_tokens), NONCE)


def router(prefill: list[str], decode: list[str], **kw: object) -> RouterCore:
    r = RouterCore(prefill, decode, vocab=100, max_len=64, **kw)  # type: ignore[arg-type]
    for a in (*prefill, *decode):
        r.probe_result(a, True, "", 0.0)
    return r


def node_stats(r: RouterCore) -> dict[str, tuple]:
    """(healthy, dispatched, active, completed, failed, last_error) per node id."""
    return {
        n["id"]: (
            n["healthy"],
            n["dispatched"],
            n["active"],
            n["completed"],
            n["failed"],
            n["last_error"],
        )
        for n in r.stats()["nodes"]
    }


def failed(rid: str, code: str, why: str, client_why: str | None = None) -> list:
    """The two effects every failed request starts with: the client's error, the log line."""
    return [
        Deliver(Error(code, client_why or why, rid, NONCE)),
        Warn("warning", f"router: request {rid} failed: {why}"),
    ]


def cancel(dest: str, wire: str, why: str) -> Send:
    return Send(dest, CancelRequest(wire, why[:200]))


# --- construction --------------------------------------------------------------------------
def test_a_router_refuses_a_config_without_both_pools_or_with_a_repeated_peer() -> None:
    for prefill, decode in (([P0], []), ([], [D0]), ([], [])):
        with pytest.raises(ValueError, match="^a router needs at least one prefill and one decode"):
            RouterCore(prefill, decode)
    with pytest.raises(ValueError, match=f"^{P0} is listed twice among the router's peers$"):
        RouterCore([P0], [P0])
    r = RouterCore([P0, P1], [D0])
    assert [(n["id"], n["role"], n["address"]) for n in r.stats()["nodes"]] == [
        ("prefill-0", "prefill", P0),
        ("prefill-1", "prefill", P1),
        ("decode-0", "decode", D0),
    ]
    # Unknown until probed: no node is healthy, and nothing is admitted.
    assert [n["healthy"] for n in r.stats()["nodes"]] == [False, False, False]


# --- admission -----------------------------------------------------------------------------
def test_admission_refuses_each_bad_request_with_its_reason_and_accepts_the_edges() -> None:
    r = router([P0], [D0])
    ctx = "exceeds the model's context of 64"
    bad = [
        (entry("e", tokens=()), "empty prompt"),
        (entry("neg", tokens=(1, -1)), "token id outside the vocabulary [0, 100)"),
        (entry("big", tokens=(100,)), "token id outside the vocabulary [0, 100)"),
        (entry("zero", max_tokens=0), "max_tokens must be >= 1"),
        (
            entry("long", tokens=(1,) * 60, max_tokens=5),
            f"prompt (60 tokens) + max_tokens (5) {ctx}",
        ),
    ]
    for e, why in bad:
        assert r.handle(e, "local", 0.0) == [
            Deliver(Error(ErrorCode.BAD_REQUEST, why, e.request_id, NONCE))
        ]
    assert r.counts == {} and r.active == 0 and not r.routes
    # The edges are fine: token 0 and vocab-1, max_tokens 1, prompt + max_tokens == context.
    wires = []
    for i, e in enumerate(
        (
            entry("lo", tokens=(0, 99), max_tokens=1),
            entry("fit", tokens=(1,) * 60, max_tokens=4),
        )
    ):
        nonce = i + 1
        wire = f"{e.request_id}@{nonce:x}"
        req = PrefillRequest(wire, e.token_ids, e.sampling, D0, nonce)
        assert r.handle(e, "local", 2.0) == [Send(P0, req, deadline=2.0 + 5.0)]
        wires.append(wire)
    assert r.counts == {"routed": 2}
    # A request id already in flight is refused, and changes nothing of the first.
    assert r.handle(entry("lo"), "local", 2.5) == [
        Deliver(Error(ErrorCode.BAD_REQUEST, "duplicate request id", "lo", NONCE))
    ]
    assert node_stats(r) == {
        "prefill-0": (True, 2, 2, 0, 0, ""),
        "decode-0": (True, 2, 2, 0, 0, ""),
    }


def test_the_first_send_waits_no_longer_than_the_request_itself() -> None:
    r = router([P0], [D0], prefill_timeout=3.0, first_nonce=0x10)
    e = entry("r")
    assert r.handle(e, "local", 1.0) == [
        Send(P0, PrefillRequest("r@10", e.token_ids, e.sampling, D0, 0x10), deadline=4.0)
    ]
    assert r.next_timer() == 4.0


def test_no_node_available_names_each_node_of_the_pool_as_down_or_full() -> None:
    r = RouterCore([P0], [D0, D1], capacity=1)
    assert r.handle(entry("a"), "local", 0.0) == [
        Deliver(
            Error(
                ErrorCode.NO_NODE_AVAILABLE,
                "no prefill node can take the request (prefill-0: down)",
                "a",
                NONCE,
            )
        )
    ]
    r.probe_result(P0, True, "", 0.0)
    r.probe_result(D0, True, "", 0.0)
    assert len(r.handle(entry("b"), "local", 0.0)) == 1  # prefill-0 and decode-0 now full
    r.probe_result(P0, False, "probe timed out", 0.0)
    r.probe_result(P0, True, "", 0.0)  # back, but still at capacity
    out = r.handle(entry("c"), "local", 0.0)
    why = "no prefill node can take the request (prefill-0: full)"
    assert out == [Deliver(Error(ErrorCode.NO_NODE_AVAILABLE, why, "c", NONCE))]
    r.handle(CancelRequest("b", "gone"), "local", 0.1)
    r.probe_result(D0, False, "x", 0.1)
    why = "no decode node can take the request (decode-0: down, decode-1: down)"
    assert r.handle(entry("d"), "local", 0.2) == [
        Deliver(Error(ErrorCode.NO_NODE_AVAILABLE, why, "d", NONCE))
    ]
    assert r.counts == {"routed": 1, "cancelled": 1, "rejected": 3}


# --- what is not a result ------------------------------------------------------------------
def test_messages_that_are_not_results_are_ignored_and_counted() -> None:
    r = router([P0], [D0])
    assert r.handle(HandoffAck("x", 1, True), P0, 0.0) == [
        Warn("debug", f"router: ignoring HandoffAck from {P0}")
    ]
    assert r.handle(HandoffAck("x", 1, True), STRANGER, 0.0) == [
        Warn("debug", f"router: ignoring HandoffAck from {STRANGER}")
    ]
    # From the frontend, only entries and cancels mean something (and cancels of nothing).
    assert r.handle(TokenResult("x", 0, (1,), None, 1), "local", 0.0) == []
    assert r.handle(CancelRequest("nothing", "x"), "local", 0.0) == []
    assert r.counts == {"unexpected": 2}


def test_results_from_strangers_unknown_requests_and_wrong_nonces() -> None:
    r = router([P0], [D0])
    (s,) = r.handle(entry("r"), "local", 0.0)
    w, n = s.msg.request_id, s.msg.nonce
    drop = Warn(
        "router-drop",
        f"router: dropping result frame from {STRANGER}: not a configured --prefill-peers "
        "or --decode-peers address",
    )
    assert r.handle(TokenResult(w, 0, (5,), None, n), STRANGER, 0.1) == [drop]
    assert r.handle(Error("x", "y", w, n), STRANGER, 0.1) == [drop]
    # A configured node, a request the router does not know: a running one is told to stop.
    assert r.handle(TokenResult("old@9", 3, (5,), None, 9), D0, 0.1) == [
        Send(D0, CancelRequest("old@9", "no such request"))
    ]
    assert r.handle(TokenResult("old@9", 4, (5,), "stop", 9), D0, 0.1) == []  # finished
    assert r.handle(Error(ErrorCode.FORWARD_FAILED, "x", None, None), D0, 0.1) == []
    assert r.handle(Error(ErrorCode.FORWARD_FAILED, "x", w, n + 1), P0, 0.1) == []
    # An index-0 token from the decode node, an index the stream already passed: dropped.
    assert r.handle(TokenResult(w, 0, (5,), None, n), D0, 0.1) == []
    assert r.handle(TokenResult(w, 0, (5,), None, n), P0, 0.2) == [
        Deliver(RunResult("r", 0, (5,), None, NONCE))
    ]
    assert r.handle(TokenResult(w, 0, (5,), None, n), P0, 0.3) == []
    assert r.counts == {"routed": 1, "router_drop": 2, "stale": 6}
    assert r.active == 1


def test_an_error_from_either_node_fails_the_request_and_cancels_the_other() -> None:
    r = router([P0], [D0])
    long_reason = "x" * 300
    for source, other, rid in ((P0, D0, "a"), (D0, P0, "b")):
        (s,) = r.handle(entry(rid), "local", 0.0)
        w, n = s.msg.request_id, s.msg.nonce
        out = r.handle(Error(ErrorCode.FORWARD_FAILED, long_reason, w, n), source, 0.5)
        node = "prefill-0" if source == P0 else "decode-0"
        why = f"{node}: {long_reason}"
        assert out == failed(rid, ErrorCode.FORWARD_FAILED, why) + [cancel(other, w, why)]
        assert len(out[-1].msg.reason) == 200  # a cancel's reason is cut to 200 characters
    assert r.counts == {"routed": 2, "failed": 2}
    assert node_stats(r) == {
        "prefill-0": (True, 2, 0, 0, 2, ""),
        "decode-0": (True, 2, 0, 0, 2, ""),
    }
    assert r.routes == {} and r.wire_ids == {}


def test_tokens_too_far_out_of_order_fail_the_request() -> None:
    r = router([P0], [D0])
    (s,) = r.handle(entry("r", max_tokens=60), "local", 0.0)
    w, n = s.msg.request_id, s.msg.nonce
    for i in range(2, 2 + 256):  # index 1 never comes: 256 tokens wait for it
        assert r.handle(TokenResult(w, i, (i % 100,), None, n), D0, 0.1) == []
    out = r.handle(TokenResult(w, 258, (1,), None, n), D0, 0.2)
    why = "tokens arrived too far out of order"
    assert out == failed("r", ErrorCode.HANDOFF_FAILED, why) + [cancel(D0, w, why)]


# --- deadlines -----------------------------------------------------------------------------
def test_each_phase_has_its_own_timeout_message_and_fires_exactly_at_its_deadline() -> None:
    r = router([P0], [D0], prefill_timeout=20.0, handoff_timeout=10.0)
    (a,) = r.handle(entry("a"), "local", 0.0)
    (b,) = r.handle(entry("b"), "local", 0.0)
    (c,) = r.handle(entry("c"), "local", 0.0)
    r.handle(TokenResult(b.msg.request_id, 0, (1,), None, b.msg.nonce), P0, 5.0)
    r.handle(TokenResult(c.msg.request_id, 0, (1,), None, c.msg.nonce), P0, 5.0)
    r.handle(TokenResult(c.msg.request_id, 1, (1,), None, c.msg.nonce), D0, 6.0)
    assert r.on_timer(14.999) == []
    both = (P0, D0)
    why_b = "handoff timeout: decode-0 did not start decoding within 10s of the first token"
    assert r.on_timer(15.0) == failed("b", ErrorCode.HANDOFF_TIMEOUT, why_b) + [
        cancel(d, b.msg.request_id, why_b) for d in both
    ]
    why_c = "handoff timeout: decode-0 sent no token for 10s"
    assert r.on_timer(16.0) == failed("c", ErrorCode.HANDOFF_TIMEOUT, why_c) + [
        cancel(d, c.msg.request_id, why_c) for d in both
    ]
    assert r.on_timer(19.9) == []
    why_a = "no first token from prefill-0 within 20s"
    assert r.on_timer(20.0) == failed("a", ErrorCode.HANDOFF_TIMEOUT, why_a) + [
        cancel(d, a.msg.request_id, why_a) for d in both
    ]
    assert r.active == 0 and r.next_timer() is None


def test_two_requests_that_time_out_together_both_fail() -> None:
    r = router([P0], [D0])
    r.handle(entry("a"), "local", 0.0)
    r.handle(entry("b"), "local", 0.0)
    out = r.on_timer(1000.0)
    assert [e.msg.request_id for e in out if isinstance(e, Deliver)] == ["a", "b"]
    assert r.counts["failed"] == 2


# --- probes and lost nodes -----------------------------------------------------------------
def test_probe_results_mark_nodes_up_and_down_with_the_reason_kept() -> None:
    r = RouterCore([P0], [D0])
    assert r.probe_result(STRANGER, True, "", 0.0) == []
    assert r.probe_result(P0, True, "", 0.0) == [Warn("info", "router: prefill-0 joined")]
    assert r.probe_result(P0, True, "", 1.0) == []
    assert r.probe_result(P0, False, "probe timed out", 2.0) == [
        Warn("warning", "router: prefill-0 lost: probe timed out")
    ]
    assert node_stats(r)["prefill-0"] == (False, 0, 0, 0, 0, "probe timed out")
    # Already down: no second log line, but the latest reason is kept (cut to 300 chars).
    assert r.probe_result(P0, False, "r" * 400, 3.0) == []
    assert node_stats(r)["prefill-0"][5] == "r" * 300
    assert r.probe_result(P0, False, "", 4.0) == []
    assert node_stats(r)["prefill-0"][5] == "unreachable (no reason given)"  # never blank
    # Back: how long it was down, and the last reason it was down for.
    assert r.probe_result(P0, True, "", 5.0) == [
        Warn(
            "info",
            "router: prefill-0 is back after 3.0s down (unreachable (no reason given))",
        )
    ]
    assert node_stats(r)["prefill-0"] == (True, 0, 0, 0, 0, "")
    # A node never seen up is "online" the first time (it was never down).
    r2 = RouterCore([P0], [D0])
    assert r2.probe_result(P0, False, "", 0.0) == []
    assert r2.probe_result(P0, True, "", 1.0) == [Warn("info", "router: prefill-0 joined")]


def test_a_lost_prefill_node_fails_only_the_requests_still_waiting_for_it() -> None:
    r = router([P0], [D0])
    (a,) = r.handle(entry("a"), "local", 0.0)
    (b,) = r.handle(entry("b"), "local", 0.0)
    r.handle(TokenResult(b.msg.request_id, 0, (1,), None, b.msg.nonce), P0, 0.5)
    assert r.peer_lost(P0, 1.0) == [] and r.peer_lost(STRANGER, 1.0) == []
    out = r.probe_result(P0, False, "connection refused", 1.0)
    why = (
        "prefill node prefill-0 was lost before this request's first token and no other "
        "prefill node can take it"
    )
    assert out == [
        Warn("warning", "router: prefill-0 lost: connection refused"),
        *failed("a", ErrorCode.NO_NODE_AVAILABLE, why),
        cancel(D0, a.msg.request_id, why),
    ]
    assert list(r.routes) == ["b"]  # its prefill part was done: the decode node carries on
    # The suspicion is used up: the next failed probe only marks it down.
    r.probe_result(P0, True, "", 2.0)
    assert r.probe_result(P0, False, "timed out", 3.0) == [
        Warn("warning", "router: prefill-0 lost: timed out")
    ]
    # A lost decode node fails what it decodes, and its prefill node is told.
    r.peer_lost(D0, 4.0)
    out = r.probe_result(D0, False, "connection refused", 4.0)
    why = "decode node decode-0 was lost while serving this request"
    assert out == [
        Warn("warning", "router: decode-0 lost: connection refused"),
        *failed("b", ErrorCode.NODE_UNREACHABLE, why),
        cancel(P0, b.msg.request_id, why),
    ]


def test_a_request_with_no_token_out_starts_over_when_its_node_is_lost() -> None:
    r = router([P0, P1], [D0, D1])
    (a,) = r.handle(entry("a"), "local", 0.0)  # P0 + D0
    (b,) = r.handle(entry("b"), "local", 0.0)  # P1 + D1
    r.handle(TokenResult(b.msg.request_id, 0, (1,), None, b.msg.nonce), P1, 0.5)
    r.peer_lost(P0, 1.0)
    out = r.probe_result(P0, False, "timed out", 1.0)
    old = a.msg.request_id
    new = r.routes["a"]
    assert new.wire != old and new.nonce != a.msg.nonce
    why = "prefill-0 was lost; restarted"
    assert out == [
        Warn("warning", "router: prefill-0 lost: timed out"),
        cancel(P0, old, why),
        cancel(D0, old, why),
        Warn(
            "info",
            "router: request a restarted on prefill-1 and decode-0: prefill-0 was lost "
            "before its first token",
        ),
        Send(
            P1,
            PrefillRequest(new.wire, a.msg.token_ids, a.msg.sampling, D0, new.nonce),
            deadline=6.0,
        ),
    ]
    assert r.counts["restarted"] == 1 and r.counts["failed"] == 0
    # Nothing the old nodes send about the old wire id reaches the client.
    late = TokenResult(old, 0, (9,), None, a.msg.nonce)
    assert r.handle(late, P0, 1.5) == [Send(P0, CancelRequest(old, "no such request"))]
    # Counts follow the move: P0 holds nothing of it, P1 does (b's prefill part is done).
    assert [node_stats(r)[n][2] for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")] == [
        0,
        1,
        1,
        1,
    ]
    # Its first token comes from the new prefill node and reaches the client.
    first = TokenResult(new.wire, 0, (5,), None, new.nonce)
    assert r.handle(first, P1, 2.0) == [Deliver(RunResult("a", 0, (5,), None, NONCE, None))]
    # A stream already under way is not restarted: losing its decode node ends it.
    r.peer_lost(D0, 3.0)
    out = r.probe_result(D0, False, "timed out", 3.0)
    lost = "decode node decode-0 was lost while serving this request"
    assert out == [
        Warn("warning", "router: decode-0 lost: timed out"),
        *failed("a", ErrorCode.NODE_UNREACHABLE, lost),
        cancel(P1, new.wire, lost),
    ]
    assert list(r.routes) == ["b"]


def test_a_silent_open_connection_loses_the_node_at_once_a_failed_probe_only_marks_it() -> None:
    r = router([P0], [D0])
    (a,) = r.handle(entry("a"), "local", 0.0)
    # A routine probe that could not connect: down, its requests keep their chance.
    assert r.probe_result(D0, False, "no answer to a probe within 2s", 1.0) == [
        Warn("warning", "router: decode-0 lost: no answer to a probe within 2s")
    ]
    assert list(r.routes) == ["a"]
    r.probe_result(D0, True, "", 1.5)
    # A ping on its open connection that went unanswered: the node is lost, now.
    out = r.probe_result(D0, False, "no answer to a ping within 2.0s", 2.0, lost=True)
    why = (
        "decode node decode-0 was lost before this request's first token and no other "
        "decode node can take it"
    )
    assert out == [
        Warn("warning", "router: decode-0 lost: no answer to a ping within 2.0s"),
        *failed("a", ErrorCode.NO_NODE_AVAILABLE, why),
        cancel(P0, a.msg.request_id, why),
    ]
    assert r.routes == {}


def test_a_node_that_answers_after_its_connection_dropped_restarts_what_had_no_token() -> None:
    """Marked down by a probe, then its connection dropped, then it answers again (a short
    partition): what it was sent may be lost with that connection, so requests with no token
    out start over (here on the same nodes: the only ones), streaming ones carry on."""
    r = router([P0], [D0])
    (a,) = r.handle(entry("a"), "local", 0.0)
    (b,) = r.handle(entry("b"), "local", 0.0)
    r.handle(TokenResult(b.msg.request_id, 0, (1,), None, b.msg.nonce), P0, 0.5)
    r.probe_result(P0, False, "no answer to a probe within 2s", 1.0)
    assert list(r.routes) == ["a", "b"]  # a failed probe alone ends nothing
    r.peer_lost(P0, 2.0)
    out = r.probe_result(P0, True, "", 3.0)
    new = r.routes["a"]
    why = "prefill-0 dropped its connection; restarted"
    assert out == [
        Warn(
            "info",
            "router: prefill-0 is back after 2.0s down (no answer to a probe within 2s)",
        ),
        cancel(P0, a.msg.request_id, why),
        cancel(D0, a.msg.request_id, why),
        Warn(
            "info",
            "router: request a restarted on prefill-0 and decode-0: prefill-0 dropped its "
            "connection before its first token",
        ),
        Send(
            P0,
            PrefillRequest(new.wire, a.msg.token_ids, a.msg.sampling, D0, new.nonce),
            deadline=8.0,
        ),
    ]
    assert r.routes["b"].wire == b.msg.request_id  # already streaming: untouched
    assert r.probe_result(P0, True, "", 4.0) == []  # the suspicion is used up


def test_a_stream_whose_node_dropped_a_connection_must_go_on_within_the_grace() -> None:
    """A partition shorter than detection: the node answers probes again, but the tokens it
    sent on the connection that dropped are gone. The stream must not wait 30 s for them."""
    r = router([P0], [D0, D1])
    (a,) = r.handle(entry("a", max_tokens=8), "local", 0.0)  # P0 + D0
    (b,) = r.handle(entry("b", max_tokens=8), "local", 0.0)  # P0 + D1
    for s in (a, b):
        r.handle(TokenResult(s.msg.request_id, 0, (1,), None, s.msg.nonce), P0, 0.5)
        r.handle(
            TokenResult(s.msg.request_id, 1, (2,), None, s.msg.nonce), s.msg.decode_target, 0.6
        )
    assert r.peer_lost(D0, 1.0) == []  # nothing fails at once...
    assert r.next_timer() == 6.0  # ...but a's stream must go on by 1.0 + 5 s
    # b (another node) is untouched; a token from D1 changes nothing for a.
    r.handle(TokenResult(b.msg.request_id, 2, (3,), None, b.msg.nonce), D1, 2.0)
    # A token lost with the connection: index 3 arrives, 2 never does.
    r.handle(TokenResult(a.msg.request_id, 3, (4,), None, a.msg.nonce), D0, 2.5)
    assert r.on_timer(6.0 - 1e-6) == []
    why = (
        "decode node decode-0 dropped its connection and sent no token in the 5s since "
        "(tokens may have been lost with it)"
    )
    assert r.on_timer(6.0) == [
        *failed("a", ErrorCode.NODE_UNREACHABLE, why),
        cancel(P0, a.msg.request_id, why),
        cancel(D0, a.msg.request_id, why),
    ]
    assert list(r.routes) == ["b"]
    # A stream that goes on (its next token arrives in order) keeps its usual deadline.
    r.peer_lost(D1, 7.0)
    r.handle(TokenResult(b.msg.request_id, 3, (4,), None, b.msg.nonce), D1, 7.5)
    assert r.routes["b"].quiet_by is None and r.next_timer() == 7.5 + 30.0


def test_a_request_restarts_at_most_max_restarts_times() -> None:
    r = router([P0, P1], [D0])
    r.handle(entry("a"), "local", 0.0)
    for i in range(2):
        lost = r.routes["a"].prefill
        r.peer_lost(lost, 1.0 + i)
        r.probe_result(lost, False, "timed out", 1.0 + i)
        r.probe_result(lost, True, "", 1.0 + i)  # it comes back, and is lost again
    assert r.routes["a"].restarts == 2
    lost = r.routes["a"].prefill
    r.peer_lost(lost, 5.0)
    out = r.probe_result(lost, False, "timed out", 5.0)
    why = f"prefill node {r.nodes[lost].id} was lost while serving this request"
    assert out[1:] == [
        *failed("a", ErrorCode.NODE_UNREACHABLE, why),
        cancel(D0, "a@3", why),  # the other node: the decode node
    ]
    assert "a" not in r.routes and r.counts["restarted"] == 2


# --- sends that fail -----------------------------------------------------------------------
def test_an_unsent_prompt_fails_over_once_per_node_and_never_back() -> None:
    r = router([P0, P1], [D0])
    (s,) = r.handle(entry("r"), "local", 0.0)
    w, n = s.msg.request_id, s.msg.nonce
    assert s.dest == P0
    out = r.undeliverable(s, "connection refused", 1.0, unsent=True)
    moved = Send(P1, PrefillRequest(w, s.msg.token_ids, s.msg.sampling, D0, n), deadline=6.0)
    assert out == [Warn("warning", "router: prefill-0 lost: connection refused"), moved]
    assert r.counts == {"routed": 1, "failovers": 1}
    assert node_stats(r)["prefill-0"][:3] == (False, 1, 0)
    assert node_stats(r)["prefill-1"][:3] == (True, 1, 1)
    # prefill-0 answers a probe again, but this request already failed there: not back to it.
    r.probe_result(P0, True, "", 1.5)
    out = r.undeliverable(moved, "connection refused", 2.0, unsent=True)
    why = "no prefill node reachable (last: prefill-1: connection refused)"
    assert out == [
        Warn("warning", "router: prefill-1 lost: connection refused"),
        *failed("r", ErrorCode.NODE_UNREACHABLE, why),
        cancel(D0, w, why),
    ]
    assert node_stats(r)["prefill-0"][2] == node_stats(r)["prefill-1"][2] == 0


def test_a_send_that_may_have_arrived_fails_the_request_by_default() -> None:
    r = router([P0, P1], [D0])
    (s,) = r.handle(entry("r"), "local", 0.0)
    out = r.undeliverable(s, "send timed out", 1.0)  # not known to be unsent
    why = "sending the prompt to prefill-0 failed: send timed out"
    assert out == [
        Warn("warning", "router: prefill-0 lost: send timed out"),
        *failed("r", ErrorCode.NODE_UNREACHABLE, why),
        cancel(D0, s.msg.request_id, why),
    ]
    assert r.counts == {"routed": 1, "failed": 1}


def test_an_undeliverable_send_that_is_not_this_requests_prompt_changes_no_request() -> None:
    r = router([P0, P1], [D0])
    (s,) = r.handle(entry("r"), "local", 0.0)
    w, n = s.msg.request_id, s.msg.nonce
    down = [Warn("warning", "router: prefill-0 lost: refused")]
    names = {P0: "prefill-0", P1: "prefill-1"}
    for t, other in enumerate(
        (
            Send(P0, PrefillRequest(w, (1,), sp(), D0, n + 1)),  # another nonce
            Send(P1, PrefillRequest(w, (1,), sp(), D0, n)),  # another node than its prefill
            Send(P0, PrefillRequest("gone@1", (1,), sp(), D0, n)),  # no such request
            Send(P0, CancelRequest(w, "x")),  # a cancel: the node is gone anyway
        )
    ):
        # A minute apart: within one, a node going down and up this often is flapping, and
        # its membership lines are held (test_membership).
        out = r.undeliverable(other, "refused", 1.0 + 61 * t, unsent=True)
        assert out == [Warn("warning", f"router: {names[other.dest]} lost: refused")]
        r.probe_result(other.dest, True, "", 1.0 + 61 * t)
    assert r.undeliverable(Send(STRANGER, CancelRequest(w, "x")), "refused", 250.0) == []
    # After the first token the prompt has arrived: a late failure report changes nothing.
    r.handle(TokenResult(w, 0, (1,), None, n), P0, 250.0)
    assert r.undeliverable(s, "refused", 251.0, unsent=True) == down
    assert list(r.routes) == ["r"] and r.counts == {"routed": 1}


# --- endings and their bookkeeping ---------------------------------------------------------
def test_completions_free_both_nodes_and_count_once_per_request() -> None:
    r = router([P0], [D0])
    for rid in ("a", "b"):
        (s,) = r.handle(entry(rid), "local", 0.0)
        w, n = s.msg.request_id, s.msg.nonce
        assert node_stats(r)["prefill-0"][2] == 1
        r.handle(TokenResult(w, 0, (1,), None, n), P0, 0.1)
        assert node_stats(r)["prefill-0"][2] == 0 and node_stats(r)["decode-0"][2] == 1
        r.handle(TokenResult(w, 1, (2,), None, n), D0, 0.2)
        assert node_stats(r)["prefill-0"][2] == 0  # counted off once, at token 0
        out = r.handle(TokenResult(w, 2, (3,), "length", n, (-1.0,)), D0, 0.3)
        assert out == [Deliver(RunResult(rid, 0, (3,), "length", NONCE, (-1.0,)))]
    assert r.counts == {"routed": 2, "completed": 2}
    assert node_stats(r) == {
        "prefill-0": (True, 2, 0, 2, 0, ""),
        "decode-0": (True, 2, 0, 2, 0, ""),
    }
    assert r.routes == {} and r.wire_ids == {}


def test_a_prompt_that_ends_at_its_first_token_frees_both_nodes() -> None:
    r = router([P0], [D0])
    (s,) = r.handle(entry("r", max_tokens=1), "local", 0.0)
    out = r.handle(TokenResult(s.msg.request_id, 0, (4,), "length", s.msg.nonce), P0, 0.1)
    assert out == [Deliver(RunResult("r", 0, (4,), "length", NONCE))]
    assert node_stats(r) == {
        "prefill-0": (True, 1, 0, 1, 0, ""),
        "decode-0": (True, 1, 0, 1, 0, ""),
    }


def test_cancels_free_what_the_request_held_in_every_phase() -> None:
    r = router([P0], [D0])
    for rid, tokens in (("a", 0), ("b", 1), ("c", 2)):
        (s,) = r.handle(entry(rid), "local", 0.0)
        w, n = s.msg.request_id, s.msg.nonce
        for i in range(tokens):
            r.handle(TokenResult(w, i, (1,), None, n), P0 if i == 0 else D0, 0.1)
        out = r.handle(CancelRequest(rid, "client went away"), "local", 0.2)
        assert out == [cancel(P0, w, "cancelled"), cancel(D0, w, "cancelled")]
        assert node_stats(r)["prefill-0"][2] == node_stats(r)["decode-0"][2] == 0
    assert r.counts == {"routed": 3, "cancelled": 3}
    assert r.routes == {} and r.wire_ids == {}


def test_stats_name_the_metrics_and_count_every_failover() -> None:
    r = router([P0, P1], [D0])
    (s,) = r.handle(entry("r"), "local", 0.0)
    moved = r.undeliverable(s, "refused", 0.1, unsent=True)[-1]
    r.probe_result(P0, True, "", 0.2)
    r.handle(TokenResult(s.msg.request_id, 0, (1,), "stop", s.msg.nonce), P1, 0.3)
    assert isinstance(moved, Send) and moved.dest == P1
    (s,) = r.handle(entry("q"), "local", 1.0)
    r.undeliverable(s, "refused", 1.1, unsent=True)
    assert r.stats()["metrics"] == {
        "in_flight": 1,
        "routed": 2,
        "failovers": 2,
        "completed": 1,
    }
    # A token naming no request id at all is still answered with a cancel of that id.
    assert r.handle(TokenResult("", 1, (1,), None, 5), D0, 2.0) == [
        Send(D0, CancelRequest("", "no such request"))
    ]


# --- a decode node's refusal, handoffs that time out, dropped connections ---------------------
def test_a_refused_handoff_starts_over_on_another_decode_node_at_most_twice() -> None:
    r = router([P0], [D0, D1])
    (a,) = r.handle(entry("a"), "local", 0.0)  # P0 + D0
    r.handle(entry("b"), "local", 0.0)  # P0 + D1: the next pick would be D0 again
    refusal = "decode node full " + "x" * 250
    out = r.handle(Error(ErrorCode.DECODE_REFUSED, refusal, "a@1", a.msg.nonce), P0, 0.5)
    why = f"decode-0 refused the handoff ({refusal[:200]})"
    assert out == [
        cancel(P0, "a@1", f"{why}; restarted"),
        cancel(D0, "a@1", f"{why}; restarted"),
        Warn(
            "info",
            f"router: request a restarted on prefill-0 and decode-1: {why} before its first token",
        ),
        Send(P0, PrefillRequest("a@3", (1, 2, 3), sp(), D1, 3), deadline=5.5),
    ]
    assert node_stats(r) == {
        "prefill-0": (True, 3, 2, 0, 0, ""),
        "decode-0": (True, 1, 0, 0, 0, ""),
        "decode-1": (True, 2, 2, 0, 0, ""),
    }
    out = r.handle(Error(ErrorCode.DECODE_REFUSED, "full", "a@3", 3), P0, 0.6)
    assert out[-1] == Send(P0, PrefillRequest("a@4", (1, 2, 3), sp(), D0, 4), deadline=5.6)
    # Twice is the most: the third refusal reaches the client.
    out = r.handle(Error(ErrorCode.DECODE_REFUSED, "full", "a@4", 4), P0, 0.7)
    assert out == [
        *failed("a", ErrorCode.DECODE_REFUSED, "prefill-0: full"),
        cancel(D0, "a@4", "prefill-0: full"),
    ]
    # A refusal counts against the decode node that refused, and nothing else does.
    assert [r.nodes[n].strikes for n in (P0, D0, D1)] == [0, 1, 1]
    # Every node holds what it still serves: b, waiting for its first token.
    assert [node_stats(r)[n][2] for n in ("prefill-0", "decode-0", "decode-1")] == [1, 0, 1]


def test_a_restarted_request_fails_over_from_a_draining_prefill_node() -> None:
    r = router([P0, P1], [D0, D1])
    (a,) = r.handle(entry("a"), "local", 0.0)  # P0 + D0
    out = r.handle(Error(ErrorCode.DECODE_REFUSED, "full", "a@1", a.msg.nonce), P0, 0.1)
    assert out[-1] == Send(P1, PrefillRequest("a@2", (1, 2, 3), sp(), D1, 2), deadline=5.1)
    drain = Error(ErrorCode.DRAINING, "shutting down", "a@2", 2)
    assert r.handle(drain, P1, 0.2) == [
        Send(P0, PrefillRequest("a@2", (1, 2, 3), sp(), D1, 2), deadline=5.2)
    ]
    r.handle(TokenResult("a@2", 0, (5,), None, 2), P0, 0.3)  # P0's part is done
    assert [node_stats(r)[n][2] for n in ("prefill-0", "prefill-1", "decode-1")] == [0, 0, 1]


def test_a_decode_node_that_refuses_three_handoffs_in_a_row_is_routed_around() -> None:
    r = router([P0], [D0])
    for i in range(3):
        (s,) = r.handle(entry(f"r{i}"), "local", 1.0)
        out = r.handle(
            Error(ErrorCode.DECODE_REFUSED, "full", s.msg.request_id, s.msg.nonce),
            P0,
            1.0,
        )
    why = (
        "decode node decode-0 refused the handoff (full) before this request's first token "
        "and no other decode node can take it"
    )
    assert out == [
        Warn(
            "warning",
            "router: routing around decode-0 for 5s: 3 handoffs through it failed in a row "
            "(last: full)",
        ),
        *failed("r2", ErrorCode.NO_NODE_AVAILABLE, why),
        cancel(P0, s.msg.request_id, why),
    ]


def test_handoffs_that_time_out_count_against_both_nodes_and_the_third_routes_around() -> None:
    r = router([P0], [D0], handoff_timeout=10.0)
    for rid in ("a", "b"):
        (s,) = r.handle(entry(rid), "local", 0.0)
        r.handle(TokenResult(s.msg.request_id, 0, (1,), None, s.msg.nonce), P0, 0.0)
    why = "handoff timeout: decode-0 did not start decoding within 10s of the first token"
    assert r.on_timer(10.0) == [  # two at once: both fail
        *failed("a", ErrorCode.HANDOFF_TIMEOUT, why),
        cancel(P0, "a@1", why),
        cancel(D0, "a@1", why),
        *failed("b", ErrorCode.HANDOFF_TIMEOUT, why),
        cancel(P0, "b@2", why),
        cancel(D0, "b@2", why),
    ]
    assert (r.nodes[P0].strikes, r.nodes[D0].strikes) == (2, 2)
    (s,) = r.handle(entry("c"), "local", 11.0)
    r.handle(TokenResult(s.msg.request_id, 0, (1,), None, s.msg.nonce), P0, 11.0)
    line = "3 handoffs through it failed in a row (last: " + why + ")"
    assert r.on_timer(21.0) == [
        Warn("warning", f"router: routing around prefill-0 for 5s: {line}"),
        Warn("warning", f"router: routing around decode-0 for 5s: {line}"),
        *failed("c", ErrorCode.HANDOFF_TIMEOUT, why),
        cancel(P0, "c@3", why),
        cancel(D0, "c@3", why),
    ]
    # A prompt that times out before its first token is no handoff: no strike.
    r.handle(entry("d"), "local", 30.0)
    assert len(r.on_timer(r.next_timer())) == 4  # type: ignore[arg-type]
    assert (r.nodes[P0].strikes, r.nodes[D0].strikes) == (3, 3)


def test_errors_that_are_not_handoff_failures_leave_no_strike() -> None:
    r = router([P0], [D0])
    (s,) = r.handle(entry("a"), "local", 0.0)
    r.handle(Error(ErrorCode.FORWARD_FAILED, "boom", s.msg.request_id, s.msg.nonce), P0, 0.1)
    assert (r.nodes[P0].strikes, r.nodes[D0].strikes) == (0, 0)


def test_streams_on_a_dropped_decode_connection_fail_together_and_only_those() -> None:
    r = router([P0], [D0, D1])
    for rid in ("a", "b", "c"):  # a and c on D0, b on D1
        (s,) = r.handle(entry(rid, max_tokens=8), "local", 0.0)
        r.handle(TokenResult(s.msg.request_id, 0, (1,), None, s.msg.nonce), P0, 0.1)
        if rid != "c":  # c waits for its handoff: not streaming yet
            r.handle(
                TokenResult(s.msg.request_id, 1, (2,), None, s.msg.nonce), s.msg.decode_target, 0.2
            )
    r.peer_lost(P0, 1.0)  # the prefill node's connection: no stream waits on it
    assert [r.routes[x].quiet_by for x in "abc"] == [None, None, None]
    r.peer_lost(D0, 1.0)
    r.peer_lost(D0, 2.0)  # again: the first grace stands
    assert [r.routes[x].quiet_by for x in "abc"] == [6.0, None, None]
    (s,) = r.handle(entry("d", max_tokens=8), "local", 2.0)  # on D1
    r.handle(TokenResult(s.msg.request_id, 0, (1,), None, s.msg.nonce), P0, 2.1)
    r.handle(TokenResult(s.msg.request_id, 1, (2,), None, s.msg.nonce), D1, 2.2)
    r.peer_lost(D1, 3.0)
    out = r.on_timer(8.0)  # every stream whose grace ended fails, in one go
    assert [e.msg.request_id for e in out if isinstance(e, Deliver)] == ["a", "b", "d"]


def test_a_node_back_after_a_dropped_connection_restarts_its_own_requests_at_most_twice() -> None:
    def drop_and_answer(r: RouterCore, node: str, t: float) -> None:
        r.probe_result(node, False, "timed out", t)
        r.peer_lost(node, t)
        r.probe_result(node, True, "", t + 0.5)

    r = router([P0], [D0, D1])
    r.handle(entry("a"), "local", 0.0)  # P0 + D0
    r.handle(entry("b"), "local", 0.0)  # P0 + D1
    drop_and_answer(r, D0, 1.0)
    assert r.stats()["nodes"][1]["seen_at"] == 1.5  # decode-0 answered then
    assert (r.routes["a"].wire, r.routes["b"].wire) == ("a@3", "b@2")  # b: not on that node
    r = router([P0], [D0])
    r.handle(entry("a"), "local", 0.0)
    for t in (1.0, 2.0, 3.0):
        drop_and_answer(r, D0, t)
    assert r.routes["a"].restarts == 2 and r.counts["restarted"] == 2


def test_a_node_marked_down_by_a_failed_send_is_back_with_its_downtime() -> None:
    r = router([P0, P1], [D0])
    (s,) = r.handle(entry("a"), "local", 0.0)
    r.undeliverable(s, "connection refused", 1.0, unsent=True)
    assert r.probe_result(P0, True, "", 3.0) == [
        Warn("info", "router: prefill-0 is back after 2.0s down (connection refused)")
    ]


def test_a_draining_prefill_node_with_no_other_fails_the_request_with_its_words() -> None:
    r = router([P0], [D0])
    (s,) = r.handle(entry("a"), "local", 0.0)
    err = Error(ErrorCode.DRAINING, "this prefill node is shutting down", "a@1", s.msg.nonce)
    why = "no prefill node reachable (last: prefill-0: this prefill node is shutting down)"
    assert r.handle(err, P0, 0.1) == [
        *failed("a", ErrorCode.NODE_UNREACHABLE, why),
        cancel(D0, "a@1", why),
    ]


def test_token_alternatives_reach_the_client_and_figures_are_asked_for_exactly() -> None:
    r = router([P0], [D0])
    (s,) = r.handle(entry("a"), "local", 0.0)
    t = TokenResult("a@1", 0, (5,), None, s.msg.nonce, (-0.5,), (5, 6), (-0.5, -1.0))
    assert r.handle(t, P0, 0.1) == [
        Deliver(
            RunResult("a", 0, (5,), None, NONCE, (-0.5,), top_ids=(5, 6), top_logprobs=(-0.5, -1.0))
        )
    ]
    assert r.ask_figures(D0, 1.0) == [Send(D0, QueryState(0), deadline=3.0)]
