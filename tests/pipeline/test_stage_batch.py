"""The batched step messages on a stage, pinned word for word: StepEntry, StepActivation and
what a job's rows leave as (one StepActivation or StepResult per owner and micro-batch).

Every refusal of the per-sequence forms has its batched form here: a message malformed as a
whole is refused whole; otherwise each row is refused on its own (same code, same text) and
the other rows run.
"""

from __future__ import annotations

import pytest

from mlxcel.base.effects import Send, StartCompute, Warn
from mlxcel.base.messages import (
    MAX_STEP_ROWS,
    Activation,
    Error,
    ErrorCode,
    PrepareSequence,
    ReleaseSequence,
    RunEntry,
    RunResult,
    SamplingParams,
    StepActivation,
    StepEntry,
    StepResult,
    Tensor,
)
from mlxcel.pipeline.stage_core import StageCore
from mlxcel.pipeline.stage_protocol import ComputeJob, Row, Sampled, StageConfig, Step, StepFailed

# Stage cores of width W (4) and vocabulary 16, and the identities they know.
from tests.pipeline.test_stage_core_exact import DOWN, EVE, OTHER, UP, WILD, C, W, make

SP = SamplingParams(max_tokens=8, logprobs=True)
GREEDY = SamplingParams()


def prepare(
    c: StageCore, *rids: str, owner: str = C, sp: SamplingParams | None = SP, cached: int = 5
) -> None:
    """Prepare ``rids``, each with ``cached`` positions in its cache (its prompt ran): a step at
    that position is a decode step, and decode steps of one micro-batch run as one batch."""
    for i, rid in enumerate(rids):
        got = c.handle(PrepareSequence(rid, 64, 100 + i, (1, 2), sp), owner, 0.0)
        assert len(got) == 1
        c.seqs[rid].tokens = cached


def rows(n: int, fill: int = 0) -> Tensor:
    return Tensor("float32", (n, 1, W), bytes(range(fill, fill + 4 * W * n)))


def refusal(c: StageCore, kind: str, source: str, why: str) -> Warn:
    return Warn("stage-drop", f"stage {c.config.index}: refusing {kind} from {source}: {why}")


def row_step(c: StageCore, rid: str, token: int, pos: int, nonce: int, **kw: object) -> Step:
    seq = c.seqs[rid]
    opts: dict[str, object] = dict(owner=seq.owner, context=(1, 2), batched=True)
    opts.update(kw)
    return Step(seq.key, 0, (token,), None, 1, pos, seq.sampling or GREEDY, nonce, **opts)  # type: ignore[arg-type]


# --- a StepEntry ------------------------------------------------------------------------------


def test_a_step_entry_runs_its_rows_as_one_job_in_order() -> None:
    c = make()
    prepare(c, "a", "b")
    out = c.handle(StepEntry(0, ("b", "a"), (3, 4), (5, 5), (7, 8)), C, 1.0)
    # The batch runs in a fixed order (by sequence), whatever the order of the rows.
    steps = (row_step(c, "a", 4, 5, 8), row_step(c, "b", 3, 5, 7))
    assert out == [StartCompute(ComputeJob(1, steps, True, True, False))]


def test_a_step_entry_at_a_later_stage_or_from_a_stranger_is_refused_whole() -> None:
    c = make(1, 2)
    prepare(c, "a")
    why = "this stage is not the entry stage"
    assert c.handle(StepEntry(0, ("a", "b"), (1, 2), (0, 0), (5, 6)), C, 1.0) == [
        refusal(c, "StepEntry", C, why),
        Send(C, Error(ErrorCode.NOT_ENTRY, why, "a", 5)),  # each row's exchange hears it
        Send(C, Error(ErrorCode.NOT_ENTRY, why, "b", 6)),
    ]
    c = make()
    prepare(c, "a")
    why = "StepEntry is accepted only from the coordinator"
    assert c.handle(StepEntry(0, ("a",), (1,), (0,), (5,)), EVE, 1.0) == [
        refusal(c, "StepEntry", EVE, why),
        Send(EVE, Error(ErrorCode.NOT_COORDINATOR, why, None, None), False),
    ]
    assert not c.busy


