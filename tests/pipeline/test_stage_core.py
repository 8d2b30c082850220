"""The stage protocol as a table: state x message -> effects or a typed refusal.

No model, no event loop, no sockets: a StageCore gets messages with their authenticated
source and a time, and what it answers is compared with ``==``.
"""

from __future__ import annotations

import pytest

from mlxcel.base.effects import FreeCache, Send, StartCompute, Stopped
from mlxcel.base.errors import IllegalTransition
from mlxcel.base.messages import (
    Ack,
    Activation,
    BeginDrain,
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
    Shutdown,
    State,
    Tensor,
    Undecodable,
)
from mlxcel.pipeline.stage_core import StageCore
from mlxcel.pipeline.stage_protocol import (
    SEQ_TABLE,
    Sampled,
    SeqEvent,
    SeqState,
    StageConfig,
    StepFailed,
)

C, UP, DOWN, EVE = "10.0.0.1:7000", "10.0.1.1:7100", "10.0.1.3:7100", "10.0.0.66:7000"
SP = SamplingParams(max_tokens=8)
W = 4


def core(index: int = 1, n: int = 3, coordinator: str = C, **kw) -> StageCore:  # type: ignore[no-untyped-def]
    cfg = StageConfig(
        f"s{index}",
        index,
        n,
        coordinator,
        upstream=UP if index else None,
        downstream=DOWN if index + 1 < n else None,
        **kw,
    )
    return StageCore(cfg, width=W, vocab=16, layers=(index, index + 1))


def hidden(n: int = 1, width: int = W, dtype: str = "float32") -> Tensor:
    size = {"float32": 4, "int32": 4, "float16": 2}[dtype]
    return Tensor(dtype, (1, n, width), bytes(size * n * width))


def sends(effects: list) -> list[Send]:  # type: ignore[type-arg]
    return [e for e in effects if isinstance(e, Send)]


def errors(effects: list) -> list[tuple[str, str, int | None]]:  # type: ignore[type-arg]
    """(destination, code, nonce) of every Error sent."""
    return [(s.dest, s.msg.code, s.msg.nonce) for s in sends(effects) if isinstance(s.msg, Error)]


def prepared(c: StageCore, rid: str = "r", owner: str = C, nonce: int = 1) -> StageCore:
    out = c.handle(PrepareSequence(rid, 64, nonce), owner, 0.0)
    assert sends(out) == [Send(owner, Ack(rid, nonce))]
    return c


# --- authorization: who may send what ----------------------------------------------------------

