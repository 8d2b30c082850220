"""The coordinator protocol as a table: local requests and stage replies -> effects.

No model, no loop: a CoordinatorCore is driven by hand, playing the stages' part.
"""

from __future__ import annotations

import pytest

from mlxcel.base.effects import Answer, Deliver, ResetPeer, Send
from mlxcel.base.errors import IllegalTransition, PipelineError
from mlxcel.base.messages import (
    Ack,
    CancelRequest,
    Error,
    ErrorCode,
    PrepareSequence,
    Progress,
    QueryState,
    ReleaseSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    State,
    StepEntry,
    Tensor,
    Undecodable,
)
from mlxcel.pipeline.coordinator_core import REQ_TABLE, CoordinatorCore, ReqEvent, ReqState
from mlxcel.reactor.bus import LOCAL

S0, S1, S2 = "10.0.1.1:7100", "10.0.1.2:7100", "10.0.1.3:7100"
STAGES = [S0, S1, S2]
EOS = 15


def core(**kw) -> CoordinatorCore:  # type: ignore[no-untyped-def]
    opts = dict(eos={EOS}, vocab=16, max_len=64, step_timeout=2.0, prefill_step_size=4)
    opts.update(kw)
    return CoordinatorCore(STAGES, **opts)  # type: ignore[arg-type]


def sent(effects: list, cls: type) -> list[Send]:  # type: ignore[type-arg]
    """The sends of ``cls``; asked for RunEntry, a StepEntry's rows count too, each as the
    RunEntry it stands for (sampling aside: that went with PrepareSequence)."""
    out = []
    for e in effects:
        if isinstance(e, Send) and isinstance(e.msg, StepEntry) and cls is RunEntry:
            m = e.msg
            cols = (m.request_ids, m.token_ids, m.start_pos, m.nonces)
            for rid, tok, pos, nonce in zip(*cols, strict=True):
                row = RunEntry(rid, m.micro_batch, (tok,), pos, SamplingParams(), nonce)
                out.append(Send(e.dest, row, e.peer, e.deadline))
        elif isinstance(e, Send) and isinstance(e.msg, cls):
            out.append(e)
    return out


def delivered(effects: list) -> list:  # type: ignore[type-arg]
    return [e.msg for e in effects if isinstance(e, Deliver)]


def start(c: CoordinatorCore, rid: str = "r", prompt: tuple[int, ...] = (1,), n: int = 3):  # type: ignore[no-untyped-def]
    """Submit and ack on every stage; returns the first step's RunEntry."""
    out = c.handle(RunEntry(rid, 0, prompt, 0, SamplingParams(max_tokens=n), 77), LOCAL, 0.0)
    preps = sent(out, PrepareSequence)
    assert [p.dest for p in preps] == STAGES
    for p in preps:
        out = c.handle(Ack(rid, p.msg.nonce), p.dest, 0.1)
    (step,) = sent(out, RunEntry)
    assert step.dest == S0
    return step.msg


def test_a_request_prepares_fills_caches_in_chunks_decodes_and_releases() -> None:
    c = core()
    first = start(c, prompt=tuple(range(1, 11)), n=2)  # 9 prefix tokens: chunks of 4, 4, 1
    assert (first.token_ids, first.start_pos, first.sample) == ((1, 2, 3, 4), 0, False)
    out = c.handle(RunResult("r", 0, (), None, first.nonce), S2, 0.2)
    (second,) = [s.msg for s in sent(out, RunEntry)]
    assert (second.token_ids, second.start_pos) == ((5, 6, 7, 8), 4)
    out = c.handle(RunResult("r", 0, (), None, second.nonce), S2, 0.3)
    (third,) = [s.msg for s in sent(out, RunEntry)]
    out = c.handle(RunResult("r", 0, (), None, third.nonce), S2, 0.4)
    (step,) = [s.msg for s in sent(out, RunEntry)]
    assert (step.token_ids, step.start_pos, step.sample) == ((10,), 9, True)
    out = c.handle(RunResult("r", 0, (7,), None, step.nonce, compute_us=1000), S2, 0.5)
    assert delivered(out) == [RunResult("r", 0, (7,), None, 77)]
    (step,) = [s.msg for s in sent(out, RunEntry)]
    assert (step.token_ids, step.start_pos) == ((7,), 10)
    out = c.handle(RunResult("r", 0, (8,), None, step.nonce), S2, 0.6)
    assert delivered(out) == [RunResult("r", 0, (8,), "length", 77)]
    assert [s.dest for s in sent(out, ReleaseSequence)] == STAGES
    assert not c.reqs and c.completed == 1 and c.held == 0
    assert c.decode_steps == 2 and c.decode_compute_s == pytest.approx(0.001)


