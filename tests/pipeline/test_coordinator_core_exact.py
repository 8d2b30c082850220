"""CoordinatorCore word for word: every path compared as the whole list of effects it returns.

What this file pins, beyond tests/pipeline/test_coordinator_core.py: the constructor's defaults and
its one refusal; each admission refusal (the exact Error, and which ones count as failed);
the exact PrepareSequence, RunEntry (chunk and step) and ReleaseSequence sends with their
deadlines; every drop's ``router-drop`` line and counter key; errors from stages, matched and
not; each kind of deadline (at its exact time, not 1e-6 before; with and without a reset;
several at once); lost stages and what they fail (queries to that stage only, parked
requests too); undeliverable sends; queries; the decode-overhead figure and its counters;
cancellation; and the ``accept-stale-nonce`` injection.

Nonces are deterministic (``first_nonce=1``, one per exchange opened), so every expected
effect is spelled out in full. Times are binary-exact (quarters) so sums compare with ``==``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from mlxcel.base.effects import Answer, Deliver, Effect, ResetPeer, Send, Warn
from mlxcel.base.errors import PipelineError
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
    StepResult,
    Tensor,
    Undecodable,
)
from mlxcel.pipeline.coordinator_core import CoordinatorCore, ReqState
from mlxcel.reactor.bus import LOCAL
from mlxcel.sim.bugs import planted

S0, S1, S2 = "10.0.1.1:7100", "10.0.1.2:7100", "10.0.1.3:7100"
STAGES = [S0, S1, S2]
STRANGER = "10.0.0.66:7000"
EOS = 15
SP = SamplingParams(max_tokens=3)
DEADLINE = ErrorCode.DEADLINE_EXCEEDED
UNREACHABLE = ErrorCode.STAGE_UNREACHABLE


def core(**kw: object) -> CoordinatorCore:
    opts: dict[str, object] = dict(
        eos={EOS}, vocab=16, max_len=64, step_timeout=2.0, prefill_step_size=4
    )
    opts.update(kw)
    return CoordinatorCore(STAGES, **opts)  # type: ignore[arg-type]


def entry(rid: str = "r", prompt: tuple[int, ...] = (1,), nonce: int = 77) -> RunEntry:
    return RunEntry(rid, 0, prompt, 0, SP, nonce)


def preps(
    rid: str, total: int, first: int, deadline: float, prompt: tuple[int, ...] = (1,)
) -> list[Effect]:
    """The PrepareSequence sends of one admission: one nonce per stage, in stage order, each
    with the prompt's last 20 tokens (what the final stage's penalties look back on)."""
    return [
        Send(s, PrepareSequence(rid, total, first + i, prompt[-20:], SP), deadline=deadline)
        for i, s in enumerate(STAGES)
    ]


def releases(rid: str, now: float) -> list[Effect]:
    return [Send(s, ReleaseSequence(rid), deadline=now + 5.0) for s in STAGES]


def fails(rid: str, code: str, why: str, nonce: int = 77) -> list[Effect]:
    return [
        Warn("warning", f"coordinator: request {rid} failed: {why}"),
        Deliver(Error(code, why, rid, nonce)),
    ]


def drop(msg: str, source: str, why: str, detail: str = "") -> Warn:
    text = f"coordinator: dropping {msg} from {source}: {why}"
    return Warn("coordinator-drop", text + (f" ({detail})" if detail else ""))


def step(rid: str, tokens: tuple[int, ...], pos: int, nonce: int, deadline: float) -> Send:
    """A one-row decode step (``tokens``: the one token it runs)."""
    return Send(S0, StepEntry(0, (rid,), tokens, (pos,), (nonce,)), deadline=deadline)


def chunk(tokens: tuple[int, ...], pos: int, nonce: int, deadline: float) -> Send:
    msg = RunEntry("r", 0, tokens, pos, SP, nonce, sample=False)
    return Send(S0, msg, deadline=deadline)


@dataclass(frozen=True)
class Failed:
    """An ``Answer`` whose value is a PipelineError (exceptions do not compare with ==)."""

    token: int
    code: str
    text: str


def norm(effects: list[Effect]) -> list[object]:
    return [
        Failed(e.token, e.value.code, str(e.value))
        if isinstance(e, Answer) and isinstance(e.value, PipelineError)
        else e
        for e in effects
    ]


def ack_all(c: CoordinatorCore, rid: str, first: int, now: float) -> list[Effect]:
    """Ack the three PrepareSequences (nonces first..first+2); what the last Ack returned."""
    out: list[Effect] = []
    for i, s in enumerate(STAGES):
        out = c.handle(Ack(rid, first + i), s, now)
    return out


def result(rid: str, tokens: tuple[int, ...], nonce: int, **kw: object) -> RunResult:
    return RunResult(rid, 0, tokens, None, nonce, **kw)  # type: ignore[arg-type]


# --- construction ------------------------------------------------------------------------------
def test_defaults_are_pinned() -> None:
    c = CoordinatorCore(STAGES, eos={EOS}, vocab=16, max_len=64)
    assert (c.step_timeout, c.max_in_flight, c.prefill_step_size) == (30.0, 64, 512)
    # ceil(64 / 3) = 22 per micro-batch, so three micro-batches.
    assert c.micro_batch_size == 22 and len(c.micro.members) == 3
    assert (c.peak_in_flight, c.steps, c.completed, c.failed, c.kept_alive) == (0, 0, 0, 0, 0)
    assert (c.decode_steps, c.decode_wall_s, c.decode_compute_s) == (0, 0.0, 0.0)
    assert c.dropped == Counter() and c.decode_overhead_ms() == 0.0
    assert (c.final, c.active, c.held, c.next_timer()) == (S2, 0, 0, None)
    # Nonces start at 1; the default step timeout sets the deadline.
    assert c.handle(entry(), LOCAL, 0.0) == preps("r", 4, 1, 30.0)


@pytest.mark.parametrize(
    "kw, size, count",
    [
        (dict(max_in_flight=4), 2, 2),  # ceil(4 / 3) = 2, not floor
        (dict(max_in_flight=7), 3, 3),  # ceil(7 / 3) = 3
        (dict(max_in_flight=6, stage_max_batch=1), 1, 6),  # a stage runs one at a time
        (dict(max_in_flight=4, micro_batch_size=4), 4, 1),  # given explicitly
    ],
)
def test_micro_batch_size_is_the_ceiling_per_stage(
    kw: dict[str, int], size: int, count: int
) -> None:
    c = core(**kw)
    assert (c.micro_batch_size, len(c.micro.members)) == (size, count)


def test_return_logits_without_a_pick_token_is_refused() -> None:
    with pytest.raises(ValueError, match="^return_logits needs a pick_token function$"):
        core(return_logits=True)


# --- admission -----------------------------------------------------------------------------------
def test_an_empty_request_id_is_refused_and_counted_each_time() -> None:
    c = core()
    bad = Error(ErrorCode.BAD_REQUEST, "empty request id", "", 9)
    assert c.handle(entry("", nonce=9), LOCAL, 0.0) == [Deliver(bad)]
    assert c.failed == 1
    assert c.handle(entry("", nonce=9), LOCAL, 0.0) == [Deliver(bad)]
    assert c.failed == 2 and c.reqs == {} and c.next_timer() is None


def test_a_running_request_id_is_refused_without_counting_a_failure() -> None:
    c = core()
    c.handle(entry("dup"), LOCAL, 0.0)
    out = c.handle(entry("dup", nonce=78), LOCAL, 0.0)
    assert out == [Deliver(Error(ErrorCode.BAD_REQUEST, "request id already running", "dup", 78))]
    assert c.failed == 0 and c.reqs["dup"].entry.nonce == 77  # the first one is untouched


@pytest.mark.parametrize(
    "prompt, why",
    [
        ((), "empty prompt"),
        ((16,), "token id outside the vocabulary [0, 16)"),
        ((-1,), "token id outside the vocabulary [0, 16)"),
        ((1,) * 62, "prompt (62 tokens) + max_tokens (3) exceeds the model's context of 64"),
    ],
)
def test_an_entry_that_cannot_run_is_refused_and_counted(prompt: tuple[int, ...], why: str) -> None:
    c = core()
    bad = [Deliver(Error(ErrorCode.BAD_REQUEST, why, "r", 5))]
    assert c.handle(entry(prompt=prompt, nonce=5), LOCAL, 0.0) == bad
    assert c.failed == 1
    assert c.handle(entry(prompt=prompt, nonce=5), LOCAL, 0.0) == bad
    assert c.failed == 2 and c.reqs == {}


def test_the_context_and_vocabulary_bounds_are_inclusive() -> None:
    c = core()
    # 61 prompt tokens + 3 = 64 = max_len exactly, the largest id 15 = vocab - 1: accepted.
    assert c.handle(entry(prompt=(15,) * 61), LOCAL, 0.25) == preps("r", 64, 1, 2.25, (15,) * 61)
    assert c.failed == 0


def test_at_most_max_in_flight_then_the_next_is_admitted_when_one_leaves() -> None:
    c = core(max_in_flight=2)
    assert c.handle(entry("a"), LOCAL, 0.0) == preps("a", 4, 1, 2.0)
    assert c.handle(entry("b"), LOCAL, 0.0) == preps("b", 4, 4, 2.0)
    assert c.handle(entry("w"), LOCAL, 0.0) == []  # the limit reached exactly: it waits
    assert (c.held, c.active, c.peak_in_flight, c.reqs["w"].state) == (
        2,
        3,
        2,
        ReqState.WAITING,
    )
    out = c.handle(CancelRequest("a", "gone"), LOCAL, 0.5)
    assert out == releases("a", 0.5) + preps("w", 4, 7, 2.5)
    assert (c.held, c.peak_in_flight) == (2, 2)


# --- a request's life ----------------------------------------------------------------------------
def test_a_request_fills_caches_in_chunks_then_decodes_word_for_word() -> None:
    c = core()
    e = RunEntry("r", 0, tuple(range(1, 11)), 0, SamplingParams(max_tokens=2), 77)
    sp = e.sampling
    # 10 prompt + 2 new tokens; the whole prompt is the final stage's context
    assert c.handle(e, LOCAL, 0.5) == [
        Send(s, PrepareSequence("r", 12, 1 + i, e.token_ids, sp), deadline=2.5)
        for i, s in enumerate(STAGES)
    ]
    req = c.reqs["r"]
    assert (req.state, c.held, c.peak_in_flight) == (ReqState.PREPARING, 1, 1)
    assert c.handle(Ack("r", 1), S0, 0.75) == []
    assert c.handle(Ack("r", 2), S1, 0.75) == []
    assert req.state is ReqState.PREPARING and req.pending == {3}
    # The last Ack sends the first chunk: 4 of the 9 prefix tokens, no sampling.
    first = RunEntry("r", 0, (1, 2, 3, 4), 0, sp, 4, sample=False)
    assert c.handle(Ack("r", 3), S2, 1.0) == [Send(S0, first, deadline=3.0)]
    assert req.state is ReqState.PREFILL and req.pending == {4}
    second = RunEntry("r", 0, (5, 6, 7, 8), 4, sp, 5, sample=False)
    assert c.handle(result("r", (), 4), S2, 1.25) == [Send(S0, second, deadline=3.25)]
    third = RunEntry("r", 0, (9,), 8, sp, 6, sample=False)
    assert c.handle(result("r", (), 5), S2, 1.5) == [Send(S0, third, deadline=3.5)]
    # The last prompt token is the first sampling step.
    decode = StepEntry(0, ("r",), (10,), (9,), (7,))
    assert c.handle(result("r", (), 6), S2, 1.75) == [Send(S0, decode, deadline=3.75)]
    assert (req.state, c.steps, c.decode_steps) == (ReqState.DECODE, 3, 0)
    # A StepResult row answers it; its logprob is not passed on (this request asked for
    # none); compute is the message's, wall is result time minus send time.
    got = StepResult(0, ("r",), (7,), (7,), (-0.5,), compute_us=250_000)
    assert c.handle(got, S2, 2.25) == [
        Send(S0, StepEntry(0, ("r",), (7,), (10,), (8,)), deadline=4.25),
        Deliver(RunResult("r", 0, (7,), None, 77)),
    ]
    assert (c.decode_steps, c.decode_wall_s, c.decode_compute_s) == (1, 0.5, 0.25)
    # A stage may still answer a row with a RunResult of its own.
    out = c.handle(result("r", (8,), 8, compute_us=500_000), S2, 3.25)
    assert out == [Deliver(RunResult("r", 0, (8,), "length", 77)), *releases("r", 3.25)]
    assert (c.steps, c.decode_steps, c.decode_wall_s, c.decode_compute_s) == (5, 2, 1.5, 0.75)
    # (1.5 s wall - 0.75 s compute) over 2 steps.
    assert c.decode_overhead_ms() == 375.0
    assert (c.completed, c.failed, c.reqs, c.held, c.next_timer()) == (1, 0, {}, 0, None)
    # The ended request is left clean: done, nothing pending, its slot given back.
    assert (req.state, req.pending, req.admitted) == (ReqState.DONE, set(), False)
    assert c.micro.members == [0, 0, 0] and c.dropped == Counter()


def test_eos_stops_without_a_token_and_completions_are_counted() -> None:
    c = core()
    for i, rid in enumerate(("a", "b")):
        c.handle(entry(rid), LOCAL, 0.0)
        assert ack_all(c, rid, 1 + 4 * i, 0.25) == [step(rid, (1,), 0, 4 + 4 * i, 2.25)]
        out = c.handle(result(rid, (EOS,), 4 + 4 * i), S2, 0.5)
        assert out == [Deliver(RunResult(rid, 0, (), "stop", 77)), *releases(rid, 0.5)]
    assert (c.completed, c.steps, c.decode_steps) == (2, 2, 2)


def test_return_logits_picks_with_the_entrys_sampling_and_threads_the_pickers_state() -> None:
    calls: list[tuple[tuple[int, ...], SamplingParams, object]] = []

    def pick(t: Tensor, sp: SamplingParams, state: object) -> tuple[int, object]:
        calls.append((t.shape, sp, state))
        return 5, len(calls)

    c = core(return_logits=True, pick_token=pick)
    c.handle(entry(), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)
    logits = Tensor("float32", (1, 1, 16), bytes(64))
    # The stage's logprobs are not passed on: the pick decides the token.
    out = c.handle(result("r", (), 4, logits=logits, logprobs=(-1.0,)), S2, 0.5)
    assert out == [Deliver(RunResult("r", 0, (5,), None, 77)), step("r", (5,), 1, 5, 2.5)]
    c.handle(result("r", (), 5, logits=logits), S2, 0.75)
    assert calls == [((1, 1, 16), SP, None), ((1, 1, 16), SP, 1)]


@pytest.mark.parametrize(
    "logits, detail",
    [
        (None, "None, expected [1, 1, 16]"),
        (Tensor("float32", (1, 1, 15), bytes(60)), "[1, 1, 15], expected [1, 1, 16]"),
    ],
)
def test_logits_of_the_wrong_shape_are_dropped_with_the_shape(
    logits: Tensor | None, detail: str
) -> None:
    c = core(return_logits=True, pick_token=lambda t, sp, st: (5, st))
    c.handle(entry(), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)
    out = c.handle(result("r", (), 4, logits=logits), S2, 0.5)
    assert out == [drop("RunResult", S2, "logits of the wrong shape", detail)]
    assert c.dropped == Counter({"logits of the wrong shape": 1})


def test_decode_overhead_is_zero_before_any_decode_step() -> None:
    c = core()
    c.handle(entry(prompt=(1, 2)), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)
    c.handle(result("r", (), 4, compute_us=1_000_000), S2, 1.25)  # a chunk: not decode
    assert (c.steps, c.decode_steps, c.decode_wall_s, c.decode_compute_s) == (1, 0, 0.0, 0.0)
    assert c.decode_overhead_ms() == 0.0


# --- what is dropped -----------------------------------------------------------------------------
def test_remote_entries_and_cancels_are_dropped_by_type() -> None:
    c = core()
    assert c.handle(entry(), S0, 0.0) == [drop("RunEntry", S0, "RunEntry is only accepted locally")]
    assert c.handle(CancelRequest("r", "x"), STRANGER, 0.0) == [
        drop("CancelRequest", STRANGER, "CancelRequest is only accepted locally")
    ]
    assert c.dropped == Counter(
        {"RunEntry is only accepted locally": 1, "CancelRequest is only accepted locally": 1}
    )
    assert c.reqs == {}


def test_strangers_and_non_coordinator_messages_are_dropped() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    assert c.handle(Ack("r", 1), STRANGER, 0.1) == [
        drop("Ack", STRANGER, "not from a stage of this pipeline")
    ]
    assert c.handle(PrepareSequence("r", 4, 1), S0, 0.1) == [
        drop("PrepareSequence", S0, "not a coordinator message")
    ]
    # Our own Deliver effects routed back by a bus: ignored, not counted.
    assert c.handle(RunResult("r", 0, (3,), None, 77), LOCAL, 0.1) == []
    assert c.dropped == Counter(
        {"not from a stage of this pipeline": 1, "not a coordinator message": 1}
    )
    assert c.reqs["r"].pending == {1, 2, 3}


def test_acks_and_states_that_match_no_exchange_are_dropped() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    assert c.handle(Ack("r", 99), S0, 0.1) == [drop("Ack", S0, "stale or unknown nonce")]
    assert c.handle(State("n", (0, 1), 0, False, 1), S0, 0.1) == [  # an Ack's exchange
        drop("State", S0, "stale or unknown nonce")
    ]
    assert c.handle(Ack("r", 1), S1, 0.1) == [
        drop("Ack", S1, "not from the stage the exchange addressed", S0)
    ]
    ack_all(c, "r", 1, 0.25)
    assert c.handle(Ack("r", 4), S0, 0.5) == [  # the nonce of a RunResult exchange
        drop("Ack", S0, "stale or unknown nonce")
    ]
    assert c.dropped == Counter(
        {"stale or unknown nonce": 3, "not from the stage the exchange addressed": 1}
    )
    assert c.reqs["r"].pending == {4}


@pytest.mark.parametrize(
    "source, msg, why",
    [
        (S1, result("r", (3,), 4), "not from the final stage"),
        (S2, result("r", (3,), 99), "stale or unknown nonce"),
        (S2, result("r", (3,), 1), "stale or unknown nonce"),  # an Ack's exchange
        (S2, result("x", (3,), 4), "request or micro-batch does not match the exchange"),
        (
            S2,
            RunResult("r", 1, (3,), None, 4),
            "request or micro-batch does not match the exchange",
        ),
        (S2, result("r", (3, 4), 4), "a sampled RunResult carries exactly one token"),
    ],
)
def test_results_that_do_not_answer_the_waiting_exchange_are_dropped_word_for_word(
    source: str, msg: RunResult, why: str
) -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    c.handle(Ack("r", 1), S0, 0.25)  # nonce 1 is closed: its Ack came
    c.handle(Ack("r", 2), S1, 0.25)
    c.handle(Ack("r", 3), S2, 0.25)
    assert c.handle(msg, source, 0.5) == [drop("RunResult", source, why)]
    assert c.dropped == Counter({why: 1}) and c.steps == 0
    # The exchange still waits, on its own deadline.
    assert c.reqs["r"].pending == {4} and c.next_timer() == 2.25


def test_a_chunk_result_with_a_token_is_dropped() -> None:
    c = core()
    c.handle(entry(prompt=(1, 2)), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)
    why = "a prompt-chunk RunResult carries no token and no logits"
    assert c.handle(result("r", (3,), 4), S2, 0.5) == [drop("RunResult", S2, why)]


def test_progress_naming_more_exchanges_than_wait_is_dropped_whole() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)  # three exchanges wait
    assert c.handle(Progress((1, 2, 3)), S0, 0.5) == []  # exactly as many: taken (Acks: ignored)
    why = "Progress names more exchanges than are waiting"
    assert c.handle(Progress((1, 2, 3, 1)), S0, 0.5) == [drop("Progress", S0, why)]
    assert c.dropped == Counter({why: 1}) and c.next_timer() == 2.0


# --- errors from stages --------------------------------------------------------------------------
def test_an_error_without_a_request_id_fails_the_exchange_it_names() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)
    req = c.reqs["r"]
    # From a stage downstream of the one addressed: counts for a RunResult exchange.
    out = c.handle(Error(ErrorCode.BAD_ACTIVATION, "bad", None, 4), S1, 0.5)
    assert out == fails("r", ErrorCode.BAD_ACTIVATION, f"{S1}: bad") + releases("r", 0.5)
    assert (c.failed, c.reqs, req.state, req.pending) == (1, {}, ReqState.DONE, set())


def test_an_error_on_a_prepare_fails_the_request_and_releases_every_stage() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    out = c.handle(Error(ErrorCode.TOO_MANY_SEQUENCES, "full", "r", 2), S1, 0.5)
    why = f"{S1}: full"
    assert out == fails("r", ErrorCode.TOO_MANY_SEQUENCES, why) + releases("r", 0.5)
    # Its other Acks are now stale.
    assert c.handle(Ack("r", 1), S0, 0.75) == [drop("Ack", S0, "stale or unknown nonce")]
    assert c.next_timer() is None


def test_an_error_on_a_query_answers_it() -> None:
    c = core()
    token, out = c.query(S1, 0.0, 1.0)
    assert (token, out) == (1, [Send(S1, QueryState(1), deadline=1.0)])
    got = norm(c.handle(Error(ErrorCode.DRAINING, "busy", None, 1), S1, 0.5))
    assert got == [Failed(1, ErrorCode.DRAINING, f"{S1}: busy")]


def test_unmatched_and_misaddressed_errors_are_dropped_with_their_text() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    long = "x" * 250
    assert c.handle(Error("oops", "no nonce", "r", None), S0, 0.1) == [
        drop("Error", S0, "unmatched error", "oops: no nonce")
    ]
    assert c.handle(Error("oops", long, "r", 99), S0, 0.1) == [
        drop("Error", S0, "unmatched error", "oops: " + "x" * 200)  # cut at 200 characters
    ]
    # The nonce of a waiting exchange, but another request's id.
    assert c.handle(Error("oops", "y", "other", 1), S0, 0.1) == [
        drop("Error", S0, "unmatched error", "oops: y")
    ]
    # An Ack exchange's error must come from the stage it addressed (S0).
    assert c.handle(Error("oops", "y", "r", 1), S1, 0.1) == [
        drop("Error", S1, "not from the stage the exchange addressed", S0)
    ]
    assert c.dropped == Counter(
        {"unmatched error": 3, "not from the stage the exchange addressed": 1}
    )
    assert c.reqs["r"].pending == {1, 2, 3} and c.failed == 0


def test_an_undecodable_answer_fails_its_exchange_word_for_word() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)
    why = f"{S2}: undecodable message (kind 4): bad tensor"
    out = c.handle(Undecodable(4, "r", 4, "bad tensor"), S2, 0.5)
    assert out == fails("r", ErrorCode.BAD_MESSAGE, why) + releases("r", 0.5)


def test_an_undecodable_answer_for_another_request_is_dropped() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)
    out = c.handle(Undecodable(None, "other", 4, "bad"), S2, 0.5)
    detail = "bad_message: undecodable message (kind None): bad"
    assert out == [drop("Error", S2, "unmatched error", detail)]
    assert c.reqs["r"].pending == {4}


# --- deadlines -----------------------------------------------------------------------------------
def test_a_query_fires_at_its_deadline_and_resets_only_its_stage() -> None:
    c = core()
    assert c.query(S1, 0.0, 1.0) == (1, [Send(S1, QueryState(1), deadline=1.0)])
    assert c.query(S1, 0.0, 4.0)[0] == 2
    assert c.query(S0, 0.0, 4.0)[0] == 3
    assert c.next_timer() == 1.0
    assert c.on_timer(1.0 - 1e-6) == []
    # By default a missed query replaces the connections; the other query to S1 fails with it.
    assert norm(c.on_timer(1.0)) == [
        ResetPeer(S1),
        Failed(1, DEADLINE, f"no State from {S1} for a query within 1s"),
        Failed(2, UNREACHABLE, f"the connections to stage {S1} were reset after a missed deadline"),
    ]
    assert c.next_timer() == 4.0  # the query to S0 still waits
    st = State("n0", (0, 4), 0, False, 3)
    assert c.handle(st, S0, 2.0) == [Answer(3, st)]


def test_queries_without_reset_due_together_all_fire_past_a_closed_one() -> None:
    c = core()
    c.query(S0, 0.0, 0.5, reset=False)
    c.query(S1, 0.0, 1.0, reset=False)
    c.query(S2, 0.0, 1.0, reset=False)
    st = State("n0", (0, 4), 0, False, 1)
    assert c.handle(st, S0, 0.25) == [Answer(1, st)]  # its heap entry lingers
    assert norm(c.on_timer(1.0)) == [
        Failed(2, DEADLINE, f"no State from {S1} for a query within 1s"),
        Failed(3, DEADLINE, f"no State from {S2} for a query within 1s"),
    ]
    assert c.next_timer() is None


def test_a_step_deadline_with_the_path_alive_fails_only_its_request() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)  # the step goes out at 0.25
    # The final stage speaks after the step was sent (a stale Ack): the path is not wedged.
    assert c.handle(Ack("r", 1), S2, 0.5) == [drop("Ack", S2, "stale or unknown nonce")]
    assert c.next_timer() == 2.25
    assert c.on_timer(2.25 - 1e-6) == []
    why = f"no result for r from the pipeline {S0}..{S2} within 2s"
    assert c.on_timer(2.25) == fails("r", DEADLINE, why) + releases("r", 2.25)
    assert c.failed == 1 and c.next_timer() is None


def test_a_stage_heard_exactly_when_the_step_was_sent_does_not_count_as_alive() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)  # last heard at 0.25 == sent_at: nothing since
    why = f"no result for r from the pipeline {S0}..{S2} within 2s"
    assert c.on_timer(2.25) == [ResetPeer(S0)] + fails("r", DEADLINE, why) + releases("r", 2.25)


def test_a_prompt_chunk_deadline_names_the_entry_stage() -> None:
    c = core()
    c.handle(entry(prompt=(1, 2, 3)), LOCAL, 0.0)
    assert ack_all(c, "r", 1, 0.25) == [chunk((1, 2), 0, 4, 2.25)]
    why = f"no result for r from the pipeline {S0}..{S2} within 2s"
    assert c.on_timer(2.25) == [ResetPeer(S0)] + fails("r", DEADLINE, why) + releases("r", 2.25)


def test_a_prepare_deadline_names_the_stage_and_request() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    c.handle(Ack("r", 1), S0, 0.25)
    c.handle(Ack("r", 3), S2, 0.25)
    why = f"no Ack from {S1} for r within 2s"
    assert c.on_timer(2.0) == [ResetPeer(S1)] + fails("r", DEADLINE, why) + releases("r", 2.0)


def test_progress_carries_a_step_past_its_deadline_and_other_deadlines_still_fire() -> None:
    c = core()
    c.handle(entry("a"), LOCAL, 0.0)
    ack_all(c, "a", 1, 0.25)  # a's step: nonce 4, due at 2.25
    c.query(S1, 0.0, 2.5, reset=False)  # nonce 5, due at 2.5
    assert c.handle(Progress((4, 4)), S0, 1.0) == []  # due at 3.0 now
    assert norm(c.on_timer(2.5)) == [
        Failed(5, DEADLINE, f"no State from {S1} for a query within 2.5s")
    ]
    assert c.kept_alive == 1 and c.next_timer() == 3.0
    assert c.on_timer(3.0 - 1e-6) == []
    # S0 spoke after the step was sent (its Progress): no reset.
    why = (
        f"no result for a from the pipeline {S0}..{S2} within 2s of the last progress "
        "report (2.8s in all)"
    )
    assert c.on_timer(3.0) == fails("a", DEADLINE, why) + releases("a", 3.0)
    assert c.kept_alive == 1


def test_a_reset_fails_every_request_in_the_stages_and_queries_to_that_stage_only() -> None:
    """a's step misses its deadline on a silent path: S0 is reset. b (parked behind a) fails
    too, the query to S0 is answered, the one to S1 still waits, and w (waiting for a slot)
    is admitted when a's slot frees -- on fresh connections, unharmed."""
    c = core(max_in_flight=2, micro_batch_size=2)
    c.handle(entry("a", nonce=71), LOCAL, 0.0)
    assert ack_all(c, "a", 1, 0.25) == [step("a", (1,), 0, 4, 2.25)]
    c.handle(entry("b", nonce=72), LOCAL, 0.0)
    assert ack_all(c, "b", 5, 0.25) == []  # parked: a's step is in the stages
    b = c.reqs["b"]
    assert c.query(S0, 0.0, 10.0)[0] == 8
    assert c.query(S1, 0.0, 10.0)[0] == 9
    assert c.handle(entry("w", nonce=73), LOCAL, 0.5) == []
    missed = f"no result for a from the pipeline {S0}..{S2} within 2s"
    why = f"the connections to stage {S0} were reset after a missed deadline"
    assert norm(c.on_timer(2.25)) == [
        ResetPeer(S0),
        *fails("a", DEADLINE, missed, 71),
        *releases("a", 2.25),
        *preps("w", 4, 10, 4.25),
        Failed(8, UNREACHABLE, why),
        *fails("b", UNREACHABLE, why, 72),
        *releases("b", 2.25),
    ]
    assert list(c.reqs) == ["w"] and c.reqs["w"].state is ReqState.PREPARING
    assert (b.state, b.parked, b.admitted) == (ReqState.DONE, False, False)
    assert not c.micro.holding and c.micro.members == [1] and c.failed == 2
    assert c.next_timer() == 4.25


