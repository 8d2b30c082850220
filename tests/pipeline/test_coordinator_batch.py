"""A micro-batch's decode step on the coordinator, pinned word for word: one StepEntry out,
one StepResult back, each row answering its own exchange.

A StepResult malformed as a whole, or not from the final stage, is dropped whole; a row that
answers no waiting exchange is dropped on its own (counted by a fixed reason) while the other
rows count; a StepEntry that cannot be delivered fails every row's request.
"""

from __future__ import annotations

from collections import Counter

from mlxcel.base.effects import Deliver, Effect, Send, Warn
from mlxcel.base.messages import (
    Ack,
    ErrorCode,
    RunEntry,
    RunResult,
    SamplingParams,
    StepEntry,
    StepResult,
    Tensor,
)
from mlxcel.pipeline.coordinator_core import CoordinatorCore
from mlxcel.reactor.bus import LOCAL

S0, S1 = "10.0.1.1:7100", "10.0.1.3:7100"
EOS = 15
SP = SamplingParams(max_tokens=3)


def core(**kw: object) -> CoordinatorCore:
    opts: dict[str, object] = dict(eos={EOS}, vocab=16, max_len=64, step_timeout=2.0)
    opts.update(kw)
    return CoordinatorCore([S0, S1], **opts)  # type: ignore[arg-type]


def admit(c: CoordinatorCore, *rids: str, sp: SamplingParams = SP) -> StepEntry:
    """Admit one-token prompts ``rids`` into one micro-batch; the StepEntry of their first
    decode step."""
    out: list[Effect] = []
    for i, rid in enumerate(rids):
        out = c.handle(RunEntry(rid, 0, (i + 1,), 0, sp, 70 + i), LOCAL, 0.0)
        for send in [e for e in out if isinstance(e, Send)]:
            out = c.handle(Ack(rid, send.msg.nonce), send.dest, 0.1)  # type: ignore[union-attr]
    (send,) = [e for e in out if isinstance(e, Send)]
    assert isinstance(send.msg, StepEntry) and send.dest == S0
    return send.msg


def drop(why: str, kind: str = "StepResult", source: str = S1) -> Warn:
    return Warn("coordinator-drop", f"coordinator: dropping {kind} from {source}: {why}")


def together(c: CoordinatorCore, *rids: str) -> StepEntry:
    """Admit one-token prompts ``rids`` into one micro-batch: the first one's step goes out
    alone, the others park behind it, and its result sends every row's next step as one
    StepEntry (returned). Its token is 9 for every row."""
    first = admit(c, rids[0])
    out: list[Effect] = []
    for i, rid in enumerate(rids[1:], 1):
        out = c.handle(RunEntry(rid, 0, (i % 14 + 1,), 0, SP, 70 + i), LOCAL, 0.0)
        for send in [e for e in out if isinstance(e, Send)]:
            out = c.handle(Ack(rid, send.msg.nonce), send.dest, 0.1)  # type: ignore[union-attr]
        assert out == []  # parked: the micro-batch has a step in the stages
    out = c.handle(StepResult(0, rids[:1], first.nonces, (9,), (0.0,)), S1, 0.2)
    sends = [e.msg for e in out if isinstance(e, Send)]
    assert all(isinstance(m, StepEntry) for m in sends)
    # At most MAX_STEP_ROWS rows per message: a larger micro-batch goes as several.
    assert [len(m.request_ids) for m in sends[:-1]] == [256] * (len(sends) - 1)  # type: ignore[union-attr]
    assert sum(len(m.request_ids) for m in sends) == len(rids)  # type: ignore[union-attr]
    return sends[-1]  # type: ignore[return-value]