def test_eos_ends_the_request_without_a_token() -> None:
    c = core()
    step = start(c)
    out = c.handle(RunResult("r", 0, (EOS,), None, step.nonce), S2, 0.5)
    assert delivered(out) == [RunResult("r", 0, (), "stop", 77)]


@pytest.mark.parametrize(
    "source, result, why",
    [
        (S1, lambda n: RunResult("r", 0, (3,), None, n), "not from the final stage"),
        (S2, lambda n: RunResult("r", 0, (3,), None, n + 1000), "stale or unknown nonce"),
        (S2, lambda n: RunResult("x", 0, (3,), None, n), "request or micro-batch"),
        (S2, lambda n: RunResult("r", 1, (3,), None, n), "request or micro-batch"),
        (S2, lambda n: RunResult("r", 0, (), None, n), "exactly one token"),
        (S2, lambda n: RunResult("r", 0, (3, 4), None, n), "exactly one token"),
    ],
)
def test_results_that_do_not_match_the_waiting_exchange_are_dropped(source, result, why) -> None:  # type: ignore[no-untyped-def]
    c = core()
    step = start(c)
    out = c.handle(result(step.nonce), source, 0.5)
    assert delivered(out) == [] and not sent(out, RunEntry)
    (reason,) = c.dropped
    assert why in reason
    # The exchange keeps waiting: the right answer still completes the step.
    out = c.handle(RunResult("r", 0, (3,), None, step.nonce), S2, 0.6)
    assert delivered(out) == [RunResult("r", 0, (3,), None, 77)]


def test_a_chunk_result_must_carry_nothing() -> None:
    c = core()
    first = start(c, prompt=(1, 2, 3))
    c.handle(RunResult("r", 0, (3,), None, first.nonce), S2, 0.5)
    assert "no token" in next(iter(c.dropped))


def test_logits_must_have_the_models_shape() -> None:
    picked = []

    def pick(t: Tensor, sp: SamplingParams, state: object) -> tuple[int, object]:
        picked.append(t.shape)
        return 5, state

    c = core(return_logits=True, pick_token=pick)
    step = start(c)
    wrong = Tensor("float32", (1, 1, 15), bytes(60))
    c.handle(RunResult("r", 0, (), None, step.nonce, logits=wrong), S2, 0.5)
    assert c.dropped["logits of the wrong shape"] == 1
    right = Tensor("float32", (1, 1, 16), bytes(64))
    out = c.handle(RunResult("r", 0, (), None, step.nonce, logits=right), S2, 0.6)
    assert delivered(out) == [RunResult("r", 0, (5,), None, 77)] and picked == [(1, 1, 16)]


def test_acks_and_states_only_from_the_stage_addressed() -> None:
    c = core()
    out = c.handle(RunEntry("r", 0, (1,), 0, SamplingParams(max_tokens=2), 77), LOCAL, 0.0)
    p0 = sent(out, PrepareSequence)[0]
    c.handle(Ack("r", p0.msg.nonce), S1, 0.1)
    assert c.dropped["not from the stage the exchange addressed"] == 1
    token, out = c.query(S1, 0.0, 1.0)
    assert sent(out, QueryState)[0].dest == S1
    st = State("s1", (1, 2), 0, False, token)
    assert not [e for e in c.handle(st, S0, 0.1) if isinstance(e, Answer)]  # not addressed
    assert c.dropped["not from the stage the exchange addressed"] == 2
    assert c.handle(st, S1, 0.2) == [Answer(token, st)]