# --- lost stages ---------------------------------------------------------------------------------
def test_a_lost_stage_fails_requests_and_its_queries_at_once() -> None:
    c = core(max_in_flight=2, micro_batch_size=2)
    c.handle(entry("a", nonce=71), LOCAL, 0.0)
    ack_all(c, "a", 1, 0.25)  # a's step (4) in the stages
    c.handle(entry("b", nonce=72), LOCAL, 0.0)
    ack_all(c, "b", 5, 0.25)  # b parked behind a
    c.query(S0, 0.0, 10.0)  # 8
    c.query(S1, 0.0, 10.0)  # 9
    assert c.peer_lost(STRANGER, 0.5) == [] and len(c.reqs) == 2
    why = f"lost the connection to stage {S1}"
    assert norm(c.peer_lost(S1, 0.5)) == [
        Failed(9, UNREACHABLE, why),
        *fails("a", UNREACHABLE, why, 71),
        *releases("a", 0.5),
        *fails("b", UNREACHABLE, why, 72),
        *releases("b", 0.5),
    ]
    assert c.reqs == {} and c.next_timer() == 10.0  # the query to S0 still waits


def test_a_stage_found_down_fails_everything_and_refuses_new_requests_until_it_answers() -> None:
    c = core(max_in_flight=1)
    c.handle(entry("a", nonce=71), LOCAL, 0.0)
    ack_all(c, "a", 1, 0.25)  # a's step (4) in the stages
    c.handle(entry("w", nonce=72), LOCAL, 0.3)  # waits for a slot
    assert c.stage_health(STRANGER, False, "x", 0.4) == [] and len(c.reqs) == 2
    # First answer: it joined (said once); up and known up: nothing more to say.
    joined = Warn("info", f"coordinator: stage {S1} joined (s1, layers 2-3)")
    assert c.stage_health(S1, True, "", 0.4, "s1, layers 2-3") == [joined]
    assert c.stage_health(S1, True, "", 0.45, "s1, layers 2-3") == []
    why = "no State for a query within 2s"
    text = f"stage {S1} is unreachable: {why}"
    assert c.stage_health(S1, False, why, 0.5) == [
        Warn("warning", f"coordinator: stage {S1} lost: {why}"),
        *fails("a", UNREACHABLE, text, 71),
        *releases("a", 0.5),
        *fails("w", UNREACHABLE, text, 72),
    ]
    assert c.reqs == {} and c.down == {S1: why} and c.failed == 2
    # Refused at once while it is down (the client gets 503 and may retry), not queued.
    assert c.handle(entry("n", nonce=73), LOCAL, 0.6) == [
        Deliver(Error(UNREACHABLE, text, "n", 73))
    ]
    assert c.reqs == {} and c.failed == 3
    # Still down: the reason is updated, nothing is said twice.
    assert c.stage_health(S1, False, "refused", 0.7) == [] and c.down == {S1: "refused"}
    # Back: said once, and requests are admitted again.
    assert c.stage_health(S1, True, "", 0.8) == [
        Warn("info", f"coordinator: stage {S1} is back after 0.3s down (refused)")
    ]
    assert c.down == {} and c.handle(entry("n2"), LOCAL, 0.9) == preps("n2", 4, 5, 2.9)