@pytest.mark.parametrize(
    "msg, why",
    [
        (StepEntry(0, (), (), (), ()), "StepEntry with 0 rows (1..256)"),
        (
            StepEntry(0, tuple(f"r{i}" for i in range(257)), (1,) * 257, (0,) * 257, (1,) * 257),
            "StepEntry with 257 rows (1..256)",
        ),
        (
            StepEntry(0, ("a", "b"), (1,), (0, 0), (1, 2)),
            "StepEntry columns of different lengths for 2 rows",
        ),
        (
            StepEntry(0, ("a", "b"), (1, 1), (0, 0), (1,)),
            "StepEntry columns of different lengths for 2 rows",
        ),
        (StepEntry(0, ("a", "a"), (1, 2), (0, 0), (1, 2)), "StepEntry names a request id twice"),
    ],
    ids=["empty", "over-the-bound", "tokens", "nonces", "duplicate"],
)
def test_a_malformed_step_entry_is_refused_whole(msg: StepEntry, why: str) -> None:
    """Refused whole, and each (request id, nonce) row it names hears it (once each, at most
    256 of them), so no exchange of the coordinator's waits out its deadline."""
    c = make()
    prepare(c, "a", "b")
    rows = dict.fromkeys(zip(msg.request_ids[:256], msg.nonces[:256], strict=False))
    errors = [Send(C, Error(ErrorCode.BAD_REQUEST, why, r, n)) for r, n in rows or [(None, None)]]
    assert c.handle(msg, C, 1.0) == [refusal(c, "StepEntry", C, why), *errors]
    assert len(errors) == {"empty": 1, "over-the-bound": 256}.get(_id(msg), len(errors))
    assert not c.busy and c.stats.by_code == {ErrorCode.BAD_REQUEST: 1}
    assert MAX_STEP_ROWS == 256


def _id(msg: StepEntry) -> str:
    return (
        "empty" if not msg.request_ids else "over-the-bound" if len(msg.request_ids) > 256 else ""
    )


def test_each_bad_row_is_refused_on_its_own_and_the_others_run() -> None:
    c = make(coordinator=WILD)
    prepare(c, "ok", "far", "big")
    prepare(c, "theirs", owner=OTHER)
    c.handle(PrepareSequence("short", 1, 9, (), SP), C, 0.0)
    msg = StepEntry(
        0,
        ("nope", "ok", "theirs", "far", "vocab", "short"),
        (1, 2, 3, 4, 16, 5),
        (5, 5, 5, 3, 5, 1),
        (11, 12, 13, 14, 15, 16),
    )
    prepare(c, "vocab")
    out = c.handle(msg, C, 1.0)
    whys = [
        ("nope", 11, ErrorCode.NOT_PREPARED, "no sequence 'nope' here"),
        ("theirs", 13, ErrorCode.NOT_OWNER, "request 'theirs' is owned by another identity"),
        (
            "far",
            14,
            ErrorCode.BAD_REQUEST,
            "start_pos 3 does not follow the 5 positions cached for 'far'",
        ),
        ("vocab", 15, ErrorCode.BAD_REQUEST, "token id outside the vocabulary [0, 16)"),
        (
            "short",
            16,
            ErrorCode.BAD_REQUEST,
            "start_pos 1 does not follow the 0 positions cached for 'short'",
        ),
    ]
    expected: list[object] = []
    for rid, nonce, code, why in whys:
        expected += [refusal(c, "StepEntry", C, why), Send(C, Error(code, why, rid, nonce))]
    job = ComputeJob(1, (row_step(c, "ok", 2, 5, 12),), True, True, False)
    assert out == [*expected, StartCompute(job)]
    assert c.stats.refused == 5


def test_a_row_past_the_prepared_length_and_a_row_with_no_sampling_at_the_final_stage() -> None:
    c = make()
    c.handle(PrepareSequence("short", 1, 9, (), SP), C, 0.0)
    prepare(c, "plain", sp=None)
    c.handle(StepEntry(0, ("short",), (1,), (0,), (20,)), C, 1.0)
    c.compute_done(1, [Sampled(3, -0.5)], 0.0, 1.0)
    out = c.handle(StepEntry(0, ("short", "plain"), (3, 4), (1, 0), (21, 22)), C, 2.0)
    past, unset = (
        "token ids beyond the prepared length",
        "'plain' was prepared without sampling parameters",
    )
    assert out == [
        refusal(c, "StepEntry", C, past),
        Send(C, Error(ErrorCode.BAD_REQUEST, past, "short", 21)),
        refusal(c, "StepEntry", C, unset),
        Send(C, Error(ErrorCode.BAD_REQUEST, unset, "plain", 22)),
    ]