def test_one_step_entry_per_micro_batch_and_one_step_result_back() -> None:
    c = core(max_in_flight=2, micro_batch_size=2)
    step = together(c, "a", "b")
    # Both rows in one message, in the order they became ready, a nonce each.
    assert step == StepEntry(0, ("b", "a"), (2, 9), (0, 1), (6, 7))
    got = StepResult(0, ("a", "b"), (7, 6), (4, 3), (-0.1, -0.2), 2_000)
    # The next step leaves first; then the tokens go to the frontend, in row order.
    assert c.handle(got, S1, 0.5) == [
        Send(S0, StepEntry(0, ("a", "b"), (4, 3), (2, 1), (8, 9)), deadline=2.5),
        Deliver(RunResult("a", 0, (4,), None, 70)),
        Deliver(RunResult("b", 0, (3,), None, 71)),
    ]
    assert (c.decode_steps, c.decode_compute_s) == (3, 0.004)


def test_logprobs_and_alternatives_go_to_the_requests_that_asked() -> None:
    c = core()
    asked = SamplingParams(max_tokens=3, logprobs=True, top_logprobs=2)
    step = admit(c, "a", sp=asked)
    got = StepResult(0, ("a",), step.nonces, (3,), (-0.5,), 0, ((3, 4),), ((-0.5, -1.5),))
    (_, token) = c.handle(got, S1, 0.5)
    assert token == Deliver(
        RunResult("a", 0, (3,), None, 70, (-0.5,), top_ids=(3, 4), top_logprobs=(-0.5, -1.5))
    )


def test_rows_that_answer_nothing_are_dropped_one_by_one_and_the_rest_count() -> None:
    c = core(max_in_flight=3, micro_batch_size=3)
    step = together(c, "a", "b", "c")
    assert step.request_ids == ("b", "c", "a")
    b, cc, a = step.nonces
    got = StepResult(0, ("a", "x", "c"), (a, b, cc + 100), (3, 4, 5), (0.0, 0.0, 0.0))
    out = c.handle(got, S1, 0.5)
    assert out == [
        drop("request or micro-batch does not match the exchange"),
        drop("stale or unknown nonce"),
        Deliver(RunResult("a", 0, (3,), None, 70)),
    ]
    assert c.dropped == Counter(
        {"request or micro-batch does not match the exchange": 1, "stale or unknown nonce": 1}
    )
    # The others still wait for their own answers; the right one completes them.
    out = c.handle(StepResult(0, ("b", "c"), (b, cc), (EOS, 6), (0.0, 0.0)), S1, 0.6)
    assert [e for e in out if isinstance(e, Deliver)] == [
        Deliver(RunResult("b", 0, (), "stop", 71)),
        Deliver(RunResult("c", 0, (6,), None, 72)),
    ]


def test_a_step_result_malformed_as_a_whole_or_from_elsewhere_is_dropped_whole() -> None:
    c = core()
    step = admit(c, "a")
    (n,) = step.nonces
    for msg, source, why in [
        (StepResult(0, ("a",), (n,), (3,), (0.0,)), S0, "not from the final stage"),
        (StepResult(0, ("a",), (n,), (3, 4), (0.0,)), S1, "a malformed StepResult"),
        (StepResult(0, ("a",), (n,), (3,), ()), S1, "a malformed StepResult"),
        (StepResult(0, (), (), (), ()), S1, "a malformed StepResult"),
        (StepResult(0, ("a",), (n,), (3,), (0.0,), 0, ((1,), (2,))), S1, "a malformed StepResult"),
        (
            StepResult(1, ("a",), (n,), (3,), (0.0,)),
            S1,
            "request or micro-batch does not match the exchange",
        ),
    ]:
        assert c.handle(msg, source, 0.5) == [drop(why, source=source)]
    assert c.reqs["a"].pending == {n} and c.steps == 0


def test_a_step_result_where_logits_were_asked_for_is_dropped() -> None:
    def pick(logits: Tensor, sp: SamplingParams, state: object) -> tuple[int, object]:
        return 3, state

    c = core(return_logits=True, pick_token=pick)
    step = admit(c, "a")
    got = StepResult(0, ("a",), step.nonces, (3,), (0.0,))
    assert c.handle(got, S1, 0.5) == [drop("a StepResult where logits were asked for")]


