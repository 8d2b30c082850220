"""The engine's core, exactly: every input and the effects it answers with, compared with
``==`` (no MLX, no loop, no clock: the times are the test's)."""

from __future__ import annotations

from mlxcel.base.effects import CutShort, Deliver, StartCompute, Stopped, Warn
from mlxcel.base.handoff import Packed
from mlxcel.base.messages import (
    CacheKept,
    CancelRequest,
    Error,
    ErrorCode,
    PrefillEntry,
    ReleaseSequence,
    ResumeSequence,
    RunEntry,
    RunResult,
    SamplingParams,
)
from mlxcel.runtime.engine_core import EngineCore
from mlxcel.runtime.engine_state import EngineJob, EngineStep, Insert, ResetJob

CONFIG = {"vocab_size": 100, "max_position_embeddings": 64}
EOS = 0
FE = "local"  # the frontend's source


def entry(
    rid: str = "a", prompt: tuple[int, ...] = (5, 6, 7), n: int = 4, **kw: object
) -> RunEntry:
    return RunEntry(rid, 0, prompt, 0, SamplingParams(max_tokens=n, **kw), 11)  # type: ignore[arg-type]


def core(**kw: object) -> EngineCore:
    return EngineCore(CONFIG, {EOS}, **kw)  # type: ignore[arg-type]


def started(c: EngineCore, *msgs: object, now: float = 0.0) -> list[object]:
    """Hand an idle core ``msgs`` (each answered with nothing yet: a job starts from the
    timer, due at once), then run that timer: what it starts."""
    for m in msgs:
        assert c.handle(m, FE, now) == []  # type: ignore[arg-type]
    assert c.next_timer() == now
    return c.on_timer(now)  # type: ignore[return-value]


def step(
    new: dict[str, int] | None = None, tokens: list[tuple[str, int, str | None]] = (), **kw: object
) -> EngineStep:
    """What a step hands back: new uids, then (request id, token, finish) in order."""
    out = EngineStep(steps=1, new_uids=dict(new or {}), **kw)  # type: ignore[arg-type]
    out.tokens = [(r, t, f, None, None) for r, t, f in tokens]
    return out


def test_an_entry_starts_a_job_and_its_tokens_come_back_as_one_result_per_job() -> None:
    c, e, d = core(), entry(), entry("d")
    # Entries that arrive together start together, on the timer's turn.
    assert started(c, e, d, now=1.0) == [
        StartCompute(EngineJob(1, (Insert(e), Insert(d)), (), {}, {}))
    ]
    assert c.active == 2 and c.job == 1 and c.next_timer() is None
    c.handle(CancelRequest("d", "client"), FE, 1.0)
    out = c.compute_done(
        1, step({"a": 7, "d": 8}, [("a", 40, None), ("a", 41, None)], prompt_tokens=3), 1.1
    )
    assert out == [
        Deliver(RunResult("a", 0, (40, 41), None, 11)),
        StartCompute(EngineJob(2, (), (8,), {7: "a"}, {})),  # at once: a job ended
    ]
    assert (c.steps, c.prompt_tokens, c.tokens_generated, c.kv_tokens()) == (1, 3, 2, 5)
    # The end-of-sequence token finishes it and is not part of the text.
    out = c.compute_done(2, step(tokens=[("a", 42, None), ("a", EOS, "stop")]), 1.2)
    assert out == [Deliver(RunResult("a", 0, (42,), "stop", 11))]
    assert (c.active, c.by_uid, c.job, c.next_timer()) == (0, {}, None, None)


def test_bad_duplicate_and_surplus_entries_are_refused_by_name_and_start_nothing() -> None:
    c = core(max_sequences=1)

    def refused(e: RunEntry, why: str) -> list[object]:
        return [Deliver(Error(ErrorCode.BAD_REQUEST, why, e.request_id, 11))]

    assert c.handle(entry("x", ()), FE, 0.0) == refused(entry("x", ()), "empty prompt")
    bad = entry("x", (5, 100))
    assert c.handle(bad, FE, 0.0) == refused(bad, "token id outside the vocabulary [0, 100)")
    long = entry("x", (5,) * 60, 8)
    why = "prompt (60 tokens) + max_tokens (8) exceeds the model's context of 64"
    assert c.handle(long, FE, 0.0) == refused(long, why)
    bias = entry("x", logit_bias_ids=(100,), logit_bias_values=(1.0,))
    assert c.handle(bias, FE, 0.0) == refused(
        bias, "logit_bias names a token outside the vocabulary [0, 100)"
    )
    assert c.active == 0 and c.job is None and c.next_timer() is None
    e = entry("a")
    assert started(c, e) == [StartCompute(EngineJob(1, (Insert(e),), (), {}, {}))]
    assert c.handle(e, FE, 0.0) == refused(e, "request 'a' is already running")
    b = entry("b")
    assert c.handle(b, FE, 0.0) == refused(b, "the engine holds its maximum of 1 sequences")
    assert c.active == 1