COMMANDS = {
    "PrepareSequence": lambda: PrepareSequence("r", 64, 7),
    "CancelRequest": lambda: CancelRequest("r", "x"),
    "ReleaseSequence": lambda: ReleaseSequence("r"),
    "BeginDrain": lambda: BeginDrain("x"),
    "Shutdown": lambda: Shutdown("x"),
    "QueryState": lambda: QueryState(7),
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
@pytest.mark.parametrize("sender", [UP, DOWN, EVE])
def test_commands_only_from_the_coordinator(name: str, sender: str) -> None:
    c = prepared(core())
    before = dict(c.seqs)
    out = c.handle(COMMANDS[name](), sender, 1.0)
    nonce = 7 if name in ("PrepareSequence", "QueryState") else None
    assert errors(out) == [(sender, ErrorCode.NOT_COORDINATOR, nonce)]
    assert all(s.peer == (sender != EVE) for s in sends(out))  # a stranger: one-off connection
    assert c.seqs == before and c.state.value == "serving"
    assert c.stats.refused == 1


def test_run_entry_only_from_the_coordinator_and_only_at_the_entry_stage() -> None:
    entry = prepared(core(index=0))
    out = entry.handle(RunEntry("r", 0, (1,), 0, SP, 5), EVE, 1.0)
    assert errors(out) == [(EVE, ErrorCode.NOT_COORDINATOR, 5)]
    middle = prepared(core(index=1))
    out = middle.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    assert errors(out) == [(C, ErrorCode.NOT_ENTRY, 5)]


@pytest.mark.parametrize("sender", [C, DOWN, EVE])
def test_activations_only_from_upstream_told_to_the_owner_without_the_nonce(sender: str) -> None:
    c = prepared(core())
    out = c.handle(Activation("r", 0, hidden(), 0, SP, 5, owner=C), sender, 1.0)
    # The sender's nonce is not echoed: a stranger cannot fail a live exchange by guessing it.
    assert errors(out) == [(C, ErrorCode.NOT_UPSTREAM, None)]
    assert c.seqs["r"].state is SeqState.IDLE


def test_an_activation_for_an_unknown_sequence_is_dropped_without_a_reply() -> None:
    c = core()
    assert sends(c.handle(Activation("nobody", 0, hidden(), 0, SP, 5, owner=C), UP, 1.0)) == []
    assert c.stats.dropped == 1


def test_replies_go_to_the_authenticated_source_and_results_to_the_owner() -> None:
    c = prepared(core(index=2, n=3))
    out = c.handle(QueryState(9), C, 1.0)
    (s,) = sends(out)
    assert s.dest == C and isinstance(s.msg, State) and s.msg.nonce == 9 and s.msg.sequences == 1
    out = c.handle(Activation("r", 0, hidden(), 0, SP, 5, owner=C), UP, 1.0)
    (start,) = [e for e in out if isinstance(e, StartCompute)]
    out = c.compute_done(start.job.id, [Sampled(3, -0.5)], 0.01, 1.1)
    (s,) = sends(out)
    assert s.dest == C  # the owner, not the upstream stage that sent the activation
    assert isinstance(s.msg, RunResult) and s.msg.token_ids == (3,) and s.msg.nonce == 5


# --- ownership (a wildcard coordinator lets several identities pass the coordinator check) ----

WILD = "0.0.0.0:7000"
OWNER, OTHER = "10.0.0.1:7000", "10.0.0.2:7000"


@pytest.mark.parametrize(
    "msg",
    [
        PrepareSequence("r", 64, 9),
        RunEntry("r", 0, (1,), 0, SP, 9),
        CancelRequest("r", "x"),
        ReleaseSequence("r"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_a_sequence_belongs_to_the_identity_that_prepared_it(msg) -> None:  # type: ignore[no-untyped-def]
    c = prepared(core(index=0, coordinator=WILD), owner=OWNER)
    seq = c.seqs["r"]
    out = c.handle(msg, OTHER, 1.0)
    nonce = getattr(msg, "nonce", None)
    assert errors(out) == [(OTHER, ErrorCode.NOT_OWNER, nonce)]
    assert c.seqs["r"] is seq and seq.owner == OWNER and seq.state is SeqState.IDLE
    assert not [e for e in out if isinstance(e, (FreeCache, StartCompute))]


def test_a_wildcard_coordinator_accepts_only_its_port() -> None:
    c = core(coordinator=WILD)
    assert c.is_coordinator("10.9.9.9:7000") and not c.is_coordinator("10.0.0.1:7001")


def test_re_preparing_discards_the_old_cache_and_a_copy_of_the_claim_does_not() -> None:
    c = prepared(core(index=0))
    key = c.seqs["r"].key
    assert sends(c.handle(PrepareSequence("r", 64, 1), C, 1.0)) == [Send(C, Ack("r", 1))]
    assert c.seqs["r"].key == key and c.stats.duplicates == 1  # a duplicated frame: no reset
    out = c.handle(PrepareSequence("r", 64, 2), C, 1.0)
    assert FreeCache(key) in out and c.seqs["r"].key != key


def test_an_activation_of_another_owner_never_joins_this_owners_cache() -> None:
    c = prepared(core(), owner=C)
    out = c.handle(Activation("r", 0, hidden(), 0, SP, 5, owner=EVE), UP, 1.0)
    assert out and not sends(out) and c.seqs["r"].state is SeqState.IDLE
    assert c.stats.by_code[ErrorCode.NOT_OWNER] == 1


# --- the data path -----------------------------------------------------------------------------


def test_every_sampling_parameter_runs_and_the_claims_context_rides_with_each_step() -> None:
    """A pipeline applies what one process does (the final stage runs the processors, over the
    prompt's tail the claim carried): nothing is refused, nothing is dropped."""
    c = core(index=0)
    c.handle(PrepareSequence("r", 64, 1, context=(7, 8, 9)), C, 0.5)
    sp = SamplingParams(min_p=0.1, logit_bias_ids=(3,), logit_bias_values=(1.0,),
                        repetition_penalty=1.2, top_logprobs=2)  # fmt: skip
    out = c.handle(RunEntry("r", 0, (1,), 0, sp, 5), C, 1.0)
    assert errors(out) == []
    step = c.seqs["r"].step
    assert step is not None and step.sampling == sp and step.context == (7, 8, 9)


@pytest.mark.parametrize(
    "entry, code",
    [
        (RunEntry("nope", 0, (1,), 0, SP, 5), ErrorCode.NOT_PREPARED),
        (RunEntry("r", 0, (), 0, SP, 5), ErrorCode.BAD_REQUEST),
        (RunEntry("r", 0, (16,), 0, SP, 5), ErrorCode.BAD_REQUEST),  # vocab is 16
        (RunEntry("r", 0, (-1,), 0, SP, 5), ErrorCode.BAD_REQUEST),
        (RunEntry("r", 0, (1,), 3, SP, 5), ErrorCode.BAD_REQUEST),  # cache holds 0 positions
        (RunEntry("r", 0, (1,) * 65, 0, SP, 5), ErrorCode.BAD_REQUEST),  # beyond max_len 64
    ],
)
def test_bad_run_entries_are_refused_with_their_nonce(entry: RunEntry, code: str) -> None:
    c = prepared(core(index=0))
    out = c.handle(entry, C, 1.0)
    assert errors(out) == [(C, code, 5)]
    assert c.seqs["r"].state is SeqState.IDLE and c.seqs["r"].tokens == 0


@pytest.mark.parametrize(
    "tensor, words",
    [
        (hidden(dtype="int32"), "must be float"),
        (Tensor("float32", (2, 1, W), bytes(32)), "[1, n, width]"),
        (hidden(width=W + 1), "width"),
        (Tensor("float32", (1, 0, W), b""), "tokens"),
        (hidden(n=65), "prepared length"),
    ],
)
def test_out_of_bounds_activations_fail_the_owners_exchange(tensor: Tensor, words: str) -> None:
    c = prepared(core())
    out = c.handle(Activation("r", 0, tensor, 0, SP, 5, owner=C), UP, 1.0)
    (err,) = [s.msg for s in sends(out)]
    assert (err.code, err.nonce) in ((ErrorCode.BAD_ACTIVATION, 5), (ErrorCode.BAD_REQUEST, 5))
    assert words in err.message


def test_one_step_in_flight_a_copy_runs_once_and_a_failed_sequence_stays_failed() -> None:
    c = prepared(core(index=0))
    out = c.handle(RunEntry("r", 0, (1, 2), 0, SP, 5), C, 1.0)
    (start,) = [e for e in out if isinstance(e, StartCompute)]
    assert c.seqs["r"].state is SeqState.RUNNING
    assert c.handle(RunEntry("r", 0, (1, 2), 0, SP, 5), C, 1.1) == []  # a copy: no effect
    assert c.stats.duplicates == 1
    out = c.handle(RunEntry("r", 0, (3,), 2, SP, 6), C, 1.2)
    assert errors(out) == [(C, ErrorCode.STEP_IN_FLIGHT, 6)]
    out = c.compute_done(start.job.id, [StepFailed(ErrorCode.FORWARD_FAILED, "boom")], 0.1, 1.3)
    assert errors(out) == [(C, ErrorCode.FORWARD_FAILED, 5)]
    assert c.seqs["r"].state is SeqState.FAILED
    out = c.handle(RunEntry("r", 0, (3,), 0, SP, 7), C, 1.4)
    assert errors(out) == [(C, ErrorCode.SEQUENCE_FAILED, 7)]
    out = c.handle(ReleaseSequence("r"), C, 1.5)
    assert out == [FreeCache(("r", 1)), *[e for e in out if not isinstance(e, FreeCache)]]
    assert not c.seqs


def test_a_released_sequence_drops_the_answer_of_its_running_step() -> None:
    c = prepared(core(index=0))
    (start,) = [
        e for e in c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0) if isinstance(e, StartCompute)
    ]
    c.handle(ReleaseSequence("r"), C, 1.1)
    assert sends(c.compute_done(start.job.id, [hidden()], 0.1, 1.2)) == []


def test_decode_steps_batch_and_prompt_chunks_alternate_with_them() -> None:
    c = core(index=0, max_batch=2)
    for rid in ("a", "b", "c", "p"):
        prepared(c, rid)
    # Give a, b, c one cached position each (one job at a time).
    for rid in ("a", "b", "c"):
        (s,) = [
            e
            for e in c.handle(RunEntry(rid, 0, (1,), 0, SP, 1), C, 1.0)
            if isinstance(e, StartCompute)
        ]
        c.compute_done(s.job.id, [hidden()], 0.0, 1.0)
    # While a prompt chunk runs, three decode steps and another chunk queue up.
    (run,) = [
        e
        for e in c.handle(RunEntry("p", 0, (1, 2, 3), 0, SP, 2), C, 2.0)
        if isinstance(e, StartCompute)
    ]
    for rid in ("a", "b", "c"):
        assert c.handle(RunEntry(rid, 0, (2,), 1, SP, 3), C, 2.0) == []
    out = c.compute_done(run.job.id, [hidden(3)], 0.0, 2.1)
    (batch,) = [e for e in out if isinstance(e, StartCompute)]
    assert [s.request_id for s in batch.job.steps] == ["a", "b"]  # decodes batch, up to max_batch


def test_a_job_runs_one_micro_batch_oldest_first_and_a_bundle_is_decided_once() -> None:
    """Decode steps of micro-batches 0 and 1 arrive interleaved in one Bundle: the stage runs
    micro-batch 0 (the oldest step's) as one job, then micro-batch 1 -- never a mix, which
    would break both persistent batches. Nothing starts before the Bundle's last item."""
    c = core(index=0, max_batch=8)
    for rid in ("a", "b", "c", "d"):
        prepared(c, rid)
        (s,) = [
            e
            for e in c.handle(RunEntry(rid, 0, (1,), 0, SP, 1), C, 1.0)
            if isinstance(e, StartCompute)
        ]
        c.compute_done(s.job.id, [hidden()], 0.0, 1.0)
    steps = tuple(
        RunEntry(rid, mb, (2,), 1, SP, 3) for rid, mb in (("a", 0), ("b", 1), ("c", 0), ("d", 1))
    )
    out = c.handle_many(steps, C, 2.0)
    (first,) = [e for e in out if isinstance(e, StartCompute)]
    assert [(s.request_id, s.micro_batch) for s in first.job.steps] == [("a", 0), ("c", 0)]
    out = c.compute_done(first.job.id, [hidden(), hidden()], 0.0, 2.1)
    (second,) = [e for e in out if isinstance(e, StartCompute)]
    assert [s.request_id for s in second.job.steps] == ["b", "d"]


def test_a_stranger_bundle_gets_one_refusal_and_replies_in_a_bundle_get_none() -> None:
    """A Bundle from outside the cluster is refused once, not once per item (each refusal
    dials the sender back). From the upstream stage, items a stage never takes alone (an
    Error, an Ack, a RunResult) are dropped unanswered: answering them would let two stages
    trade refusals forever."""
    c = prepared(core(index=1))
    steps = tuple(RunEntry("r", 0, (1,), 0, SP, n) for n in range(50))
    out = c.handle_bundle(steps, EVE, 1.0)
    (refusal,) = [e for e in out if isinstance(e, Send)]
    assert refusal.dest == EVE and refusal.msg.code == ErrorCode.BAD_MESSAGE
    replies = (
        Error(ErrorCode.BAD_MESSAGE, "x", "r", 1),
        Ack("r", 1),
        RunResult("r", 0, (), None, 1),
    )
    assert c.handle_bundle(replies, UP, 2.0) == [] and c.stats.dropped == 3
    # A Bundle of what the upstream stage may send is handled item by item, as usual.
    out = c.handle_bundle((Activation("r", 0, hidden(), 0, SP, 7, owner=C),), UP, 3.0)
    assert [type(e).__name__ for e in out] == ["StartCompute"]


# --- drain, shutdown, leases, timeouts, lost peers -----------------------------------------------


def test_drain_refuses_new_sequences_and_shutdown_stops_after_the_last_release() -> None:
    c = prepared(core())
    assert sends(c.handle(BeginDrain("x"), C, 1.0)) == [Send(C, Ack("", 0))]
    out = c.handle(PrepareSequence("new", 64, 3), C, 1.0)
    assert errors(out) == [(C, ErrorCode.DRAINING, 3)]
    assert Stopped() not in c.handle(Shutdown("x"), C, 1.0)
    assert c.state.value == "stopping"
    assert Stopped() in c.handle(ReleaseSequence("r"), C, 2.0)
    assert c.state.value == "stopped"


def test_too_many_sequences() -> None:
    c = core(max_sequences=1)
    prepared(c, "a")
    assert errors(c.handle(PrepareSequence("b", 64, 2), C, 1.0)) == [
        (C, ErrorCode.TOO_MANY_SEQUENCES, 2)
    ]


def test_leases_free_idle_sequences_but_never_a_running_one() -> None:
    c = core(index=0, lease=10.0)
    prepared(c, "idle")
    c.handle(PrepareSequence("busy", 64, 2), C, 5.0)
    c.handle(RunEntry("busy", 0, (1,), 0, SP, 3), C, 5.0)
    assert c.next_timer() == 10.0  # the idle one's lease (the job's deadline is later)
    out = c.on_timer(10.0)
    assert FreeCache(("idle", 1)) in out and set(c.seqs) == {"busy"}
    assert c.stats.leases_expired == 1


def test_a_step_that_overruns_fails_and_its_late_answer_is_ignored() -> None:
    c = prepared(core(index=0, forward_timeout=2.0))
    (start,) = [
        e for e in c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0) if isinstance(e, StartCompute)
    ]
    assert c.next_timer() == 3.0
    assert errors(c.on_timer(3.0)) == [(C, ErrorCode.FORWARD_TIMEOUT, 5)]
    assert c.compute_done(start.job.id, [hidden()], 5.0, 6.0) == []
    assert not c.busy


def test_held_steps_are_reported_to_their_owner_every_interval_while_held() -> None:
    c = core(index=0, progress_interval=5.0, forward_timeout=60.0)
    prepared(c, "r")
    prepared(c, "q", nonce=2)
    out = c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    (start,) = [e for e in out if isinstance(e, StartCompute)]
    c.handle(RunEntry("q", 0, (1,) * 3, 0, SP, 6), C, 2.0)  # queued behind r's job
    assert c.next_timer() == 6.0
    assert sends(c.on_timer(6.0)) == [Send(C, Progress((5, 6)))]  # running and queued
    out = c.compute_done(start.job.id, [hidden()], 10.5, 10.0)  # r done; q's job starts
    (start,) = [e for e in out if isinstance(e, StartCompute)]
    assert sends(c.on_timer(11.0)) == [Send(C, Progress((6,)))]
    c.compute_done(start.job.id, [hidden(3)], 4.0, 15.0)
    assert sends(c.on_timer(16.0)) == [] and c.next_timer() == 310.0  # idle: r's lease only


def test_a_stage_whose_steps_are_fast_sends_no_progress() -> None:
    c = prepared(core(index=0, progress_interval=5.0))
    for i in range(4):
        t = 1.0 + 4 * i  # one step every 4 s, each done at once
        out = c.handle(RunEntry("r", 0, (1,), i, SP, 10 + i), C, t)
        (start,) = [e for e in out if isinstance(e, StartCompute)]
        c.compute_done(start.job.id, [hidden()], 0.01, t + 0.01)
        assert not [s for s in sends(c.on_timer(t + 3.0)) if isinstance(s.msg, Progress)]


def test_a_compute_thread_stuck_past_its_timeout_stops_the_reports() -> None:
    """Steps queued behind a job that overran its forward timeout are not progressing: the
    stage goes silent about them (so the coordinator's step deadline fails them) until the
    compute thread gives the abandoned job back."""
    c = core(index=0, progress_interval=5.0, forward_timeout=12.0, max_batch=1)
    prepared(c, "r")
    prepared(c, "q", nonce=2)
    out = c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    (stuck,) = [e for e in out if isinstance(e, StartCompute)]
    c.handle(RunEntry("q", 0, (1,), 0, SP, 6), C, 1.0)
    assert sends(c.on_timer(6.0)) == [Send(C, Progress((5, 6)))]
    out = c.on_timer(13.0)  # r's job overruns: r fails, q's job is started behind it
    assert errors(out) == [(C, ErrorCode.FORWARD_TIMEOUT, 5)]
    (queued,) = [e for e in out if isinstance(e, StartCompute)]
    assert c.next_timer() == 18.0 and sends(c.on_timer(18.0)) == []  # ticks, silent
    assert c.compute_done(stuck.job.id, [hidden()], 19.0, 20.0) == []  # the thread is back
    assert sends(c.on_timer(23.0)) == [Send(C, Progress((6,)))]
    assert queued.job.steps[0].nonce == 6


def test_losing_the_owner_frees_what_it_held() -> None:
    c = prepared(core())
    assert FreeCache(("r", 1)) in c.peer_lost(C, 1.0) and not c.seqs
    c = prepared(core())
    c.peer_lost(EVE, 1.0)
    assert "r" in c.seqs


def test_an_activation_that_cannot_be_passed_on_fails_its_request() -> None:
    c = prepared(core())
    act = Activation("r", 0, hidden(), 0, SP, 5, owner=C)
    assert errors(c.undeliverable(Send(DOWN, act), "refused", 1.0)) == [
        (C, ErrorCode.DOWNSTREAM_UNREACHABLE, 5)
    ]


def test_undecodable_messages_are_answered_where_they_can_be() -> None:
    c = prepared(core())
    bad = Undecodable(3, "r", 5, "tensor bytes do not match")
    assert errors(c.handle(bad, UP, 1.0)) == [(C, ErrorCode.BAD_MESSAGE, 5)]  # to the owner
    assert errors(c.handle(bad, C, 1.0)) == [(C, ErrorCode.BAD_MESSAGE, 5)]
    assert errors(c.handle(bad, EVE, 1.0)) == []


# --- the tables themselves -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "state, code",
    [
        (SeqState.QUEUED, ErrorCode.STEP_IN_FLIGHT),
        (SeqState.RUNNING, ErrorCode.STEP_IN_FLIGHT),
        (SeqState.FAILED, ErrorCode.SEQUENCE_FAILED),
    ],
)
def test_an_event_not_in_the_table_raises_from_the_lookup(state: SeqState, code: str) -> None:
    with pytest.raises(IllegalTransition) as info:
        SEQ_TABLE.next(state, SeqEvent.STEP)
    assert info.value.code == code


def test_every_state_has_a_way_out() -> None:
    for state in SeqState:
        assert any(SEQ_TABLE.allows(state, e) for e in SeqEvent), state
