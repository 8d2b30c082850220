from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import aclosing
from pathlib import Path

import pytest

from mlxcel.base.deadlines import deadline_in
from mlxcel.base.errors import AdmissionRejected, ConfigError, DeadlineExceeded, RequestError
from mlxcel.base.messages import Error, RunEntry, SamplingParams
from mlxcel.process.loop import run_async
from mlxcel.reactor.bus import Envelope
from mlxcel.serving.assembly import Generation, LocalSpec, assemble
from mlxcel.serving.frontend import Usage
from mlxcel.serving.stack import Stack

PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "Distributed inference splits one model",
    "0123456789",
    "A longer prompt about pipeline stages and activations between hosts",
    "tensor parallel ranks",
    "abc",
    "What is the capital of nowhere?",
]


async def collect(
    stack: Stack,
    prompt: str,
    params: SamplingParams,
    stop: list[str] | None = None,
    usage: Usage | None = None,
) -> tuple[list[int], str, str | None]:
    fe = stack.frontend
    toks: list[int] = []
    text: list[str] = []
    finish = None
    async with aclosing(fe.stream(fe.encode_prompt(prompt), params, stop or [], usage)) as it:
        async for d in it:
            toks.extend(d.token_ids)
            text.append(d.text)
            finish = d.finish_reason
    return toks, "".join(text), finish


async def wait_for(cond: object, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


async def test_batched_greedy_equals_sequential_for_8_concurrent(tiny: Path) -> None:
    params = SamplingParams(max_tokens=24)
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=8, parallel=8)) as stack:
        sequential = [await collect(stack, p, params) for p in PROMPTS]
        steps_before = stack.parts.engine.steps
        concurrent = await asyncio.gather(*(collect(stack, p, params) for p in PROMPTS))
        batched_steps = stack.parts.engine.steps - steps_before
        assert stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0
    assert concurrent == sequential
    assert all(len(t) == 24 and f == "length" for t, _, f in sequential)
    assert len({tuple(t) for t, _, _ in sequential}) > 4  # prompts lead to different outputs
    # 8 x 24 tokens in far fewer than 8 x 24 steps: sequences really shared forward passes.
    assert batched_steps < 24 * 3


async def test_requests_join_and_leave_between_steps(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=4, parallel=8)) as stack:
        long = asyncio.create_task(collect(stack, PROMPTS[0], SamplingParams(max_tokens=200)))
        await wait_for(lambda: stack.parts.engine.tokens_generated >= 5)
        short = await collect(stack, PROMPTS[1], SamplingParams(max_tokens=5))
        assert not long.done(), "a short request joined and left while the long one kept going"
        result = await long
        alone = await collect(stack, PROMPTS[0], SamplingParams(max_tokens=200))
        assert result == alone
        assert short[2] == "length" and len(short[0]) == 5


async def test_seeded_sampling_is_reproducible_inside_a_batch(tiny: Path) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16)
    async with assemble(LocalSpec(tiny)) as stack:
        a, b, c = await asyncio.gather(
            collect(stack, "Hello", p),
            collect(stack, "Hello", p),
            collect(stack, "Hello", SamplingParams(temperature=1.0, seed=8, max_tokens=16)),
        )
    assert a == b and a != c


async def test_stop_string_ends_the_request_and_frees_the_sequence(tiny: Path) -> None:
    params = SamplingParams(max_tokens=40)
    async with assemble(LocalSpec(tiny)) as stack:
        _, full_text, _ = await collect(stack, PROMPTS[2], params)
        stop = full_text[10:13]
        assert stop and stop in full_text
        toks, text, finish = await collect(stack, PROMPTS[2], params, stop=[stop])
        assert finish == "stop"
        assert text == full_text[: full_text.index(stop)]
        await wait_for(
            lambda: stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0
        )


async def test_cancelled_stream_frees_its_cache(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=4)) as stack:
        fe = stack.frontend
        it = fe.stream(fe.encode_prompt("Hello"), SamplingParams(max_tokens=500))
        first = await anext(it)
        assert first.finish_reason is None
        assert stack.parts.engine.active == 1
        await it.aclose()  # what an HTTP disconnect does
        await wait_for(
            lambda: stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0
        )
        assert fe.in_flight == 0
        # And the engine keeps serving.
        toks, _, finish = await collect(stack, "Hello", SamplingParams(max_tokens=3))
        assert len(toks) == 3 and finish == "length"


async def test_deadline_fails_the_request_and_releases_it(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny)) as stack:
        fe = stack.frontend
        with pytest.raises(DeadlineExceeded):
            async with aclosing(
                fe.stream(
                    fe.encode_prompt("Hello"),
                    SamplingParams(max_tokens=4000),
                    deadline=deadline_in(0.3),
                )
            ) as it:
                async for _ in it:
                    pass
        await wait_for(
            lambda: stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0
        )