def test_a_copy_of_a_step_entry_runs_once() -> None:
    c = make()
    prepare(c, "a", "b")
    msg = StepEntry(0, ("a", "b"), (3, 4), (5, 5), (7, 8))
    assert len(c.handle(msg, C, 1.0)) == 1
    assert c.handle(msg, C, 1.1) == [] and c.stats.duplicates == 2


# --- what a job's rows leave as -----------------------------------------------------------------


def test_a_middle_stage_passes_its_rows_on_as_one_activation() -> None:
    c = make(0, 3)
    prepare(c, "a", "b")
    (start,) = c.handle(StepEntry(0, ("b", "a"), (3, 4), (5, 5), (7, 8)), C, 1.0)
    assert isinstance(start, StartCompute)
    whole = rows(2)
    # The runtime hands back rows of one job tensor: here the job's second row is its first.
    out = c.compute_done(1, [Row(whole, 1), Row(whole, 0)], 0.25, 1.5)
    swapped = Tensor("float32", (2, 1, W), whole.data[4 * W :] + whole.data[: 4 * W])
    assert out == [
        Send(DOWN, StepActivation(0, ("a", "b"), (5, 5), (8, 7), swapped, 250_000, C), True)
    ]
    # In order, the tensor goes on as it is.
    c2 = make(0, 3)
    prepare(c2, "a", "b")
    c2.handle(StepEntry(0, ("a", "b"), (3, 4), (5, 5), (7, 8)), C, 1.0)
    (send,) = c2.compute_done(1, [Row(whole, 0), Row(whole, 1)], 0.25, 1.5)
    assert isinstance(send, Send) and send.msg.hidden is whole  # type: ignore[union-attr]


def test_the_final_stage_answers_each_owner_with_one_step_result() -> None:
    c = make(1, 2)
    prepare(c, "a", "b", "c")
    act = StepActivation(0, ("a", "b", "c"), (5, 5, 5), (7, 8, 9), rows(3), 1_000, C)
    (start,) = c.handle(act, UP, 1.0)
    assert isinstance(start, StartCompute)
    assert [s.row for s in start.job.steps] == [0, 1, 2]
    assert all(s.hidden is act.hidden and s.batched for s in start.job.steps)
    outs = [
        Sampled(3, -0.5, ((3, 4), (-0.5, -1.0))),
        StepFailed(ErrorCode.SAMPLING_FAILED, "sampling failed: boom"),
        Sampled(5, -0.25),
    ]
    assert c.compute_done(1, outs, 0.002, 1.5) == [
        Send(C, Error(ErrorCode.SAMPLING_FAILED, "stage 1: sampling failed: boom", "b", 8), True),
        Send(
            C,
            StepResult(
                0,
                ("a", "c"),
                (7, 9),
                (3, 5),
                (-0.5, -0.25),
                3_000,
                ((3, 4), ()),
                ((-0.5, -1.0), ()),
            ),
            True,
        ),
    ]


def test_logits_rows_go_back_one_run_result_each() -> None:
    cfg = StageConfig("s0", 0, 1, C, return_logits=True)
    c = StageCore(cfg, width=W, vocab=16, layers=(0, 4))
    prepare(c, "a")
    c.handle(StepEntry(0, ("a",), (3,), (5,), (7,)), C, 1.0)
    logits = Tensor("float32", (1, 1, 16), bytes(64))
    assert c.compute_done(1, [logits], 0.0, 1.5) == [
        Send(C, RunResult("a", 0, (), None, 7, None, logits, 0), True)
    ]


