"""StageCore's answers pinned word for word: every effect list is compared whole with ``==``.

``test_stage_core.py`` checks the protocol's shape (who gets which error code); this file pins
the rest of what a stage says and does: the exact text of each refusal, error and warning,
every field of the jobs it starts and the results and activations it passes on, what each
ending frees (and whether it logs that), the counters it keeps, the job ids it hands out, the
choice between decode batches and prompt chunks, a stuck compute thread, and stopping.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlxcel.base.effects import FreeCache, Send, StartCompute, Stopped, Warn
from mlxcel.base.messages import (
    Ack,
    Activation,
    BeginDrain,
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
)
from mlxcel.pipeline.stage_core import StageCore
from mlxcel.pipeline.stage_protocol import (
    ComputeJob,
    Sampled,
    SeqKey,
    SeqState,
    StageConfig,
    StageState,
    Step,
    StepFailed,
)
from mlxcel.sim.bugs import planted

C, UP, DOWN, EVE = "10.0.0.1:7000", "10.0.1.1:7100", "10.0.1.3:7100", "10.0.0.66:7000"
WILD, OWNER, OTHER = "0.0.0.0:7000", "10.0.0.1:7000", "10.0.0.2:7000"
SP = SamplingParams(max_tokens=8)
W = 4
SKIP = frozenset({"skip-owner-check"})  # planted by mlxcel.sim.bugs, as the simulator does


def make(
    index: int = 0,
    n: int = 1,
    *,
    coordinator: str = C,
    counters: Callable[[], dict[str, int]] = dict,
    layers: tuple[int, int] = (4, 9),
    **kw: float | int | bool,
) -> StageCore:
    cfg = StageConfig(
        f"s{index}",
        index,
        n,
        coordinator,
        upstream=UP if index else None,
        downstream=DOWN if index + 1 < n else None,
        **kw,  # type: ignore[arg-type]
    )
    return StageCore(cfg, width=W, vocab=16, layers=layers, counters=counters)


def hidden(n: int = 1, fill: int = 0) -> Tensor:
    return Tensor("float32", (1, n, W), bytes([fill]) * (4 * n * W))


def prepare(c: StageCore, rid: str = "r", owner: str = C, nonce: int = 1, at: float = 0.0) -> None:
    assert c.handle(PrepareSequence(rid, 64, nonce), owner, at) == [Send(owner, Ack(rid, nonce))]


def entry_step(
    key: SeqKey,
    tokens: tuple[int, ...],
    start: int,
    nonce: int,
    *,
    mb: int = 0,
    sp: SamplingParams = SP,
    sample: bool = True,
    owner: str = C,
) -> Step:
    return Step(key, mb, tokens, None, len(tokens), start, sp, nonce, sample, 0, owner)


def job(job_id: int, *steps: Step, first: bool = True, last: bool = True) -> StartCompute:
    return StartCompute(ComputeJob(job_id, steps, first, last, False))


def refusal(c: StageCore, kind: str, source: str, why: str) -> Warn:
    return Warn("stage-drop", f"stage {c.config.index}: refusing {kind} from {source}: {why}")


def run_one(c: StageCore, rid: str, tokens: tuple[int, ...], start: int, nonce: int) -> int:
    """Run one step alone to completion (a final entry stage); returns its job id."""
    (start_effect,) = c.handle(RunEntry(rid, 0, tokens, start, SP, nonce), C, 1.0)
    assert isinstance(start_effect, StartCompute)
    job_id: int = start_effect.job.id
    c.compute_done(job_id, [Sampled(1, 0.0)], 0.0, 1.0)
    return job_id


# --- refusals, word for word ------------------------------------------------------------------


def test_a_message_no_stage_takes_is_refused_word_for_word() -> None:
    c = make(1, 3)
    prepare(c)
    why = "not a stage message"
    assert c.handle(Ack("r", 4), C, 1.0) == [
        refusal(c, "Ack", C, why),
        Send(C, Error(ErrorCode.BAD_MESSAGE, why, "r", 4), True),
    ]
    assert c.stats.refused == 1 and c.stats.by_code == {ErrorCode.BAD_MESSAGE: 1}


def test_a_run_entry_at_a_later_stage_is_refused_word_for_word() -> None:
    c = make(1, 3)
    prepare(c)
    why = "this stage is not the entry stage"
    assert c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0) == [
        refusal(c, "RunEntry", C, why),
        Send(C, Error(ErrorCode.NOT_ENTRY, why, "r", 5)),
    ]


def test_a_run_entry_for_an_unknown_sequence_names_it() -> None:
    c = make()
    why = "no sequence 'nope' here"
    assert c.handle(RunEntry("nope", 0, (1,), 0, SP, 5), C, 1.0) == [
        refusal(c, "RunEntry", C, why),
        Send(C, Error(ErrorCode.NOT_PREPARED, why, "nope", 5)),
    ]


@pytest.mark.parametrize(
    "entry, why",
    [
        (RunEntry("r", 0, (), 0, SP, 5), "token ids empty or outside the vocabulary [0, 16)"),
        (RunEntry("r", 0, (16,), 0, SP, 5), "token ids empty or outside the vocabulary [0, 16)"),
        (
            RunEntry("r", 0, (1,), 3, SP, 5),
            "start_pos 3 does not follow the 0 positions cached for 'r'",
        ),
        (RunEntry("r", 0, (1, 2, 3), 0, SP, 5), "token ids beyond the prepared length"),
    ],
    ids=["empty", "vocab", "start_pos", "max_len"],
)
def test_bad_run_entries_are_refused_word_for_word(entry: RunEntry, why: str) -> None:
    c = make()
    assert c.handle(PrepareSequence("r", 2, 1), C, 0.0) == [Send(C, Ack("r", 1))]
    assert c.handle(entry, C, 1.0) == [
        refusal(c, "RunEntry", C, why),
        Send(C, Error(ErrorCode.BAD_REQUEST, why, "r", 5)),
    ]
    assert c.seqs["r"].state is SeqState.IDLE and not c.busy


def test_token_ids_at_both_ends_of_the_vocabulary_and_exactly_max_len_are_accepted() -> None:
    c = make()
    assert c.handle(PrepareSequence("r", 2, 1), C, 0.0) == [Send(C, Ack("r", 1))]
    # 0 and vocab - 1 are in range; two tokens fill max_len 2 exactly.
    assert c.handle(RunEntry("r", 0, (0, 15), 0, SP, 5), C, 1.0) == [
        job(1, entry_step(("r", 1), (0, 15), 0, 5))
    ]


def test_a_command_from_another_identity_names_the_request_not_its_generation() -> None:
    c = make(coordinator=WILD)
    prepare(c, owner=OWNER)
    why = "request 'r' is owned by another identity"
    assert c.handle(ReleaseSequence("r"), OTHER, 1.0) == [
        refusal(c, "ReleaseSequence", OTHER, why),
        Send(OTHER, Error(ErrorCode.NOT_OWNER, why, "r", None)),
    ]
    assert "r" in c.seqs


def test_the_stage_full_refusal_names_its_maximum() -> None:
    c = make(max_sequences=2)
    prepare(c, "a")
    prepare(c, "b", nonce=2)  # the second of two fits
    why = "stage holds its maximum of 2 sequences"
    assert c.handle(PrepareSequence("c", 64, 3), C, 1.0) == [
        refusal(c, "PrepareSequence", C, why),
        Send(C, Error(ErrorCode.TOO_MANY_SEQUENCES, why, "c", 3)),
    ]


def test_copies_of_a_claim_and_of_a_step_are_each_counted() -> None:
    c = make()
    prepare(c)
    for _ in range(2):
        assert c.handle(PrepareSequence("r", 64, 1), C, 1.0) == [Send(C, Ack("r", 1))]
    assert c.stats.duplicates == 2
    c = make()
    prepare(c)
    assert c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0) == [
        job(1, entry_step(("r", 1), (1,), 0, 5))
    ]
    for _ in range(2):
        assert c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0) == []
    assert c.stats.duplicates == 2


# --- the skip-owner-check injection (the simulator's deliberate bug) --------------------------


def test_skip_owner_check_lets_another_identity_release() -> None:
    c = make(coordinator=WILD)
    prepare(c, owner=OWNER)
    with planted(SKIP):
        assert c.handle(ReleaseSequence("r"), OTHER, 1.0) == [FreeCache(("r", 1))]
    assert not c.seqs


def test_skip_owner_check_lets_another_owners_activation_run() -> None:
    c = make(1, 2)
    prepare(c)
    h = hidden()
    with planted(SKIP):
        assert c.handle(Activation("r", 0, h, 0, SP, 5, owner=EVE), UP, 1.0) == [
            job(1, Step(("r", 1), 0, None, h, 1, 0, SP, 5, True, 0, C), first=False)
        ]
    # Planted for the block only: the check is back.
    prepare(c, "q")
    assert (
        "of another owner; dropped"
        in c.handle(Activation("q", 0, h, 0, SP, 6, owner=EVE), UP, 1.0)[0].text
    )


# --- activations ------------------------------------------------------------------------------


def test_an_activation_for_an_unprepared_request_is_dropped_with_a_truncated_name() -> None:
    c = make(1, 2)
    rid = "x" * 70
    warn = Warn("stage-drop", f"stage 1: activation for unprepared request {'x' * 64!r}; dropped")
    for _ in range(2):
        assert c.handle(Activation(rid, 0, hidden(), 0, SP, 5, owner=C), UP, 1.0) == [warn]
    assert c.stats.dropped == 2


def test_an_activation_of_another_owner_is_dropped_with_a_truncated_name() -> None:
    c = make(1, 2)
    rid = "y" * 70
    prepare(c, rid)
    assert c.handle(Activation(rid, 0, hidden(), 0, SP, 5, owner=EVE), UP, 1.0) == [
        Warn("stage-drop", f"stage 1: activation for {'y' * 64!r} of another owner; dropped")
    ]
    assert c.stats.by_code == {ErrorCode.NOT_OWNER: 1} and c.stats.refused == 1


def test_a_malformed_activation_fails_the_owners_exchange_word_for_word() -> None:
    c = make(1, 2)
    prepare(c)
    bad = Tensor("int32", (1, 1, W), bytes(4 * W))
    err = Error(ErrorCode.BAD_ACTIVATION, "hidden states must be float, got int32", "r", 5)
    for _ in range(2):
        assert c.handle(Activation("r", 0, bad, 0, SP, 5, owner=C), UP, 1.0) == [Send(C, err)]
    assert c.stats.errors == 2


def test_an_out_of_order_activation_is_told_to_the_owner_word_for_word() -> None:
    c = make(1, 2)
    prepare(c)
    why = "start_pos 3 does not follow the 0 positions cached for 'r'"
    for _ in range(2):
        out = c.handle(Activation("r", 0, hidden(), 3, SP, 5, owner=C), UP, 1.0)
        assert out == [Send(C, Error(ErrorCode.BAD_REQUEST, why, "r", 5))]
    assert c.stats.errors == 2 and c.stats.refused == 0


# --- what a job carries and what its answer becomes -------------------------------------------


def test_a_middle_stage_runs_the_activation_and_passes_every_field_on() -> None:
    c = make(1, 3)
    prepare(c)
    sp = SamplingParams(temperature=0.5, max_tokens=3)
    h_in, h_out = hidden(2, 1), hidden(2, 2)
    out = c.handle(Activation("r", 2, h_in, 0, sp, 5, False, 7, C), UP, 1.0)
    assert out == [
        job(1, Step(("r", 1), 2, None, h_in, 2, 0, sp, 5, False, 7, C), first=False, last=False)
    ]
    # took 2.0 s: 2_000_000 us plus the 7 spent upstream.
    assert c.compute_done(1, [h_out], 2.0, 3.0) == [
        Send(DOWN, Activation("r", 2, h_out, 0, sp, 5, False, 2_000_007, C))
    ]
    assert c.seqs["r"].tokens == 2 and c.seqs["r"].state is SeqState.IDLE


def test_a_middle_stage_never_forwards_what_is_not_a_tensor() -> None:
    c = make(1, 3)
    prepare(c)
    c.handle(Activation("r", 0, hidden(), 0, SP, 5, owner=C), UP, 1.0)
    with pytest.raises(AssertionError):
        c.compute_done(1, [Sampled(3, 0.0)], 0.0, 2.0)


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_sampled_token_goes_to_the_owner_with_every_field(logprobs: bool) -> None:
    c = make()
    prepare(c)
    sp = SamplingParams(max_tokens=8, logprobs=logprobs)
    out = c.handle(RunEntry("r", 3, (1, 2), 0, sp, 5), C, 1.0)
    assert out == [job(1, entry_step(("r", 1), (1, 2), 0, 5, mb=3, sp=sp))]
    assert c.compute_done(1, [Sampled(7, -0.25)], 2.0, 3.0) == [
        Send(C, RunResult("r", 3, (7,), None, 5, (-0.25,) if logprobs else None, None, 2_000_000))
    ]
    assert c.stats.compute_s == 2.0 and c.stats.largest_batch == 1


def test_a_cache_filling_chunk_answers_with_no_token_logprob_or_logits() -> None:
    c = make()
    prepare(c)
    sp = SamplingParams(logprobs=True)
    out = c.handle(RunEntry("r", 0, (1,), 0, sp, 5, sample=False), C, 1.0)
    assert out == [job(1, entry_step(("r", 1), (1,), 0, 5, sp=sp, sample=False))]
    assert c.compute_done(1, [hidden()], 0.0, 2.0) == [
        Send(C, RunResult("r", 0, (), None, 5, None, None, 0))
    ]


def test_a_stage_that_returns_logits_sends_them_to_the_owner() -> None:
    c = make(return_logits=True)
    prepare(c)
    out = c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    assert out == [
        StartCompute(ComputeJob(1, (entry_step(("r", 1), (1,), 0, 5),), True, True, True))
    ]
    logits = Tensor("float32", (1, 16), bytes(64))
    assert c.compute_done(1, [logits], 0.0, 2.0) == [
        Send(C, RunResult("r", 0, (), None, 5, None, logits, 0))
    ]


def test_an_answer_with_too_few_outputs_is_a_bug_not_a_silent_drop() -> None:
    c = make()
    prepare(c)
    c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    with pytest.raises(ValueError, match=r"^zip\(\) argument 2 is shorter than argument 1$"):
        c.compute_done(1, [], 0.0, 2.0)


def _batch_of_two(c: StageCore) -> None:
    """a and b each hold one position; their decode steps then run as job 3."""
    prepare(c, "a")
    prepare(c, "b", nonce=2)
    assert run_one(c, "a", (1,), 0, 1) == 1
    assert run_one(c, "b", (1,), 0, 2) == 2
    out = c.handle_many(
        (RunEntry("a", 0, (2,), 1, SP, 3), RunEntry("b", 0, (2,), 1, SP, 4)), C, 2.0
    )
    assert out == [job(3, entry_step(("a", 1), (2,), 1, 3), entry_step(("b", 2), (2,), 1, 4))]


def test_a_step_released_while_it_ran_does_not_drop_the_rest_of_its_job() -> None:
    c = make(max_batch=4)
    _batch_of_two(c)
    assert c.handle(ReleaseSequence("a"), C, 2.5) == [FreeCache(("a", 1))]  # running: quiet
    assert c.compute_done(3, [Sampled(5, 0.0), Sampled(6, 0.0)], 0.0, 3.0) == [
        Send(C, RunResult("b", 0, (6,), None, 4, None, None, 0))
    ]


def test_a_failed_step_does_not_drop_the_rest_of_its_job() -> None:
    c = make(max_batch=4)
    _batch_of_two(c)
    out = c.compute_done(3, [StepFailed(ErrorCode.FORWARD_FAILED, "nan"), Sampled(6, 0.0)], 0, 3)
    assert out == [
        Send(C, Error(ErrorCode.FORWARD_FAILED, "stage 0: nan", "a", 3)),
        Send(C, RunResult("b", 0, (6,), None, 4, None, None, 0)),
    ]
    assert c.seqs["a"].state is SeqState.FAILED and c.seqs["b"].tokens == 2
    assert c.stats.errors == 1


def test_the_answer_of_a_re_prepared_sequences_old_step_is_dropped() -> None:
    c = make()
    prepare(c)
    c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    # A fresh claim discards the old cache without a log line.
    assert c.handle(PrepareSequence("r", 64, 2), C, 1.5) == [
        FreeCache(("r", 1)),
        Send(C, Ack("r", 2)),
    ]
    assert c.compute_done(1, [Sampled(3, 0.0)], 0.0, 2.0) == []
    assert c.seqs["r"].key == ("r", 2) and c.seqs["r"].state is SeqState.IDLE
    assert c.seqs["r"].tokens == 0


def test_decode_batches_and_prompt_chunks_take_turns() -> None:
    c = make(max_batch=4)
    for i, rid in enumerate(("a", "b", "p", "q")):
        prepare(c, rid, nonce=i + 1)
    assert run_one(c, "a", (1,), 0, 1) == 1
    assert run_one(c, "b", (1,), 0, 2) == 2
    a2 = entry_step(("a", 1), (2,), 1, 3)
    assert c.handle(RunEntry("a", 0, (2,), 1, SP, 3), C, 2.0) == [job(3, a2)]  # a decode
    c.handle_many((RunEntry("b", 0, (2,), 1, SP, 4), RunEntry("p", 0, (1, 2), 0, SP, 5)), C, 2.0)
    # After a decode batch, the queued prompt chunk goes before the queued decode.
    p = entry_step(("p", 3), (1, 2), 0, 5)
    assert c.compute_done(3, [Sampled(9, 0.0)], 0.0, 3.0) == [
        Send(C, RunResult("a", 0, (9,), None, 3, None, None, 0)),
        job(4, p),
    ]
    c.handle_many((RunEntry("a", 0, (3,), 2, SP, 6), RunEntry("q", 0, (1, 2), 0, SP, 7)), C, 3.0)
    # After a prompt chunk, the queued decodes go (as one batch) before the queued chunk.
    b2, a3 = entry_step(("b", 2), (2,), 1, 4), entry_step(("a", 1), (3,), 2, 6)
    assert c.compute_done(4, [Sampled(9, 0.0)], 0.0, 4.0) == [
        Send(C, RunResult("p", 0, (9,), None, 5, None, None, 0)),
        job(5, a3, b2),
    ]


# --- releasing: what is freed, counted and logged ---------------------------------------------


def test_releasing_an_idle_sequence_frees_it_quietly() -> None:
    c = make()
    prepare(c)
    assert c.handle(ReleaseSequence("r"), C, 1.0) == [FreeCache(("r", 1))]
    assert c.stats.discarded == 0


def test_releasing_queued_steps_logs_and_counts_each_lost_step() -> None:
    c = make(max_batch=1)
    for i, rid in enumerate(("a", "b", "c")):
        prepare(c, rid, nonce=i + 1)
    c.handle(RunEntry("a", 0, (1,), 0, SP, 4), C, 1.0)  # job 1 runs a
    assert (
        c.handle_many((RunEntry("b", 0, (1,), 0, SP, 5), RunEntry("c", 0, (1,), 0, SP, 6)), C, 1.0)
        == []
    )
    for rid, gen in (("b", 2), ("c", 3)):
        assert c.handle(ReleaseSequence(rid), C, 2.0) == [
            FreeCache((rid, gen)),
            Warn("info", "stage 0: freed 1 sequence(s)"),
        ]
    assert c.stats.discarded == 2
    # The released steps are not started when a's job ends.
    assert c.compute_done(1, [Sampled(3, 0.0)], 0.0, 3.0) == [
        Send(C, RunResult("a", 0, (3,), None, 4, None, None, 0))
    ]
    assert not c.busy


def test_losing_a_peer_frees_what_it_owned_and_nothing_when_it_owned_nothing() -> None:
    c = make(1, 2)
    prepare(c, "a")
    prepare(c, "b", nonce=2)
    assert c.peer_lost(EVE, 1.0) == []
    assert c.peer_lost(C, 1.0) == [
        FreeCache(("a", 1)),
        FreeCache(("b", 2)),
        Warn("info", "stage 1: freed 2 sequence(s)"),
    ]


def test_expired_leases_are_freed_logged_and_counted_across_ticks() -> None:
    c = make(lease=10.0)
    prepare(c, "a")
    assert c.on_timer(9.5) == []
    assert c.on_timer(10.0) == [FreeCache(("a", 1)), Warn("info", "stage 0: freed 1 sequence(s)")]
    prepare(c, "b", at=20.0)
    prepare(c, "c", nonce=2, at=20.0)
    assert c.on_timer(30.0) == [
        FreeCache(("b", 2)),
        FreeCache(("c", 3)),
        Warn("info", "stage 0: freed 2 sequence(s)"),
    ]
    assert c.stats.leases_expired == 3


# --- timers, failures and a stuck compute thread ----------------------------------------------


def test_no_timer_when_nothing_is_pending() -> None:
    assert make().next_timer() is None


def test_progress_is_not_sent_before_its_interval() -> None:
    c = make(progress_interval=5.0)
    prepare(c)
    c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    assert c.on_timer(5.9) == []
    assert c.on_timer(6.0) == [Send(C, Progress((5,)))]


def test_a_failed_job_fails_its_steps_word_for_word_and_starts_the_next() -> None:
    c = make(max_batch=1, forward_timeout=10.0, progress_interval=100.0)
    assert c.compute_failed(1, "nothing runs", 0.0) == []  # no job at all
    prepare(c, "r")
    prepare(c, "q", nonce=2)
    c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    c.handle(RunEntry("q", 0, (1,), 0, SP, 6), C, 1.0)
    assert c.compute_failed(1, "boom", 2.0) == [
        Send(C, Error(ErrorCode.FORWARD_FAILED, "stage 0: boom", "r", 5)),
        job(2, entry_step(("q", 2), (1,), 0, 6)),
    ]
    assert c.seqs["r"].state is SeqState.FAILED and c.next_timer() == 12.0  # q's deadline
    assert c.compute_failed(2, "again", 3.0) == [
        Send(C, Error(ErrorCode.FORWARD_FAILED, "stage 0: again", "q", 6))
    ]
    assert c.stats.errors == 2


def test_answers_for_other_jobs_leave_a_stuck_thread_stuck_until_its_own_returns() -> None:
    c = make(progress_interval=5.0, forward_timeout=12.0, max_batch=1)
    prepare(c, "r")
    prepare(c, "q", nonce=2)
    c.handle(RunEntry("r", 0, (1,), 0, SP, 5), C, 1.0)
    c.handle(RunEntry("q", 0, (1,), 0, SP, 6), C, 1.0)
    assert c.on_timer(6.0) == [Send(C, Progress((5, 6)))]
    assert c.on_timer(13.0) == [
        Send(C, Error(ErrorCode.FORWARD_TIMEOUT, "stage 0: a step took longer than 12s", "r", 5)),
        job(2, entry_step(("q", 2), (1,), 0, 6)),
    ]
    # Neither a stray answer nor a stray failure is the stuck job coming back; a stray
    # failure does not fail the job that runs now either.
    assert c.compute_done(99, [], 0.0, 14.0) == []
    assert c.compute_failed(99, "stray", 14.0) == []
    assert c.busy and c.on_timer(18.0) == []  # still silent
    # The stuck job's thread gives up on it: q's progress is reported again.
    assert c.compute_failed(1, "late", 19.0) == []
    assert c.on_timer(23.0) == [Send(C, Progress((6,)))]


# --- undeliverable sends ----------------------------------------------------------------------


def test_an_undeliverable_activation_fails_its_request_word_for_word() -> None:
    c = make(1, 3)
    prepare(c)
    act = Activation("r", 0, hidden(), 0, SP, 5, owner=C)
    assert c.undeliverable(Send(DOWN, act), "refused", 1.0) == [
        Warn("stage-drop", f"stage 1: could not send to {DOWN}: refused"),
        Send(C, Error(ErrorCode.DOWNSTREAM_UNREACHABLE, f"stage 1 cannot reach {DOWN}", "r", 5)),
    ]
    assert c.stats.dropped == 1
    # Anything else, or an activation of a request no longer held: only the log line.
    assert c.undeliverable(Send(C, Ack("r", 1)), "reset", 2.0) == [
        Warn("stage-drop", f"stage 1: could not send to {C}: reset")
    ]
    gone = Activation("gone", 0, hidden(), 0, SP, 5, owner=C)
    assert c.undeliverable(Send(DOWN, gone), "closed", 3.0) == [
        Warn("stage-drop", f"stage 1: could not send to {DOWN}: closed")
    ]
    assert c.stats.dropped == 3


# --- QueryState, drain, shutdown --------------------------------------------------------------


def test_query_state_reports_every_field() -> None:
    c = make(1, 2, counters=lambda: {"wire_bytes_out": 11, "jobs": 3})
    prepare(c)
    c.handle(Activation("r", 0, hidden(), 0, SP, 5, owner=C), UP, 1.0)
    c.compute_done(1, [Sampled(3, 0.0)], 2.0, 3.0)
    want = State("s1", (4, 9), 1, False, 9, 11, 2_000_000, 1, jobs=3)
    assert c.handle(QueryState(9), C, 4.0) == [Send(C, want)]
    drained = Warn(
        "warning",
        f"stage 1: draining on BeginDrain from {C}: no new sequences for 60s unless a "
        "Shutdown follows",
    )
    assert c.handle(BeginDrain("x"), C, 5.0) == [drained, Send(C, Ack("", 0))]
    assert c.handle(QueryState(10), C, 6.0) == [
        Send(C, State("s1", (4, 9), 1, True, 10, 11, 2_000_000, 1, jobs=3))
    ]


def test_a_drain_nobody_follows_with_a_shutdown_ends_at_its_bound() -> None:
    """A BeginDrain (the coordinator's, or one forged by a member sharing its IP) is logged
    naming its sender, and lasts drain_bound seconds unless a Shutdown follows."""
    c = make(1, 2, drain_bound=20.0)
    why = "BeginDrain is accepted only from the coordinator"
    assert c.handle(BeginDrain("x"), UP, 1.0) == [
        Warn("stage-drop", f"stage 1: refusing BeginDrain from {UP}: {why}"),
        Send(UP, Error(ErrorCode.NOT_COORDINATOR, why, None, None)),  # upstream is a peer
    ]
    assert c.state is StageState.SERVING
    assert c.handle(BeginDrain("x"), C, 2.0)[0] == Warn(
        "warning",
        f"stage 1: draining on BeginDrain from {C}: no new sequences for 20s unless a "
        "Shutdown follows",
    )
    assert c.handle(BeginDrain("x"), C, 3.0) == [Send(C, Ack("", 0))]  # logged once
    assert c.next_timer() == 22.0
    assert c.on_timer(21.9) == [] and c.state is StageState.DRAINING
    assert c.on_timer(22.0) == [
        Warn("warning", "stage 1: the drain asked for 20s ago ended with no Shutdown after it: "
             "serving again")
    ]  # fmt: skip
    assert c.state is StageState.SERVING and c.next_timer() is None
    c.handle(BeginDrain("x"), C, 30.0)
    assert c.handle(Shutdown("x"), C, 31.0) == [
        Warn("warning", f"stage 1: stopping on Shutdown from {C}"),
        Stopped(),
    ]
    assert c.next_timer() is None and c.state is StageState.STOPPED


def test_shutdown_of_an_empty_stage_stops_at_once() -> None:
    c = make()
    assert c.shutdown(0.0) == [Stopped()]
    assert c.state is StageState.STOPPED


def test_shutdown_of_a_busy_stage_waits() -> None:
    c = make()
    prepare(c)
    assert c.shutdown(1.0) == []
    assert c.state is StageState.STOPPING


def test_a_stopping_stage_stops_when_its_last_lease_expires() -> None:
    c = make(lease=10.0)
    prepare(c)
    assert c.shutdown(1.0) == []
    assert c.on_timer(10.0) == [
        FreeCache(("r", 1)),
        Warn("info", "stage 0: freed 1 sequence(s)"),
        Stopped(),
    ]
    assert c.state is StageState.STOPPED


def test_a_stopping_stage_stops_when_the_last_owner_is_lost() -> None:
    c = make(1, 2)
    prepare(c)
    assert c.shutdown(1.0) == []
    assert c.peer_lost(C, 2.0) == [
        FreeCache(("r", 1)),
        Warn("info", "stage 1: freed 1 sequence(s)"),
        Stopped(),
    ]
    assert c.state is StageState.STOPPED