async def test_admission_queue_full_is_refused_at_once(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(parallel=1, queue_size=1)) as stack:
        fe = stack.frontend
        running = asyncio.create_task(collect(stack, "a", SamplingParams(max_tokens=200)))
        await wait_for(lambda: fe.in_flight == 1)
        waiting = asyncio.create_task(collect(stack, "b", SamplingParams(max_tokens=2)))
        await wait_for(lambda: fe.waiting == 1)
        with pytest.raises(AdmissionRejected, match="queue full"):
            await collect(stack, "c", SamplingParams(max_tokens=2))
        assert len((await running)[0]) == 200
        assert len((await waiting)[0]) == 2


async def test_invalid_run_entry_gets_an_error_and_changes_nothing(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny)) as stack:
        errors: list[Error] = []

        async def on_error(env: Envelope[Error]) -> None:
            errors.append(env.msg)

        stack.node.bus.subscribe(Error, on_error)
        bus = stack.node.bus
        await bus.publish(
            RunEntry("x1", 0, (10**9,), 0, SamplingParams(), 5), deadline=deadline_in(1)
        )
        await bus.publish(RunEntry("x2", 0, (), 0, SamplingParams(), 6), deadline=deadline_in(1))
        await bus.publish(
            RunEntry("x3", 0, (1,), 0, SamplingParams(max_tokens=10**7), 7), deadline=deadline_in(1)
        )
        await wait_for(lambda: len(errors) == 3)
        assert [(e.request_id, e.nonce) for e in errors] == [("x1", 5), ("x2", 6), ("x3", 7)]
        assert "vocabulary" in errors[0].message and "context" in errors[2].message
        assert stack.parts.engine.active == 0
        with pytest.raises(RequestError):
            await collect(stack, "hi", SamplingParams(max_tokens=10**7))
        assert len((await collect(stack, "hi", SamplingParams(max_tokens=2)))[0]) == 2


async def test_the_engine_hears_only_its_own_process(tiny: Path) -> None:
    """An entry or a cancel that arrives from the network (a peer's identity as its source)
    never reaches the engine: only the node's own frontend or service speaks to it."""
    async with assemble(LocalSpec(tiny)) as stack:
        bus, engine = stack.node.bus, stack.parts.engine
        peer = "10.0.0.9:9000"
        assert bus.publish_now(RunEntry("x", 0, (1, 2), 0, SamplingParams(), 5), source=peer)
        assert bus.unrouted["RunEntry"] == 1 and engine.active == 0
        assert engine.steps == 0
        tokens, _, _ = await collect(stack, "hi", SamplingParams(max_tokens=2))
        assert len(tokens) == 2 and engine.steps > 0


async def test_usage_counts_tokens_and_times(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny)) as stack:
        u = Usage()
        toks, _, _ = await collect(stack, "Hello world", SamplingParams(max_tokens=7), usage=u)
        assert u.completion_tokens == len(toks) == 7
        assert u.prompt_tokens == len(stack.frontend.encode_prompt("Hello world"))
        assert u.submitted_at <= u.first_token_at <= u.last_token_at  # type: ignore[operator]


def test_usage_times_are_exact_on_uvloop(tiny: Path) -> None:
    """On uvloop (what ``python -m mlxcel`` runs), a request's times lie inside a window read
    with ``time.perf_counter()`` around it: the loop's own clock moves in whole milliseconds
    and only once per loop iteration, so a TTFT read from it could be off by a millisecond or
    more (about 6 % of a 16 ms second turn)."""

    async def timed() -> tuple[float, Usage, float]:
        async with assemble(LocalSpec(tiny)) as stack:
            await collect(stack, "Hello world", SamplingParams(max_tokens=2))  # warm
            u = Usage()
            t0 = time.perf_counter()
            await collect(stack, "Hello world", SamplingParams(max_tokens=3), usage=u)
            return t0, u, time.perf_counter()

    for _ in range(3):  # the old clock could land inside the window by chance, not thrice
        t0, u, t1 = run_async(timed())
        assert t0 <= u.submitted_at <= u.first_token_at <= u.last_token_at <= t1  # type: ignore[operator]


def _count_handoffs(stack: Stack) -> list[int]:
    """Wrap the engine's compute-thread step; the list grows by one per hand-off."""
    calls: list[int] = []
    inner = stack.parts.engine.runtime.step

    def counted(*a: object) -> object:
        calls.append(1)
        return inner(*a)  # type: ignore[arg-type]

    stack.parts.engine.runtime.step = counted  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("alone", [True, False])