def test_releasing_one_row_while_its_step_runs_keeps_the_others() -> None:
    c = make()
    prepare(c, "a", "b")
    c.handle(StepEntry(0, ("a", "b"), (3, 4), (5, 5), (7, 8)), C, 1.0)
    freed = c.handle(ReleaseSequence("a"), C, 1.1)
    assert len(freed) == 1
    out = c.compute_done(1, [Sampled(1, -0.1), Sampled(2, -0.2)], 0.0, 1.2)
    assert out == [Send(C, StepResult(0, ("b",), (8,), (2,), (-0.2,)), True)]


# --- a StepActivation -----------------------------------------------------------------------------


def test_a_step_activation_from_a_stranger_is_told_to_each_rows_owner_without_its_nonce() -> None:
    c = make(1, 2)
    prepare(c, "a", "b")
    act = StepActivation(0, ("a", "b", "x"), (0, 0, 0), (7, 8, 9), rows(3), 0, C)
    why = f"activation from {EVE} refused"
    assert c.handle(act, EVE, 1.0) == [
        Warn("stage-drop", f"stage 1: activation from {EVE} is not from the upstream stage"),
        Send(C, Error(ErrorCode.NOT_UPSTREAM, why, "a"), True),
        Send(C, Error(ErrorCode.NOT_UPSTREAM, why, "b"), True),
    ]
    assert not c.busy


@pytest.mark.parametrize(
    "hidden, why",
    [
        (
            Tensor("float32", (3, 1, W), bytes(48)),
            "hidden states must be [2, 1, width] for 2 rows, got [3, 1, 4]",
        ),
        (
            Tensor("float32", (1, 2, W), bytes(32)),
            "hidden states must be [2, 1, width] for 2 rows, got [1, 2, 4]",
        ),
        (Tensor("int32", (2, 1, W), bytes(32)), "hidden states must be float, got int32"),
        (Tensor("float32", (2, 1, W + 1), bytes(40)), "hidden width 5 differs from the model's 4"),
    ],
    ids=["rows", "tokens", "dtype", "width"],
)
def test_a_step_activation_whose_tensor_does_not_fit_its_rows_fails_every_row(
    hidden: Tensor, why: str
) -> None:
    c = make(1, 2)
    prepare(c, "a", "b")
    act = StepActivation(0, ("a", "b"), (0, 0), (7, 8), hidden, 0, C)
    assert c.handle(act, UP, 1.0) == [
        Send(C, Error(ErrorCode.BAD_ACTIVATION, why, "a", 7), True),
        Send(C, Error(ErrorCode.BAD_ACTIVATION, why, "b", 8), True),
    ]
    assert not c.busy


def test_a_step_activation_with_duplicate_rows_is_refused_whole() -> None:
    c = make(1, 2)
    prepare(c, "a")
    act = StepActivation(0, ("a", "a"), (0, 0), (7, 8), rows(2), 0, C)
    why = "StepActivation names a request id twice"
    assert c.handle(act, UP, 1.0) == [
        Send(C, Error(ErrorCode.BAD_ACTIVATION, why, "a", 7), True),
        Send(C, Error(ErrorCode.BAD_ACTIVATION, why, "a", 8), True),
    ]
    assert not c.busy


def test_rows_unprepared_or_of_another_owner_are_dropped_and_the_rest_run() -> None:
    c = make(1, 2, coordinator=WILD)
    prepare(c, "a", "b")
    prepare(c, "theirs", owner=OTHER)
    act = StepActivation(0, ("gone", "a", "theirs", "b"), (5, 5, 5, 3), (6, 7, 8, 9), rows(4), 0, C)
    out = c.handle(act, UP, 1.0)
    assert out[:3] == [
        Warn("stage-drop", "stage 1: activation for unprepared request 'gone'; dropped"),
        Warn("stage-drop", "stage 1: activation for 'theirs' of another owner; dropped"),
        Send(
            C,
            Error(
                ErrorCode.BAD_REQUEST,
                "start_pos 3 does not follow the 5 positions cached for 'b'",
                "b",
                9,
            ),
            True,
        ),
    ]
    (start,) = out[3:]
    assert isinstance(start, StartCompute)
    (step,) = start.job.steps
    assert (step.request_id, step.row, step.nonce) == ("a", 1, 7)
    assert c.stats.dropped == 1 and c.stats.by_code == {ErrorCode.NOT_OWNER: 1}