def test_errors_with_the_exchange_nonce_fail_the_request_at_once() -> None:
    c = core()
    step = start(c)
    # An error from a stage downstream of the one addressed counts for a RunResult exchange.
    out = c.handle(Error(ErrorCode.BAD_ACTIVATION, "bad", "r", step.nonce), S1, 0.5)
    (err,) = delivered(out)
    assert err.code == ErrorCode.BAD_ACTIVATION and err.nonce == 77
    assert [s.dest for s in sent(out, ReleaseSequence)] == STAGES
    assert c.failed == 1 and not c.reqs


def test_unmatched_or_misaddressed_errors_are_dropped() -> None:
    c = core()
    out = c.handle(RunEntry("r", 0, (1,), 0, SamplingParams(max_tokens=2), 77), LOCAL, 0.0)
    p0 = sent(out, PrepareSequence)[0]
    c.handle(Error("x", "y", "r", p0.msg.nonce), S1, 0.1)  # the Ack exchange addressed S0
    c.handle(Error("x", "y", "r", 10_000), S0, 0.1)
    c.handle(Error("x", "y", "r", p0.msg.nonce), "10.0.0.66:7000", 0.1)  # not a stage
    assert c.dropped == {
        "not from the stage the exchange addressed": 1,
        "unmatched error": 1,
        "not from a stage of this pipeline": 1,
    }
    assert c.reqs["r"].state is ReqState.PREPARING


def test_an_undecodable_answer_fails_its_exchange() -> None:
    c = core()
    step = start(c)
    out = c.handle(Undecodable(4, "r", step.nonce, "bad tensor"), S2, 0.5)
    assert delivered(out)[0].code == ErrorCode.BAD_MESSAGE


def test_a_missed_deadline_fails_the_request_and_resets_the_stream() -> None:
    c = core()
    step = start(c)
    assert c.next_timer() == pytest.approx(2.1)
    out = c.on_timer(2.1)
    assert ResetPeer(S0) in out
    (err,) = delivered(out)
    assert err.code == ErrorCode.DEADLINE_EXCEEDED and "within 2s" in err.message
    # A result that comes after the deadline is stale.
    assert delivered(c.handle(RunResult("r", 0, (3,), None, step.nonce), S2, 2.3)) == []
    assert c.dropped["stale or unknown nonce"] == 1 and c.failed == 1


def test_a_missed_deadline_on_a_live_path_fails_only_its_own_request() -> None:
    """Results for other requests arrived after it was sent: the stream works, so no reset
    (a reset makes the stage free every sequence we hold there)."""
    c = core()
    start(c, "a")
    b = start(c, "b")
    out = c.handle(RunResult("b", b.micro_batch, (3,), None, b.nonce), S2, 1.0)  # b progresses
    (b2,) = [s.msg for s in sent(out, RunEntry)]
    out = c.on_timer(2.1)  # a's deadline
    assert not [e for e in out if isinstance(e, ResetPeer)]
    assert [m.request_id for m in delivered(out)] == ["a"] and "b" in c.reqs
    out = c.on_timer(3.1)  # b2's deadline, nothing heard since it was sent: reset
    assert ResetPeer(S0) in out


def test_progress_from_a_stage_restarts_the_deadlines_of_the_exchanges_it_holds() -> None:
    """A stage still working on a step (kernels compiling, a long queue) is slow, not silent:
    its Progress keeps the exchange alive; one it does not name still misses its deadline."""
    c = core()
    a = start(c, "a")
    start(c, "b")
    assert c.handle(Progress((a.nonce,)), S0, 1.5) == []
    out = c.on_timer(2.1)  # b's deadline passes (a's was extended); S0 spoke, so no reset
    assert not [e for e in out if isinstance(e, ResetPeer)]
    assert [m.request_id for m in delivered(out)] == ["b"] and "a" in c.reqs
    assert c.kept_alive == 1  # /health: one exchange outlived a deadline thanks to Progress
    assert c.next_timer() == pytest.approx(3.5)
    c.handle(Progress((a.nonce,)), S1, 3.0)  # any stage of the pipeline may hold it
    assert delivered(c.on_timer(3.5)) == [] and c.next_timer() == pytest.approx(5.0)
    assert c.kept_alive == 1 and len(c.exchanges.deadlines) == 1  # counted once, one entry each
    out = c.handle(RunResult("a", a.micro_batch, (3,), None, a.nonce), S2, 4.5)  # still counts
    assert [m.token_ids for m in delivered(out)] == [(3,)]
    (a2,) = [s.msg for s in sent(out, RunEntry)]
    c.handle(Progress((a2.nonce,)), S1, 5.0)
    (err,) = delivered(c.on_timer(7.0))  # then silence: it fails, saying so
    assert err.code == ErrorCode.DEADLINE_EXCEEDED
    assert "within 2s of the last progress report (2.5s in all)" in err.message