def test_a_request_parked_after_its_result_holds_no_exchange_and_fails_with_its_stage() -> None:
    c = core(max_in_flight=2, micro_batch_size=2)
    c.handle(entry("a", nonce=71), LOCAL, 0.0)
    ack_all(c, "a", 1, 0.25)  # a1 = 4
    c.handle(entry("b", nonce=72), LOCAL, 0.0)
    ack_all(c, "b", 5, 0.25)  # parked
    out = c.handle(result("a", (3,), 4), S2, 0.5)  # releases b1 and a2 together, in park order
    assert out == [
        Deliver(RunResult("a", 0, (3,), None, 71)),
        Send(S0, StepEntry(0, ("b", "a"), (1, 3), (0, 1), (8, 9)), deadline=2.5),
    ]
    # b's result comes first: b parks behind a2, with nothing of its own pending.
    out = c.handle(result("b", (4,), 8), S2, 0.75)
    assert out == [Deliver(RunResult("b", 0, (4,), None, 72))]
    assert (c.reqs["b"].pending, c.reqs["b"].parked) == (set(), True)
    why = f"lost the connection to stage {S0}"
    assert c.peer_lost(S0, 1.0) == [
        *fails("a", UNREACHABLE, why, 71),
        *releases("a", 1.0),
        *fails("b", UNREACHABLE, why, 72),
        *releases("b", 1.0),
    ]


