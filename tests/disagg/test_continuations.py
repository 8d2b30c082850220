"""A conversation's next turn on the decode node that keeps it, exactly: the router's choice
(from the decode node's own report), the decode node's admission and refusals, its "not
cached" answer and the router's way around it, and the engine's check that its cache supplies
what the turn needs -- every effect compared with ``==`` where it matters."""

from __future__ import annotations

import dataclasses

from mlxcel.base.effects import Deliver, FreeCache, Send, StartCompute, Warn
from mlxcel.base.handoff import digest_of, tensor_digest
from mlxcel.base.messages import (
    CancelRequest,
    ContinueEntry,
    Error,
    ErrorCode,
    PrefillRequest,
    QueryState,
    RunEntry,
    RunResult,
    SamplingParams,
    TokenResult,
)
from mlxcel.disagg.decode_core import DecodeConfig, DecodeCore
from mlxcel.disagg.protocol import CONTINUE_MAX, ContinueJob, decode_namespace, min_cached
from mlxcel.disagg.router_core import RouterCore
from mlxcel.runtime.engine_core import EngineCore
from mlxcel.runtime.engine_state import EngineJob, EngineStep, Insert
from tests.disagg.test_decode_refusals import cut, decoding, handoff
from tests.disagg.test_disagg_cores import D0, D1, P0, P1, STRANGER, R, delivered, sends
from tests.disagg.test_disagg_cores import online_router as router

NS = "alice"
HISTORY = tuple(range(100, 140))


# --- the router --------------------------------------------------------------------------------
def turn(r: RouterCore, rid: str, tokens: tuple[int, ...], now: float, n: int = 3) -> Send:
    e = RunEntry(rid, 0, tokens, 0, SamplingParams(max_tokens=n), 7, cache_ns=NS)
    (s,) = sends(r.handle(e, "local", now), PrefillRequest)
    return s


def stream(r: RouterCore, s: Send, decode: str, tokens: list[int], now: float, kept: bool) -> None:
    """Token 0 from the node the prompt went to, the rest from ``decode``; the last says
    whether the decode node keeps the conversation."""
    m = s.msg
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        src = s.dest if i == 0 else decode
        msg = TokenResult(
            m.request_id, i, (t,), "length" if last else None, m.nonce, kept=kept and last
        )
        (out,) = delivered(r.handle(msg, src, now))
        assert isinstance(out, RunResult)


def kept_by_d0(r: RouterCore) -> tuple[int, ...]:
    """A first turn decoded on D0, which keeps it: the prompt and tokens 7, 8, 9."""
    first = turn(r, "a1", HISTORY, 0.0)
    assert (first.dest, first.msg.decode_target) == (P0, D0)
    stream(r, first, D0, [7, 8, 9], 0.1, kept=True)
    return (*HISTORY, 7, 8, 9)


def test_the_next_turn_goes_to_the_decode_node_that_keeps_it_and_needs_no_prefill_node() -> None:
    r = router()
    history = kept_by_d0(r)
    s = turn(r, "a2", (*history, 1, 2), 0.2)
    # To D0 itself, as a continuation: no decode target, and the positions its record
    # promises (the prompt and the reply but its last token, which may not have run).
    assert s.dest == D0
    assert s.msg == PrefillRequest(
        s.msg.request_id, (*history, 1, 2), SamplingParams(max_tokens=3), "", s.msg.nonce, NS, 42
    )
    assert r.counts["continued"] == 1 and r.nodes[D0].active == 2  # as prefill and decode
    # Every token from D0, index 0 too; then the counts are back to nothing.
    m = s.msg
    out = r.handle(TokenResult(m.request_id, 0, (4,), None, m.nonce, cached_tokens=42), D0, 0.3)
    assert delivered(out) == [RunResult("a2", 0, (4,), None, 7, cached_tokens=42)]
    out = r.handle(TokenResult(m.request_id, 1, (5,), "stop", m.nonce, kept=True), D0, 0.4)
    assert delivered(out) == [RunResult("a2", 0, (5,), "stop", 7)]
    assert r.active == 0 and r.nodes[D0].active == 0 and r.nodes[D0].completed == 2
    # ... and it keeps that turn too: the third goes there as well.
    assert turn(r, "a3", (*history, 1, 2, 4, 5, 6), 0.5).dest == D0