def test_progress_from_a_stranger_or_for_other_exchanges_changes_nothing() -> None:
    c = core()
    step = start(c)
    c.handle(Progress((step.nonce,)), "10.0.0.66:7000", 1.0)  # not a stage of this pipeline
    assert c.dropped["not from a stage of this pipeline"] == 1
    c.handle(Progress((step.nonce + 100,)), S0, 1.0)  # no such exchange: ignored
    assert c.next_timer() == pytest.approx(2.1)
    # More nonces than there are exchanges (a copy of one, a million times) is refused whole.
    c.handle(Progress((step.nonce,) * 1_000_000), S0, 1.5)
    assert c.dropped["Progress names more exchanges than are waiting"] == 1
    assert len(delivered(c.on_timer(2.1))) == 1 and len(c.exchanges.deadlines) == 0
    # An exchange that waits for an Ack (preparing) is not kept alive by Progress.
    c2 = core()
    out = c2.handle(RunEntry("p", 0, (1,), 0, SamplingParams(max_tokens=2), 9), LOCAL, 0.0)
    preps = sent(out, PrepareSequence)
    for p in preps[:2]:
        c2.handle(Ack("p", p.msg.nonce), p.dest, 0.5)
    c2.handle(Progress((preps[2].msg.nonce,)), preps[2].dest, 1.9)
    assert [e.code for e in delivered(c2.on_timer(2.0))] == [ErrorCode.DEADLINE_EXCEEDED]


def test_a_reset_fails_every_request_in_the_stages_at_once() -> None:
    c = core(max_in_flight=2)
    start(c, "a")
    start(c, "b")  # sent at 0.1, like a
    c.handle(RunEntry("w", 0, (1,), 0, SamplingParams(max_tokens=2), 9), LOCAL, 0.5)  # waits
    out = c.on_timer(2.1)
    assert out[0] == ResetPeer(S0)
    codes = {m.request_id: m.code for m in delivered(out)}
    assert codes == {"a": ErrorCode.DEADLINE_EXCEEDED, "b": ErrorCode.STAGE_UNREACHABLE}
    # The waiting request is admitted afterwards, on fresh connections, and not failed.
    assert c.reqs["w"].state is ReqState.PREPARING
    assert [s.msg.request_id for s in sent(out, PrepareSequence)] == ["w"] * 3


def test_losing_a_stage_fails_requests_still_preparing_too() -> None:
    c = core()
    out = c.handle(RunEntry("r", 0, (1,), 0, SamplingParams(max_tokens=2), 77), LOCAL, 0.0)
    p1 = sent(out, PrepareSequence)[1]
    c.handle(Ack("r", p1.msg.nonce), S1, 0.1)  # S1 holds it; S0's Ack is still due
    out = c.peer_lost(S1, 0.2)
    assert delivered(out)[0].code == ErrorCode.STAGE_UNREACHABLE and not c.reqs


def test_a_health_query_that_times_out_does_not_reset() -> None:
    c = core()
    token, _ = c.query(S1, 0.0, 1.0, reset=False)
    out = c.on_timer(1.0)
    assert not [e for e in out if isinstance(e, ResetPeer)]
    (answer,) = out
    assert answer.token == token and isinstance(answer.value, PipelineError)


def test_losing_a_stage_fails_the_exchanges_that_need_it() -> None:
    c = core()
    start(c)
    out = c.peer_lost("10.0.0.99:1", 0.5)  # not a stage: nothing happens
    assert out == [] and c.reqs
    out = c.peer_lost(S1, 0.5)  # a RunResult exchange needs every stage
    assert delivered(out)[0].code == ErrorCode.STAGE_UNREACHABLE