def test_changes_while_a_job_runs_cut_it_short_once_and_join_the_next_job() -> None:
    c, a, b, d = core(), entry("a"), entry("b", logprobs=True, top_logprobs=2), entry("d")
    started(c, a)
    assert c.handle(b, FE, 0.1) == [CutShort()]
    assert c.handle(d, FE, 0.1) == []  # said once per job
    assert c.handle(CancelRequest("d", "client"), FE, 0.2) == []  # queued: simply forgotten
    out = c.compute_done(1, step({"a": 1}, [("a", 40, None)]), 0.3)
    assert out == [
        Deliver(RunResult("a", 0, (40,), None, 11)),
        StartCompute(EngineJob(2, (Insert(b),), (), {1: "a"}, {"b": 2})),
    ]


def test_only_the_owner_cancels_and_a_running_row_leaves_in_the_next_job() -> None:
    c = core()
    started(c, entry("a"))
    c.compute_done(1, step({"a": 3}), 0.1)  # job 2 runs now
    assert c.handle(CancelRequest("a", "client"), "10.0.0.9:1", 0.2) == []  # not the owner
    assert c.active == 1
    assert c.handle(ReleaseSequence("a"), FE, 0.2) == [CutShort()]
    assert (c.active, c.to_remove) == (0, [3])
    # Its tokens from the job under way are dropped; the next job removes its row.
    out = c.compute_done(2, step(tokens=[("a", 40, None)]), 0.3)
    assert out == [StartCompute(EngineJob(3, (), (3,), {}, {}))]
    assert c.compute_done(3, step(), 0.4) == [] and c.job is None


def test_a_sequence_cancelled_while_its_insert_runs_leaves_with_the_next_job() -> None:
    c = core()
    started(c, entry("a"))
    assert c.handle(CancelRequest("a", "client"), FE, 0.1) == [CutShort()]
    out = c.compute_done(1, step({"a": 9}, [("a", 40, None)]), 0.2)
    assert out == [StartCompute(EngineJob(2, (), (9,), {}, {}))]


def test_a_failed_sampler_fails_its_sequence_alone() -> None:
    c, b = core(), entry("b")
    started(c, entry("a"))
    c.handle(b, FE, 0.0)
    assert c.compute_done(1, step({"a": 1}, [("a", 40, None)]), 0.1)[-1] == StartCompute(
        EngineJob(2, (Insert(b),), (), {1: "a"}, {})
    )
    out = c.compute_done(2, step({"b": 2}, [("b", 40, None)], failed={"a": "bad sampler"}), 0.2)
    assert out == [
        Warn("warning", "engine: request a failed alone: bad sampler"),
        Deliver(Error(ErrorCode.SAMPLING_FAILED, "bad sampler", "a", 11)),
        Deliver(RunResult("b", 0, (40,), None, 11)),
        StartCompute(EngineJob(3, (), (1,), {2: "b"}, {})),
    ]
    assert c.sequence_failures == 1


def test_a_prefill_entry_hands_back_its_cache_with_its_last_result() -> None:
    c, e = core(), entry("req-1@a1", n=1)
    assert started(c, PrefillEntry(e)) == [
        StartCompute(EngineJob(1, (Insert(e, keep_cache=True),), (), {}, {}))
    ]
    packed = Packed(3, 40, (), (), b"d")
    out = c.compute_done(
        1,
        step({"req-1@a1": 1}, [("req-1@a1", 40, "length")], kept={"req-1@a1": (packed, (1, 2))}),
        0.1,
    )
    assert out == [
        Deliver(CacheKept(RunResult("req-1@a1", 0, (40,), "length", 11), packed, (1, 2)))
    ]
    # One that finished without a cache (it could not be packed) fails by name.
    started(c, PrefillEntry(e), now=0.2)
    out = c.compute_done(2, step({"req-1@a1": 2}, [("req-1@a1", 40, "length")]), 0.3)
    why = "the finished sequence left no KV cache"
    assert out == [Deliver(Error(ErrorCode.ENGINE_FAILED, why, "req-1@a1", 11))]