async def test_decode_steps_run_back_to_back_between_hand_offs(tiny: Path, alone: bool) -> None:
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=2, parallel=2)) as stack:
        # Only the step count and the events end a run.
        stack.parts.engine.runtime.run_seconds = 60.0
        stack.parts.engine.runtime.solo_enabled = alone
        calls = _count_handoffs(stack)
        p = SamplingParams(max_tokens=64)
        both = await asyncio.gather(*(collect(stack, PROMPTS[k], p) for k in range(2 - alone)))
        assert all(f == "length" and len(t) == 64 for t, _, f in both)
        # Alone: runs of 16 steps; two in the batch: runs of 16 // 2 = 8 steps. Prefill and
        # each first token end a run of their own; a hand-off per token would be 64 or more.
        per_run = 16 if alone else 8
        assert len(calls) <= 64 // per_run + 6, len(calls)
        stack.parts.engine.runtime.run_steps = 1
        calls.clear()
        again = await asyncio.gather(*(collect(stack, PROMPTS[k], p) for k in range(2 - alone)))
        assert again == both
        assert len(calls) >= 64


async def test_a_request_that_arrives_mid_run_joins_at_once(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=2, parallel=2)) as stack:
        # Runs as long as the step limit allows: only the reactor's interrupt can end one.
        stack.parts.engine.runtime.run_steps = 100_000
        stack.parts.engine.runtime.run_seconds = 600.0
        long_usage = Usage()
        long = asyncio.create_task(
            collect(stack, PROMPTS[0], SamplingParams(max_tokens=3000), usage=long_usage)
        )
        # The first token ends a run; the next one would run to the end of the 3000.
        await wait_for(lambda: long_usage.completion_tokens >= 1)
        short = await collect(stack, PROMPTS[1], SamplingParams(max_tokens=2))
        assert short[2] == "length"
        # The short request joined at once: the long one is far from its end.
        assert not long.done() and long_usage.completion_tokens < 1000
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        # A cancel ends the run too: the engine lets go of the sequence long before the
        # 3000 steps an uninterrupted run would take.
        await wait_for(
            lambda: stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0,
            30.0,
        )
        assert stack.parts.engine.steps < 1500


async def test_a_run_is_one_message_per_sequence_and_a_stop_inside_it_cuts_there(
    tiny: Path,
) -> None:
    """The engine sends a run's tokens for a sequence as one result (fewer hops per token);
    a stop string completed by a token inside such a result must still end the stream at
    that token, with a logprob for each token delivered and none for the rest."""
    params = SamplingParams(max_tokens=48, logprobs=True)
    async with assemble(LocalSpec(tiny)) as stack:
        stack.parts.engine.runtime.run_seconds = 60.0  # only the step count ends a run: runs of 16
        fe = stack.frontend
        tok = fe.tokenizer
        ids = fe.encode_prompt(PROMPTS[2])
        deltas = [d async for d in fe.stream(ids, params)]
        sizes = [len(d.token_ids) for d in deltas]
        assert max(sizes) > 1 and len(deltas) <= 48 // 16 + 3, sizes
        full = [t for d in deltas for t in d.token_ids]
        ends = set(itertools.accumulate(sizes))  # token counts at which a message ended
        # The text the stream shows after each token (the detokenizer holds back partial
        # words), as one message per token would have shown it.
        detok = tok.detokenizer
        detok.reset()
        shown = [""]
        for t in full:
            detok.add_token(t)
            shown.append(shown[-1] + detok.last_segment)
        text = "".join(d.text for d in deltas)
        # A stop string whose first complete appearance needs a token inside a message.
        for at in range(4, len(text) - 3):
            stop = text[at : at + 3]
            k = next(n for n, seen in enumerate(shown) if stop in seen)
            if k not in ends and text.index(stop) == at:
                break
        else:
            pytest.fail(f"no stop string ends inside a message: {sizes}")
        cut = [d async for d in fe.stream(ids, params, stop=[stop])]
        got = [t for d in cut for t in d.token_ids]
        assert cut[-1].finish_reason == "stop" and got == full[:k]
        assert sum(len(d.logprobs or ()) for d in cut) == k
        assert "".join(d.text for d in cut) == text[:at]
        await wait_for(
            lambda: stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0
        )


async def test_a_stream_interval_of_one_hands_every_token_over_as_it_is_sampled(tiny: Path) -> None:
    """serve --stream-interval 1: no bursts, each token leaves the compute thread alone."""
    async with assemble(LocalSpec(tiny), Generation(stream_interval=1)) as stack:
        assert stack.parts.engine.runtime.run_steps == 1
        stack.parts.engine.runtime.run_seconds = 60.0  # only the step count ends a run
        calls = _count_handoffs(stack)
        tokens, _, finish = await collect(stack, PROMPTS[0], SamplingParams(max_tokens=32))
        assert finish == "length" and len(tokens) == 32
        assert len(calls) >= 32
    with pytest.raises(ConfigError, match="Generation.stream_interval: 0 is below 1"):
        Generation(stream_interval=0)