def test_an_undeliverable_step_activation_fails_each_rows_exchange() -> None:
    c = make(0, 2)
    prepare(c, "a", "b")
    act = StepActivation(0, ("a", "b", "gone"), (0, 0, 0), (7, 8, 9), rows(3), 0, C)
    why = f"stage 0 cannot reach {DOWN}"
    assert c.undeliverable(Send(DOWN, act), "refused", 1.0) == [
        Warn("stage-drop", f"stage 0: could not send to {DOWN}: refused"),
        Send(C, Error(ErrorCode.DOWNSTREAM_UNREACHABLE, why, "a", 7), True),
        Send(C, Error(ErrorCode.DOWNSTREAM_UNREACHABLE, why, "b", 8), True),
    ]


def test_the_final_stage_refuses_an_activation_row_of_a_sequence_prepared_without_sampling() -> (
    None
):
    c = make(1, 2)
    prepare(c, "plain", sp=None)
    prepare(c, "ok")
    act = StepActivation(0, ("plain", "ok"), (5, 5), (7, 8), rows(2), 0, C)
    out = c.handle(act, UP, 1.0)
    why = "'plain' was prepared without sampling parameters"
    assert out[0] == Send(C, Error(ErrorCode.BAD_REQUEST, why, "plain", 7), True)
    (start,) = out[1:]
    assert isinstance(start, StartCompute) and [s.request_id for s in start.job.steps] == ["ok"]


def test_a_stranger_naming_one_live_request_many_times_gets_its_owner_told_once() -> None:
    c = make(1, 2)
    prepare(c, "a")
    act = StepActivation(0, ("a",) * 256, (5,) * 256, tuple(range(256)), rows(1), 0, C)
    out = c.handle(act, EVE, 1.0)
    assert out[1:] == [
        Send(C, Error(ErrorCode.NOT_UPSTREAM, f"activation from {EVE} refused", "a"), True)
    ]


def test_an_undecodable_batched_message_answers_each_row_it_named() -> None:
    from mlxcel.base.messages import Undecodable

    c = make(1, 2)
    prepare(c, "a", "b")
    bad = Undecodable(35, None, None, "bad start_pos", (("a", 7), ("b", 8), ("gone", 9)))
    why = "stage 1: undecodable message (kind 35): bad start_pos"
    assert c.handle(bad, UP, 1.0) == [
        Send(C, Error(ErrorCode.BAD_MESSAGE, why, "a", 7), True),
        Send(C, Error(ErrorCode.BAD_MESSAGE, why, "b", 8), True),
    ]


# --- every field of what a row becomes and leaves as ------------------------------------------


def test_activation_rows_become_steps_with_every_field() -> None:
    last, middle = make(1, 2), make(1, 3)
    prepare(last, "a")
    prepare(middle, "a", sp=None)
    act = StepActivation(0, ("a",), (5,), (7,), rows(1), 1_000, C)
    for c, sampling in ((last, SP), (middle, GREEDY)):  # a middle stage samples nothing
        (start,) = c.handle(act, UP, 1.0)
        want = Step(c.seqs["a"].key, 0, None, act.hidden, 1, 5, sampling, 7, True, 1_000, C,
                    (1, 2), row=0, batched=True)  # fmt: skip
        assert start == StartCompute(ComputeJob(1, (want,), False, c.is_last, False))
    # The per-sequence form carries the prompt's tail too.
    c = make(1, 2)
    prepare(c, "b")
    one = Activation("b", 0, Tensor("float32", (1, 1, W), bytes(16)), 5, SP, 9, owner=C)
    (start,) = c.handle(one, UP, 1.0)
    assert isinstance(start, StartCompute) and start.job.steps[0].context == (1, 2)


def test_tokens_at_both_ends_of_the_vocabulary_and_exactly_256_rows_run() -> None:
    c = make()
    ids = tuple(f"r{i}" for i in range(256))
    prepare(c, *ids)
    tokens = (0, 15) + (1,) * 254
    out = c.handle(StepEntry(0, ids, tokens, (5,) * 256, tuple(range(256))), C, 1.0)
    (start,) = out
    assert isinstance(start, StartCompute) and c.stats.refused == 0
    assert sum(s.state.value == "queued" for s in c.seqs.values()) == 256 - len(start.job.steps)