def test_a_resumed_sequence_starts_from_its_cache_and_counts_its_positions() -> None:
    c, e = core(), entry("req-2@b2", (40,), 8)
    msg = ResumeSequence(e, "the cache", 30, (7, 7), (5, 6))
    assert started(c, msg) == [
        StartCompute(EngineJob(1, (Insert(e, "the cache", (7, 7), False, (5, 6)),), (), {}, {}))
    ]
    assert c.seqs["req-2@b2"].cache is None  # the job carries it: the core lets go
    c.compute_done(1, step({"req-2@b2": 4}, [("req-2@b2", 41, None)]), 0.1)
    assert c.kv_tokens() == 30 + 1 + 1


def test_the_prompt_cache_count_comes_with_the_first_result_only() -> None:
    c = core()
    started(c, entry("a"))
    out = c.compute_done(1, step({"a": 1}, [("a", 40, None)], cached={"a": 2}), 0.1)
    assert out[0] == Deliver(RunResult("a", 0, (40,), None, 11, cached_tokens=2))
    out = c.compute_done(2, step(tokens=[("a", 41, None)]), 0.2)
    assert out[0] == Deliver(RunResult("a", 0, (41,), None, 11))


def test_a_sequence_moved_into_the_batch_is_known_by_its_new_row() -> None:
    c = core()
    started(c, entry("a"))
    c.compute_done(1, step({"a": -1}), 0.1)  # decoding alone: a negative uid
    b = entry("b")
    assert c.handle(b, FE, 0.2) == [CutShort()]
    out = c.compute_done(2, step(), 0.3)
    assert out == [StartCompute(EngineJob(3, (Insert(b),), (), {-1: "a"}, {}))]
    out = c.compute_done(3, step({"b": 5}, moved={"a": 4}), 0.4)  # b's insert moved a
    assert out == [StartCompute(EngineJob(4, (), (), {4: "a", 5: "b"}, {}))]


def test_a_failed_step_fails_everyone_resets_and_goes_on() -> None:
    c = core()
    started(c, entry("a"), entry("b"))
    why = "engine step failed: out of memory"
    assert c.compute_failed(1, "out of memory", 0.5) == [
        Warn("warning", f"{why}; failing every running sequence"),
        Deliver(Error(ErrorCode.ENGINE_FAILED, why, "a", 11)),
        Deliver(Error(ErrorCode.ENGINE_FAILED, why, "b", 11)),
        StartCompute(ResetJob(2)),
    ]
    assert c.active == 0 and c.resetting
    e = entry("c")
    assert c.handle(e, FE, 0.6) == [CutShort()]  # waits for the reset
    assert c.compute_done(2, EngineStep(), 0.7) == [
        StartCompute(EngineJob(3, (Insert(e),), (), {}, {}))
    ]


def test_a_reset_that_fails_ends_the_engine() -> None:
    c = core()
    started(c, entry("a"))
    c.compute_failed(1, "boom", 0.1)
    why = "could not reset after a failed step: still broken"
    assert c.compute_failed(2, "still broken", 0.2) == [
        Warn("warning", f"{why}; the engine stops"),
        Stopped(),
    ]
    e = entry("b")
    assert c.handle(e, FE, 0.3) == [Deliver(Error(ErrorCode.ENGINE_FAILED, why, "b", 11))]


def test_an_unrecoverable_engine_fails_everyone_and_refuses_from_then_on() -> None:
    """Tensor parallelism: a failed step means a rank is gone."""
    c = core(recoverable=False, failure_code="tp_group_failed", failure_prefix="rank lost: ")
    started(c, entry("a"))
    why = "rank lost: engine step failed: collective failed"
    assert c.compute_failed(1, "collective failed", 0.1) == [
        Warn("warning", f"{why}; the engine stops"),
        Deliver(Error("tp_group_failed", why, "a", 11)),
        Stopped(),
    ]
    assert c.failure == why
    assert c.handle(entry("b"), FE, 0.2) == [Deliver(Error("tp_group_failed", why, "b", 11))]


def test_a_step_that_overruns_its_timeout_is_abandoned() -> None:
    c = core(step_timeout=10.0)
    assert c.next_timer() is None
    started(c, entry("a"), now=2.0)
    assert c.next_timer() == 12.0
    assert c.on_timer(11.9) == []
    why = "engine step took longer than 10s"
    assert c.on_timer(12.0) == [
        Warn("warning", f"{why}; failing every running sequence"),
        Deliver(Error(ErrorCode.ENGINE_FAILED, why, "a", 11)),
        StartCompute(ResetJob(2)),
    ]
    # The overrun step's late answer changes nothing.
    assert c.compute_done(1, step({"a": 1}, [("a", 40, None)]), 13.0) == []
    assert c.compute_failed(1, "late", 13.0) == []
    assert c.next_timer() == 22.0  # the reset is timed too