def test_a_long_new_part_another_tenant_or_a_busier_node_takes_the_usual_way() -> None:
    r = router()
    history = kept_by_d0(r)
    # More than CONTINUE_MAX new tokens: a prefill node runs it (the handoff carries it all).
    s = turn(r, "a2", (*history, *([3] * (CONTINUE_MAX + 1))), 0.2)
    assert s.dest in (P0, P1) and s.msg.decode_target in (D0, D1)
    # Another tenant's identical turn never goes by alice's record.
    e = RunEntry("b1", 0, (*history, 1), 0, SamplingParams(max_tokens=3), 7, cache_ns="bob")
    (s,) = sends(r.handle(e, "local", 0.3), PrefillRequest)
    assert s.dest in (P0, P1)
    # D0 three requests busier than D1: by load.
    busy = [turn(r, f"x{i}", (i + 1,), 0.4) for i in range(6)]
    for s in busy:
        if s.msg.decode_target == D1:
            stream(r, s, D1, [1], 0.4, kept=False)
    assert r.nodes[D0].active - r.nodes[D1].active >= 3
    s = turn(r, "a3", (*history, 1), 0.5)
    assert s.dest in (P0, P1)
    assert r.counts["continued"] == 0


def test_a_decode_node_that_no_longer_keeps_it_costs_a_reroute_never_an_error() -> None:
    r = router()
    history = kept_by_d0(r)
    s = turn(r, "a2", (*history, 1), 0.2)
    assert s.dest == D0
    why = "the prompt cache holds 0 of this prompt's tokens"
    out = r.handle(Error(ErrorCode.PREFIX_NOT_CACHED, why, s.msg.request_id, s.msg.nonce), D0, 0.3)
    # Started over under a new wire id through a prefill node (by load: none reported keeping
    # the first turn's prompt), D0 told to let go of the old id; the record is gone and the
    # restart is not one of the request's MAX_RESTARTS.
    (again,) = sends(out, PrefillRequest)
    assert again.dest in (P0, P1) and again.msg.decode_target in (D0, D1)
    assert again.msg.request_id != s.msg.request_id
    assert CancelRequest(
        s.msg.request_id, "decode-0 no longer keeps the conversation; restarted"
    ) in [c.msg for c in sends(out, CancelRequest)]
    assert delivered(out) == [] and r.routes["a2"].restarts == 0
    assert r.affinity.records(D0) == 0 and r.counts["continue_missed"] == 1
    stream(r, again, again.msg.decode_target, [1, 2, 3], 0.4, kept=False)
    assert r.active == 0 and r.counts["completed"] == 2


def test_a_continuation_the_decode_node_refuses_or_never_gets_starts_over_elsewhere() -> None:
    r = router()
    history = kept_by_d0(r)
    s = turn(r, "a2", (*history, 1), 0.2)
    refusal = Error(ErrorCode.DECODE_REFUSED, "decode node full", s.msg.request_id, s.msg.nonce)
    (again,) = sends(r.handle(refusal, D0, 0.3), PrefillRequest)
    # The usual way, its record gone; not a failed handoff (no strike against D0), not one of
    # the request's restarts.
    assert again.dest in (P0, P1) and again.msg.decode_target in (D0, D1)
    assert r.routes["a2"].restarts == 0 and r.nodes[D0].strikes == 0
    assert r.affinity.records(D0) == 0 and r.counts["continue_missed"] == 1
    keeper = again.msg.decode_target
    stream(r, again, keeper, [5, 6], 0.35, kept=True)
    # That node keeps the turn now: the next one goes there; it cannot be reached (the message
    # never left), so the turn starts over on the other nodes, that one avoided.
    s = turn(r, "a3", (*history, 2), 0.4)
    assert s.dest == keeper and s.msg.decode_target == ""
    (again,) = sends(r.undeliverable(s, "connection refused", 0.5, unsent=True), PrefillRequest)
    assert again.dest in (P0, P1) and again.msg.decode_target == ({D0, D1} - {keeper}).pop()


# --- the decode node ---------------------------------------------------------------------------
def decode(**kw: object) -> DecodeCore:
    base: dict = dict(vocab=1000, max_len=256, max_sequences=2, keeps=True)
    c = DecodeCore(DecodeConfig(**{**base, **kw}))
    c.handle(QueryState(0), R, 0.0)  # the router has spoken to it (its figures poll)
    return c


def ask(rid: str = "r1", tokens: tuple[int, ...] = HISTORY, cached: int = 30) -> PrefillRequest:
    return PrefillRequest(rid, tokens, SamplingParams(max_tokens=2), "", 9, NS, cached)


def refused(m: PrefillRequest, why: str, src: str = R, code: str = ErrorCode.DECODE_REFUSED):
    return [
        Warn("decode-refusal", f"decode: refused a continuation from {src} (request {m.request_id!r}): {why}"),
        Send(src, Error(code, why, m.request_id, m.nonce)),
    ]  # fmt: skip