def test_a_malformed_step_activation_counts_one_error_and_tells_the_rows_it_can_pair() -> None:
    c = make(1, 2)
    prepare(c, "a", "b")
    act = StepActivation(0, ("a", "b", "c"), (5, 5, 5), (7, 8), rows(3), 0, C)
    why = "StepActivation columns of different lengths for 3 rows"
    told = [
        Send(C, Error(ErrorCode.BAD_ACTIVATION, why, "a", 7), True),
        Send(C, Error(ErrorCode.BAD_ACTIVATION, why, "b", 8), True),
    ]
    assert c.handle(act, UP, 1.0) == told and c.stats.errors == 1
    assert c.handle(act, UP, 1.1) == told and c.stats.errors == 2  # one count per message
    # More nonces than rows: only the rows are read.
    extra = StepActivation(0, ("a",), (5,), (7, 8), rows(1), 0, C)
    assert len(c.handle(extra, UP, 1.2)) == 1
    # Past 256 rows nothing more is read: a live sequence named at row 290 is not told.
    ids = tuple(f"x{i}" for i in range(290)) + ("a",)
    over = StepActivation(0, ids, (5,) * 291, tuple(range(291)), rows(1), 0, C)
    assert c.handle(over, UP, 1.3) == []


def test_plain_row_tensors_join_in_order_and_a_lone_step_takes_its_row() -> None:
    c = make(0, 3)
    prepare(c, "a", "b", "c")
    c.handle(StepEntry(0, ("a", "b", "c"), (3, 4, 5), (5, 5, 5), (7, 8, 9)), C, 1.0)
    two = rows(2, fill=1)
    plain = Tensor("float32", (1, 1, W), bytes(range(100, 116)))
    (send,) = c.compute_done(1, [Row(two, 1), plain, Row(two, 0)], 0.0, 1.5)
    chunk = 4 * W
    want = two.data[chunk:] + plain.data + two.data[:chunk]
    assert send == Send(
        DOWN,
        StepActivation(
            0, ("a", "b", "c"), (5, 5, 5), (7, 8, 9), Tensor("float32", (3, 1, W), want), 0, C
        ),
        True,
    )
    # A step that came alone leaves alone, with just its row of the job's tensor.
    c.handle(RunEntry("a", 0, (3,), 6, SP, 10), C, 2.0)
    (send,) = c.compute_done(2, [Row(two, 1)], 0.0, 2.5)
    assert isinstance(send, Send) and isinstance(send.msg, Activation)
    assert send.msg.hidden == Tensor("float32", (1, 1, W), two.data[chunk:])


def test_a_lone_final_step_passes_its_alternatives_on() -> None:
    c = make()
    prepare(c, "a")
    c.handle(RunEntry("a", 0, (3,), 5, SP, 10), C, 1.0)
    (send,) = c.compute_done(1, [Sampled(3, -0.5, ((3, 4), (-0.5, -1.5)))], 0.0, 1.5)
    assert send == Send(
        C, RunResult("a", 0, (3,), None, 10, (-0.5,), None, 0, (3, 4), (-0.5, -1.5)), True
    )


def test_rows_of_two_owners_in_one_job_leave_as_one_result_each() -> None:
    c = make(coordinator=WILD)
    prepare(c, "x", "a")
    prepare(c, "b", owner=OTHER)
    c.handle(RunEntry("x", 0, (1, 2), 5, SP, 6), C, 1.0)  # a prompt chunk keeps the stage busy
    assert c.handle(StepEntry(0, ("a",), (3,), (5,), (7,)), C, 1.1) == []
    assert c.handle(StepEntry(0, ("b",), (4,), (5,), (8,)), OTHER, 1.1) == []
    out = c.compute_done(1, [None], 0.0, 1.5)
    (nxt,) = [e for e in out if isinstance(e, StartCompute)]
    assert [s.request_id for s in nxt.job.steps] == ["a", "b"]  # one job, two owners
    assert c.compute_done(nxt.job.id, [Sampled(1, 0.0), Sampled(2, 0.0)], 0.0, 2.0) == [
        Send(C, StepResult(0, ("a",), (7,), (1,), (0.0,)), True),
        Send(OTHER, StepResult(0, ("b",), (8,), (2,), (0.0,)), True),
    ]