def test_abort_ends_the_engine_without_waiting_for_its_step() -> None:
    c = core(recoverable=False, step_timeout=120.0, failure_prefix="rank lost: ")
    started(c, entry("a"))
    assert c.abort("rank 1 exited with status 9") == [
        Warn("warning", "rank lost: rank 1 exited with status 9; the engine stops"),
        Deliver(Error(ErrorCode.ENGINE_FAILED, "rank lost: rank 1 exited with status 9", "a", 11)),
        Stopped(),
    ]
    assert c.next_timer() is None and c.abort("again") == []


def test_an_entry_cancelled_before_its_job_starts_leaves_nothing_to_do() -> None:
    c = core()
    assert c.handle(entry("a"), FE, 0.0) == []
    assert c.handle(CancelRequest("a", "client"), FE, 0.0) == []
    assert c.next_timer() == 0.0 and c.on_timer(0.0) == []
    assert (c.active, c.job, c.next_timer()) == (0, None, None)


def test_the_default_table_holds_64_sequences() -> None:
    c = core()
    for i in range(64):
        assert c.handle(entry(f"r{i}"), FE, 0.0) == []
    e = entry("r64")
    why = "the engine holds its maximum of 64 sequences"
    assert c.handle(e, FE, 0.0) == [Deliver(Error(ErrorCode.BAD_REQUEST, why, "r64", 11))]


def test_a_burst_starts_when_its_first_entry_came() -> None:
    c = core()
    c.handle(entry("a"), FE, 1.0)
    c.handle(entry("b"), FE, 1.5)
    assert c.next_timer() == 1.0  # not pushed back by the later entry


def test_counters_add_up_over_jobs() -> None:
    c = core()
    started(c, entry("a", n=8))
    c.compute_done(1, step({"a": 1}, [("a", 40, None), ("a", 41, None)], prompt_tokens=3), 0.1)
    c.compute_done(2, step(tokens=[("a", 42, None)], prompt_tokens=1), 0.2)
    assert (c.steps, c.prompt_tokens, c.tokens_generated) == (2, 4, 3)
    assert c.kv_tokens() == 3 + 3  # the prompt and every generated token
    c.compute_done(3, step(tokens=[("a", 43, None)], failed={"x": "-", "a": "bad", "b": "-"}), 0.3)
    assert c.sequence_failures == 1  # unknown ids are not counted


def test_every_sequence_that_fails_alone_is_told() -> None:
    c, a, b = core(), entry("a"), entry("b")
    started(c, a, b)
    out = c.compute_done(1, step({"a": 1, "b": 2}, failed={"a": "nan", "b": "inf"}), 0.1)
    assert out == [
        Warn("warning", "engine: request a failed alone: nan"),
        Deliver(Error(ErrorCode.SAMPLING_FAILED, "nan", "a", 11)),
        Warn("warning", "engine: request b failed alone: inf"),
        Deliver(Error(ErrorCode.SAMPLING_FAILED, "inf", "b", 11)),
        StartCompute(EngineJob(2, (), (1, 2), {}, {})),
    ]
    assert c.sequence_failures == 2


def test_only_a_final_end_of_sequence_token_is_left_out() -> None:
    c = core()
    started(c, entry("a", n=8), entry("b", n=8))
    out = c.compute_done(
        1,
        step(
            {"a": 1, "b": 2},
            [("a", EOS, None), ("b", 40, None), ("b", 41, None), ("b", EOS, "stop")],
        ),
        0.1,
    )
    assert out[:2] == [
        Deliver(RunResult("a", 0, (EOS,), None, 11)),  # not finishing: an ordinary token
        Deliver(RunResult("b", 0, (40, 41), "stop", 11)),
    ]
    out = c.compute_done(2, step(tokens=[("a", 40, None), ("a", EOS, "length")]), 0.2)
    assert out == [Deliver(RunResult("a", 0, (40, EOS), "length", 11))]