def test_a_continuation_runs_from_the_cache_and_streams_every_token_itself() -> None:
    c = decode()
    m = ask()
    out = c.handle(m, R, 1.0)
    (start,) = out
    assert isinstance(start, StartCompute) and isinstance(start.job, ContinueJob)
    slot = start.job.slot
    # Looked up under the namespace as kept for this router: no other member finds it.
    assert start.job == ContinueJob(slot, "r1", HISTORY, m.sampling, decode_namespace(R, NS), 30)
    assert c.handle(m, R, 1.1) == []  # the same request again: it runs already
    first = RunResult("r1", 0, (5,), None, slot, cached_tokens=30)
    assert c.token(slot, first, 1.2) == [
        Send(R, TokenResult("r1", 0, (5,), None, 9, cached_tokens=30))
    ]
    last = RunResult("r1", 0, (6,), "length", slot, kept=True)  # the engine kept it
    assert c.token(slot, last, 1.3) == [
        Send(R, TokenResult("r1", 1, (6,), "length", 9, kept=True)),
        FreeCache("r1"),
    ]
    assert c.active == 0 and c.counts["continued"] == 1


def test_every_continuation_refusal_names_why_and_takes_nothing() -> None:
    m = ask()
    # Not a router of this node: a member that is not its router cannot make it prefill.
    assert decode().handle(m, STRANGER, 0.0) == refused(
        m, f"router {STRANGER} is not a router of this decode node", STRANGER
    )
    assert decode(routers=frozenset({R})).handle(m, P0, 0.0) == refused(
        m, f"router {P0} is not a router of this decode node", P0
    )
    why = "this decode node keeps no conversations (no prompt cache)"
    assert decode(keeps=False).handle(m, R, 0.0) == refused(m, why)
    c = decode(max_sequences=1)
    c.handle(ask("other"), R, 0.0)
    assert c.handle(m, R, 0.1) == refused(m, "decode node full (1 sequences)")
    c = decode()
    c.draining = True
    assert c.handle(m, R, 0.0) == refused(m, "this decode node is shutting down")
    c = decode()
    decoding(c, dataclasses.replace(handoff("r1"), router=R), now=0.0)
    assert c.handle(m, R, 0.1) == refused(m, "this node already decodes that request")
    c = decode()
    c.handle(CancelRequest("r1", "gone"), R, 0.0)  # overtook it
    assert c.handle(m, R, 0.1) == refused(m, "the router cancelled this request")
    bad = dataclasses.replace(m, token_ids=(5, 5000))
    assert decode().handle(bad, R, 0.0) == refused(
        bad, "token id outside the vocabulary [0, 1000)", code=ErrorCode.BAD_REQUEST
    )
    # What no router sends: a whole prompt to prefill, or more new tokens than a continuation
    # may bring -- a decode node never prefills a long prompt between its streams' steps.
    whole = ask(cached=0)
    why = (
        f"a continuation prefills at most {CONTINUE_MAX} new tokens here; this one would prefill 40"
    )
    assert decode().handle(whole, R, 0.0) == refused(whole, why)
    long = ask(tokens=tuple(range(CONTINUE_MAX + 20)), cached=10)
    why = (
        f"a continuation prefills at most {CONTINUE_MAX} new tokens here; this one would "
        f"prefill {CONTINUE_MAX + 10}"
    )
    assert decode(max_len=4096).handle(long, R, 0.0) == refused(long, why)


def test_not_cached_goes_back_to_the_router_and_a_cancel_or_a_lost_router_frees_the_slot() -> None:
    c = decode()
    (start,) = c.handle(ask(), R, 0.0)
    slot = start.job.slot  # type: ignore[union-attr]
    why = "the prompt cache holds 0 of this prompt's tokens, fewer than the 30 expected"
    err = Error(ErrorCode.PREFIX_NOT_CACHED, why, "r1", slot)
    assert c.token(slot, err, 0.1) == [
        Send(R, Error(ErrorCode.PREFIX_NOT_CACHED, why, "r1", 9)),
        FreeCache("r1"),
    ]
    assert c.counts["not_cached"] == 1 and c.active == 0
    (start,) = c.handle(ask("r2"), R, 0.2)
    assert c.handle(CancelRequest("r2", "client left"), R, 0.3) == [FreeCache("r2")]
    (start,) = c.handle(ask("r3"), R, 0.4)
    send = Send(R, TokenResult("r3", 0, (5,), None, 9))
    assert c.undeliverable(send, "connection reset", 0.5) == [FreeCache("r3")]