def test_a_send_that_fails_fails_its_exchange() -> None:
    c = core()
    step = start(c)
    out = c.undeliverable(Send(S0, step), "connection refused", 0.5)
    assert delivered(out)[0].code == ErrorCode.STAGE_UNREACHABLE


def test_at_most_max_in_flight_and_waiting_requests_cancel_cleanly() -> None:
    c = core(max_in_flight=1)
    start(c, "a")
    out = c.handle(RunEntry("b", 0, (1,), 0, SamplingParams(max_tokens=2), 78), LOCAL, 0.2)
    assert out == [] and c.reqs["b"].state is ReqState.WAITING
    out = c.handle(CancelRequest("b", "client gone"), LOCAL, 0.3)
    assert out == [] and "b" not in c.reqs  # never prepared: nothing to release
    c.handle(RunEntry("c", 0, (1,), 0, SamplingParams(max_tokens=2), 79), LOCAL, 0.4)
    out = c.handle(CancelRequest("a", "client gone"), LOCAL, 0.5)
    assert [s.dest for s in sent(out, ReleaseSequence)] == STAGES
    assert [s.msg.request_id for s in sent(out, PrepareSequence)] == ["c"] * 3
    assert c.peak_in_flight == 1


def test_bad_local_requests_and_remote_entries() -> None:
    c = core()
    out = c.handle(RunEntry("r", 0, (16,), 0, SamplingParams(), 1), LOCAL, 0.0)
    assert delivered(out)[0].code == ErrorCode.BAD_REQUEST
    out = c.handle(RunEntry("r", 0, (1,) * 60, 0, SamplingParams(max_tokens=10), 1), LOCAL, 0.0)
    assert "exceeds the model's context of 64" in delivered(out)[0].message
    start(c, "dup")
    out = c.handle(RunEntry("dup", 0, (1,), 0, SamplingParams(), 2), LOCAL, 0.0)
    assert delivered(out)[0].message == "request id already running"
    assert c.handle(RunEntry("x", 0, (1,), 0, SamplingParams(), 3), S0, 0.0)
    assert c.dropped["RunEntry is only accepted locally"] == 1 and "x" not in c.reqs


def test_an_event_not_in_the_request_table_raises() -> None:
    with pytest.raises(IllegalTransition):
        REQ_TABLE.next(ReqState.PREPARING, ReqEvent.RESULT)
    with pytest.raises(IllegalTransition):
        REQ_TABLE.next(ReqState.DONE, ReqEvent.CANCEL)


def test_a_restarted_coordinator_does_not_reuse_nonces() -> None:
    """A stage that missed the restart would take a repeated nonce for a copy of the old
    claim (and keep its stale cache): each process starts its nonces elsewhere."""
    from mlxcel.pipeline.stage_core import StageCore
    from mlxcel.pipeline.stage_protocol import StageConfig

    stage = StageCore(StageConfig("s0", 0, 1, "C"), width=4, vocab=16, layers=(0, 1))
    first = CoordinatorCore(["s0"], eos=set(), vocab=16, max_len=64, first_nonce=1)
    out = first.handle(RunEntry("req-1", 0, (1,), 0, SamplingParams(max_tokens=2), 1), LOCAL, 0)
    stage.handle(sent(out, PrepareSequence)[0].msg, "C", 0.0)
    old_key = stage.seqs["req-1"].key
    # The process restarts: same request id, nonces from another starting point.
    again = CoordinatorCore(["s0"], eos=set(), vocab=16, max_len=64, first_nonce=1 << 40)
    out = again.handle(RunEntry("req-1", 0, (1,), 0, SamplingParams(max_tokens=2), 1), LOCAL, 0)
    (prep,) = sent(out, PrepareSequence)
    assert prep.msg.nonce == 1 << 40
    stage.handle(prep.msg, "C", 1.0)
    assert stage.seqs["req-1"].key != old_key  # a fresh claim, not a copy of the old one


def _admit(c: CoordinatorCore, rid: str, n: int = 3) -> list[Send]:
    """Submit ``rid`` (a one-token prompt) and ack it everywhere; what the last Ack sent."""
    out = c.handle(RunEntry(rid, 0, (1,), 0, SamplingParams(max_tokens=n), 5), LOCAL, 0.0)
    for p in sent(out, PrepareSequence):
        out = c.handle(Ack(rid, p.msg.nonce), p.dest, 0.1)
    return sent(out, RunEntry)