def test_log_probabilities_come_with_their_tokens() -> None:
    c, e = core(), entry("a", logprobs=True, top_logprobs=2)
    assert started(c, e) == [StartCompute(EngineJob(1, (Insert(e),), (), {}, {"a": 2}))]
    out = EngineStep(steps=1, new_uids={"a": 1})
    out.tokens = [
        ("a", 40, None, -0.5, ([40, 9], [-0.5, -1.5])),
        ("a", 41, None, -0.25, ([41, 8], [-0.25, -2.0])),
    ]
    assert c.compute_done(1, out, 0.1)[0] == Deliver(
        RunResult(
            "a", 0, (40, 41), None, 11,
            logprobs=(-0.5, -0.25), top_ids=(40, 9, 41, 8), top_logprobs=(-0.5, -1.5, -0.25, -2.0),
        )
    )  # fmt: skip


def test_results_after_a_cancelled_sequence_still_come() -> None:
    c = core()
    started(c, entry("a"), entry("b"))
    c.handle(CancelRequest("a", "client"), FE, 0.1)
    out = c.compute_done(1, step({"a": 1, "b": 2}, [("a", 40, None), ("b", 41, None)]), 0.2)
    assert out == [
        Deliver(RunResult("b", 0, (41,), None, 11)),
        StartCompute(EngineJob(2, (), (1,), {2: "b"}, {})),
    ]


def test_a_prefill_without_a_cache_fails_alone() -> None:
    c, a, b = core(), entry("a", n=1), entry("b", n=1)
    started(c, PrefillEntry(a), PrefillEntry(b))
    packed = Packed(3, 40, (), (), b"d")
    out = c.compute_done(
        1,
        step(
            {"a": 1, "b": 2}, [("a", 40, "length"), ("b", 41, "length")], kept={"b": (packed, ())}
        ),
        0.1,
    )
    why = "the finished sequence left no KV cache"
    assert out == [
        Deliver(Error(ErrorCode.ENGINE_FAILED, why, "a", 11)),
        Deliver(CacheKept(RunResult("b", 0, (41,), "length", 11), packed, ())),
    ]


def test_prefill_and_resumed_sequences_are_cancelled_by_their_owner() -> None:
    c, a, b = core(), entry("a"), entry("b", (40,))
    c.handle(PrefillEntry(a), FE, 0.0)
    c.handle(ResumeSequence(b, "the cache", 30, (), ()), FE, 0.0)
    assert c.handle(ReleaseSequence("a"), FE, 0.0) == []
    assert c.handle(CancelRequest("b", "client"), FE, 0.0) == []
    assert c.active == 0


def test_a_sequence_moved_then_cancelled_leaves_by_its_new_row() -> None:
    c = core()
    started(c, entry("a"), entry("b"))
    c.compute_done(1, step({"a": -1, "b": -2}), 0.1)
    c.handle(CancelRequest("b", "client"), FE, 0.2)  # b's new row comes back: it goes
    out = c.compute_done(2, step(moved={"a": 4, "b": 5}), 0.3)
    assert out == [StartCompute(EngineJob(3, (), (-2, 5), {4: "a"}, {}))]
    c.handle(CancelRequest("a", "client"), FE, 0.4)
    assert c.compute_done(3, step(), 0.5) == [StartCompute(EngineJob(4, (), (4,), {}, {}))]


def test_every_job_is_timed_from_its_start() -> None:
    c = core(step_timeout=10.0)
    started(c, entry("a"), now=1.0)
    c.compute_done(1, step({"a": 1}), 3.0)  # the next job starts at once
    assert c.next_timer() == 13.0
    c.compute_failed(2, "boom", 4.0)  # so does the reset
    assert c.next_timer() == 14.0


def test_an_overrun_ends_an_unrecoverable_engine_and_an_overrunning_reset_ends_any() -> None:
    c = core(recoverable=False, step_timeout=10.0)
    started(c, entry("a"))
    why = "engine step took longer than 10s"
    assert c.on_timer(10.0) == [
        Warn("warning", f"{why}; the engine stops"),
        Deliver(Error(ErrorCode.ENGINE_FAILED, why, "a", 11)),
        Stopped(),
    ]
    assert c.next_timer() is None and c.failure == why
    c = core(step_timeout=10.0)
    started(c, entry("a"))
    c.compute_failed(1, "boom", 1.0)  # a reset starts at 1.0
    assert c.on_timer(11.0) == [Warn("warning", f"{why}; the engine stops"), Stopped()]
    assert c.next_timer() is None


def test_a_stopped_engine_still_names_a_bad_entry_as_bad() -> None:
    c = core()
    c.abort("gone")
    e = entry("x", ())
    assert c.handle(e, FE, 0.0) == [Deliver(Error(ErrorCode.BAD_REQUEST, "empty prompt", "x", 11))]