# --- undeliverable sends -------------------------------------------------------------------------
def test_an_undeliverable_send_fails_its_exchange_or_is_logged() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    (send,) = ack_all(c, "r", 1, 0.25)
    assert isinstance(send, Send)
    out = c.undeliverable(send, "connection refused", 0.5)
    assert out == fails("r", UNREACHABLE, "connection refused") + releases("r", 0.5)
    # A message that opens no exchange (or one already closed): a debug line, nothing else.
    assert c.undeliverable(releases("r", 0.5)[0], "refused", 0.5) == [  # type: ignore[arg-type]
        Warn("debug", f"coordinator: ReleaseSequence to {S0}: refused")
    ]
    assert c.undeliverable(send, "late", 0.75) == [
        Warn("debug", f"coordinator: StepEntry to {S0}: late")
    ]
    token, (query,) = c.query(S2, 1.0, 1.0)
    assert isinstance(query, Send)
    assert norm(c.undeliverable(query, "no route", 1.5)) == [Failed(token, UNREACHABLE, "no route")]


# --- cancellation --------------------------------------------------------------------------------
def test_a_cancel_releases_the_stages_and_leaves_nothing_waiting() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    c.handle(Ack("r", 1), S0, 0.25)
    req = c.reqs["r"]
    assert c.handle(CancelRequest("r", "client gone"), LOCAL, 0.5) == releases("r", 0.5)
    assert (req.state, req.pending, req.admitted) == (ReqState.DONE, set(), False)
    assert (c.reqs, c.held, c.failed, c.completed) == ({}, 0, 0, 0)
    # Its exchanges closed with it: a late Ack is stale, and no deadline is left.
    assert c.handle(Ack("r", 2), S1, 0.75) == [drop("Ack", S1, "stale or unknown nonce")]
    assert c.next_timer() is None and c.on_timer(10.0) == []
    assert c.handle(CancelRequest("nobody", "x"), LOCAL, 1.0) == []