def test_decode_steps_of_one_micro_batch_travel_together() -> None:
    """Two micro-batches of two: a request whose step is ready waits while another of its
    micro-batch is in the stages, then both go in one burst; the other micro-batch is never
    held up by this one, and a member that ends releases the ones waiting on it."""
    c = core(max_in_flight=4, micro_batch_size=2)
    (a,) = [s.msg for s in _admit(c, "a")]
    (b,) = [s.msg for s in _admit(c, "b")]  # the emptiest micro-batch: the other one
    assert (a.micro_batch, b.micro_batch) == (0, 1)
    assert _admit(c, "c") == []  # micro-batch 0: a's step is still in the stages
    assert c.reqs["c"].micro_batch == 0
    # b's micro-batch goes on without waiting for micro-batch 0.
    out = c.handle(RunResult("b", 1, (3,), None, b.nonce), S2, 0.2)
    assert [s.msg.request_id for s in sent(out, RunEntry)] == ["b"]
    # a's result releases both a's next step and c's first one, together.
    out = c.handle(RunResult("a", 0, (3,), None, a.nonce), S2, 0.3)
    steps = [s.msg for s in sent(out, RunEntry)]
    assert sorted(m.request_id for m in steps) == ["a", "c"]
    assert {m.micro_batch for m in steps} == {0} and all(s.dest == S0 for s in sent(out, RunEntry))
    a2, c1 = sorted(steps, key=lambda m: m.request_id)
    # c's result comes first: it waits for a; a finishes (EOS) and c goes on alone.
    assert sent(c.handle(RunResult("c", 0, (4,), None, c1.nonce), S2, 0.4), RunEntry) == []
    out = c.handle(RunResult("a", 0, (EOS,), None, a2.nonce), S2, 0.5)
    assert [s.msg.request_id for s in sent(out, RunEntry)] == ["c"]
    assert c.reqs["c"].state is ReqState.DECODE and "a" not in c.reqs


def test_a_waiting_member_that_is_cancelled_leaves_no_trace() -> None:
    c = core(max_in_flight=2, micro_batch_size=2)
    (a,) = [s.msg for s in _admit(c, "a")]
    assert _admit(c, "b") == []  # waits for a
    c.handle(CancelRequest("b", "client left"), LOCAL, 0.2)
    out = c.handle(RunResult("a", 0, (3,), None, a.nonce), S2, 0.3)
    assert [s.msg.request_id for s in sent(out, RunEntry)] == ["a"]
    assert c.micro.parked == [[]] and c.micro.members == [1]


def test_a_lost_stage_fails_parked_requests_at_once_and_sends_nothing_for_them() -> None:
    """A request parked behind its micro-batch has no exchange open, but its caches on the
    stages are gone with the connection: it fails now, not at a deadline, and no RunEntry is
    sent for it to the stage that was given up."""
    c = core(max_in_flight=2, micro_batch_size=2)
    _admit(c, "a")
    assert _admit(c, "b") == []  # parked behind a
    out = c.peer_lost(S1, 0.5)
    assert sorted(m.request_id for m in delivered(out)) == ["a", "b"]
    assert sent(out, RunEntry) == [] and c.active == 0 and c.micro.members == [0]


def test_a_missed_deadline_that_resets_a_stage_sends_no_parked_step_to_it() -> None:
    """The timed-out request's end would release the requests parked behind it -- onto the
    connection just reset, for requests failed in the same breath. None is sent."""
    c = core(max_in_flight=2, micro_batch_size=2)
    _admit(c, "a")
    assert _admit(c, "b") == []  # parked behind a
    out = c.on_timer(2.2)  # a's deadline; nothing heard from the stages since
    assert ResetPeer(S0) in out and sent(out, RunEntry) == []
    codes = {m.request_id: m.code for m in delivered(out)}
    assert codes == {"a": ErrorCode.DEADLINE_EXCEEDED, "b": ErrorCode.STAGE_UNREACHABLE}
    assert not c.micro.holding and c.micro.members == [0]