def test_a_handoffs_prompt_tokens_are_checked_in_whichever_order_its_parts_come() -> None:
    # The last token says what the engine did: kept, or not (over budget, or a handoff that
    # brought only part of its prompt's tokens, which the engine never keeps).
    for kept in (False, True):
        c = decode(vocab=100)
        h = dataclasses.replace(handoff("r1"), router=R, context=(1, 2, 3))
        slot = decoding(c, h, now=0.0)
        r = RunResult("r1", 0, (4,), "stop", slot, kept=kept)
        (msg,) = [e.msg for e in c.token(slot, r, 0.1) if isinstance(e, Send)]
        assert msg.kept is kept
    # Prompt tokens longer than the prompt, or outside the vocabulary: refused on arrival,
    # whole or in parts, whichever part comes first.
    for context in ((1, 2, 3, 4), (1, 2, 300)):
        h = dataclasses.replace(handoff("r3", lease=7, layers=2), router=R, context=context)
        h = dataclasses.replace(h, digest=digest_of(h, tensor_digest(h.keys, h.values)))
        out = decode(vocab=100).handle(h, P0, 0.0)
        assert [type(e) for e in out] == [Warn, Send] and not out[1].msg.ok  # type: ignore[union-attr]
        parts = cut(h)
        assert len(parts) == 4 and parts[0].context == context and not parts[1].context
        c = decode(vocab=100)
        assert c.handle(parts[1], P0, 0.0) == []  # a later part first: nothing to check yet
        out = c.handle(parts[0], P0, 0.1)
        assert isinstance(out[1], Send) and not out[1].msg.ok  # type: ignore[union-attr]
        assert "prompt tokens" in out[1].msg.reason and not c.slots  # type: ignore[union-attr]
    # A later part that carries prompt tokens: refused (they ride in the first part only).
    h = dataclasses.replace(handoff("r4", lease=8, layers=2), router=R, context=(1, 2))
    p1 = dataclasses.replace(cut(h)[1], context=(1,))
    out = decode(vocab=100).handle(p1, P0, 0.0)
    assert "first part only" in out[1].msg.reason  # type: ignore[union-attr]


def test_min_cached_never_asks_for_the_whole_prompt() -> None:
    assert min_cached(42, 50) == 42
    assert min_cached(50, 50) == 49  # an exact repeat: the last token always runs again
    assert min_cached(0, 1) == 0


# --- the engine ---------------------------------------------------------------------------------
def test_the_engine_ends_a_continuation_its_cache_fell_short_for_unrun() -> None:
    c = EngineCore({"vocab_size": 100, "max_position_embeddings": 64}, {0})
    e = RunEntry("c1", 0, (5, 6, 7, 8), 0, SamplingParams(max_tokens=4), 3, cache_ns=NS)
    assert c.handle(ContinueEntry(e, 3), "local", 0.0) == []
    assert c.on_timer(0.0) == [StartCompute(EngineJob(1, (Insert(e, min_cached=3),), (), {}, {}))]
    out = c.compute_done(1, EngineStep(steps=1, uncached={"c1": 1}), 0.1)
    why = (
        "the prompt cache holds 1 of this prompt's tokens, fewer than the 3 expected (evicted); "
        "nothing was prefilled"
    )
    assert out == [Deliver(Error(ErrorCode.PREFIX_NOT_CACHED, why, "c1", 3))]
    assert c.active == 0 and c.kv_tokens() == 0


def test_a_finished_sequence_says_whether_the_engine_kept_it() -> None:
    c = EngineCore({"vocab_size": 100, "max_position_embeddings": 64}, {0})
    e = RunEntry("k1", 0, (5, 6, 7), 0, SamplingParams(max_tokens=2), 3)
    c.handle(e, "local", 0.0)
    c.on_timer(0.0)
    out = c.compute_done(1, EngineStep(steps=1, new_uids={"k1": 1}), 0.1)
    assert not [e for e in out if isinstance(e, Deliver)]  # no token yet: nothing to say
    step = EngineStep(steps=1, stored={"k1"})
    step.tokens = [("k1", 9, None, None, None), ("k1", 8, "length", None, None)]
    out = c.compute_done(2, step, 0.2)
    assert out[0] == Deliver(RunResult("k1", 0, (9, 8), "length", 3, kept=True))


def test_a_cache_is_kept_only_under_exactly_the_tokens_it_holds() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.runtime.prompt_cache import covers

    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, 5, 2)), mx.zeros((1, 1, 5, 2)))
    assert covers([kv], 5) and not covers([kv], 3) and not covers([kv], 25)