def test_a_waiting_request_cancels_without_releases() -> None:
    c = core(max_in_flight=1)
    c.handle(entry("a"), LOCAL, 0.0)
    c.handle(entry("w"), LOCAL, 0.0)
    w = c.reqs["w"]
    assert c.handle(CancelRequest("w", "x"), LOCAL, 0.5) == []
    assert (w.state, w.admitted) == (ReqState.DONE, False) and list(c.reqs) == ["a"]


# --- the simulator's injected bug ----------------------------------------------------------------
def test_accept_stale_nonce_takes_a_result_with_any_nonce_of_its_request() -> None:
    c = core()
    c.handle(entry(), LOCAL, 0.0)
    ack_all(c, "r", 1, 0.25)
    # A right nonce is still checked as usual.
    why = "a sampled RunResult carries exactly one token"
    assert c.handle(result("r", (3, 4), 4), S2, 0.5) == [drop("RunResult", S2, why)]
    # An unknown nonce of another request: nothing to take it for.
    assert c.handle(result("x", (3,), 99), S2, 0.5) == [
        drop("RunResult", S2, "stale or unknown nonce")
    ]
    # An unknown nonce of this request: dropped, unless the bug is planted (mlxcel.sim.bugs).
    assert c.handle(result("r", (3,), 99), S2, 0.5) == [
        drop("RunResult", S2, "stale or unknown nonce")
    ]
    with planted(frozenset({"accept-stale-nonce"})):
        out = c.handle(result("r", (3,), 99), S2, 0.5)
    assert out == [Deliver(RunResult("r", 0, (3,), None, 77)), step("r", (3,), 1, 5, 2.5)]
    assert c.reqs["r"].pending == {5}


def test_a_stage_found_down_fails_its_queries_and_a_first_answer_may_name_nothing() -> None:
    c = core()
    (token, _) = c.query(S1, 0.0, 10.0)
    c.query(S0, 0.0, 10.0)
    why = "no State for a query within 2s"
    assert norm(c.stage_health(S1, False, why, 0.5)) == [
        Warn("warning", f"coordinator: stage {S1} lost: {why}"),
        Failed(token, UNREACHABLE, f"stage {S1} is unreachable: {why}"),
    ]
    assert c.next_timer() == 10.0  # the query to S0 still waits
    assert c.stage_health(S0, True, "", 0.6) == [Warn("info", f"coordinator: stage {S0} joined")]