def test_a_step_result_row_cannot_answer_a_prompt_chunk() -> None:
    c = core(prefill_step_size=4)
    c.handle(RunEntry("a", 0, (1, 2, 3), 0, SP, 70), LOCAL, 0.0)
    c.handle(Ack("a", 1), S0, 0.1)
    (chunk,) = c.handle(Ack("a", 2), S1, 0.1)
    assert isinstance(chunk, Send) and isinstance(chunk.msg, RunEntry)
    got = StepResult(0, ("a",), (chunk.msg.nonce,), (3,), (0.0,))
    assert c.handle(got, S1, 0.5) == [drop("request or micro-batch does not match the exchange")]


def test_an_undeliverable_step_entry_fails_every_rows_request() -> None:
    c = core(max_in_flight=2, micro_batch_size=2)
    step = together(c, "a", "b")
    failed = c.undeliverable(Send(S0, step), "connection refused", 0.5)
    errors = [e.msg for e in failed if isinstance(e, Deliver)]
    assert [(m.request_id, m.code) for m in errors] == [  # type: ignore[union-attr]
        ("b", ErrorCode.STAGE_UNREACHABLE),
        ("a", ErrorCode.STAGE_UNREACHABLE),
    ]
    assert c.reqs == {} and c.failed == 2


def test_alternatives_that_do_not_pair_up_are_dropped_whole_and_nothing_escapes() -> None:
    c = core(max_in_flight=2, micro_batch_size=2)
    step = together(c, "a", "b")
    malformed = drop("a malformed StepResult")
    for top_ids, top_lps in [
        (((1,), (2,)), ()),  # ids without logprobs
        ((), ((0.0,), (0.0,))),  # logprobs without ids
        (((1, 2), (3,)), ((0.0,), (0.0,))),  # a row's ids and logprobs of different lengths
    ]:
        msg = StepResult(0, step.request_ids, step.nonces, (4, 3), (0.0, 0.0), 0, top_ids, top_lps)
        assert c.handle(msg, S1, 0.5) == [malformed]
    assert set(c.exchanges.by_nonce) == set(step.nonces)  # still waiting for a real answer
    # The per-sequence form is held to the same pairing.
    (n,) = step.nonces[:1]
    odd = RunResult("b", 0, (4,), None, n, top_ids=(1, 2), top_logprobs=(0.0,))
    assert c.handle(odd, S1, 0.5) == [
        drop("top_logprobs alternatives that do not pair up", "RunResult")
    ]


def test_a_micro_batch_larger_than_a_message_goes_as_several_step_entries() -> None:
    from mlxcel.base.messages import MAX_STEP_ROWS

    n = MAX_STEP_ROWS + 44
    c = core(max_in_flight=n, micro_batch_size=n)
    last = together(c, *(f"r{i}" for i in range(n)))  # 256 rows, then this one
    assert len(last.request_ids) == 44 and last.request_ids[-1] == "r0"


def test_an_undecodable_batched_answer_fails_each_row_it_named_at_once() -> None:
    from mlxcel.base.messages import Undecodable

    c = core(max_in_flight=2, micro_batch_size=2)
    step = together(c, "a", "b")
    rows = tuple(zip(step.request_ids, step.nonces, strict=True))
    out = c.handle(Undecodable(36, None, None, "bad token_ids", rows), S1, 0.5)
    errors = [e.msg for e in out if isinstance(e, Deliver)]
    assert [(m.request_id, m.code) for m in errors] == [  # type: ignore[union-attr]
        ("b", ErrorCode.BAD_MESSAGE),
        ("a", ErrorCode.BAD_MESSAGE),
    ]


def test_with_return_logits_the_picked_token_goes_without_a_logprob_even_when_asked() -> None:
    def pick(logits: Tensor, sp: SamplingParams, state: object) -> tuple[int, object]:
        return 3, state

    c = core(return_logits=True, pick_token=pick)
    step = admit(c, "a", sp=SamplingParams(max_tokens=3, logprobs=True))
    logits = Tensor("float32", (1, 1, 16), bytes(64))
    got = RunResult("a", 0, (), None, step.nonces[0], (-1.0,), logits)
    assert c.handle(got, S1, 0.5)[0] == Deliver(RunResult("a", 0, (3,), None, 70))
