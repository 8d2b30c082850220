"""One request's sampling can never break the engine for the others, now or later."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel.base.errors import EngineError
from mlxcel.base.messages import SamplingParams
from mlxcel.runtime import sampling
from mlxcel.serving.assembly import Generation, LocalSpec, assemble
from mlxcel.serving.stack import Stack
from tests.runtime.test_engine import collect

VOCAB = 512  # the tiny checkpoint's


async def test_top_k_at_or_above_the_vocabulary_keeps_every_token(tiny: Path) -> None:
    """``top_k`` of 600 on a 512-token vocabulary once failed the step and every later draw."""
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=4, parallel=4)) as stack:
        greedy = SamplingParams(max_tokens=12)
        want = await collect(stack, "a greedy neighbour", greedy)
        big_k = SamplingParams(temperature=0.8, top_k=600, max_tokens=6)
        results = await asyncio.gather(
            collect(stack, "x", big_k),
            collect(stack, "a greedy neighbour", greedy),
            collect(stack, "x", SamplingParams(temperature=0.8, top_k=VOCAB, max_tokens=6)),
        )
        assert len(results[0][0]) >= 1 and results[1] == want and len(results[2][0]) >= 1
        # An unseeded sampled request afterwards still works (it failed until restart once).
        toks, _, finish = await collect(stack, "x", SamplingParams(temperature=1.0, max_tokens=5))
        assert finish in ("length", "stop") and stack.parts.engine.active == 0


async def test_a_failing_sampler_ends_its_own_sequence_only(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = sampling.make_sampler

    def poisoned(p: SamplingParams):  # type: ignore[no-untyped-def]
        if p.seed == 13:

            def boom(logprobs):  # type: ignore[no-untyped-def]
                raise ValueError("poisoned sampler")

            return boom
        return real(p)

    monkeypatch.setattr(sampling, "make_sampler", poisoned)
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=4, parallel=4)) as stack:
        greedy = SamplingParams(max_tokens=16)
        seeded = SamplingParams(temperature=0.7, seed=5, max_tokens=16)
        want_greedy = await collect(stack, "neighbour one", greedy)
        want_seeded = await collect(stack, "neighbour two", seeded)
        bad = SamplingParams(temperature=0.7, seed=13, max_tokens=16)
        results = await asyncio.gather(
            collect(stack, "neighbour one", greedy),
            collect(stack, "poison", bad),
            collect(stack, "neighbour two", seeded),
            return_exceptions=True,
        )
        assert results[0] == want_greedy and results[2] == want_seeded
        assert isinstance(results[1], EngineError) and results[1].code == "sampling_failed"
        assert "poisoned sampler" in str(results[1])
        assert stack.parts.engine.sequence_failures == 1
        assert stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0
        assert await collect(stack, "neighbour one", greedy) == want_greedy


async def test_out_of_range_extended_sampling_is_refused_alone(tiny: Path) -> None:
    """What the API validates, the engine checks again: a cluster peer can send anything, and
    an out-of-vocabulary bias index would not even raise inside mlx-lm's batched step."""
    from mlxcel.base.errors import RequestError

    async with assemble(LocalSpec(tiny), Generation(max_batch_size=4, parallel=4)) as stack:
        greedy = SamplingParams(max_tokens=10)
        want = await collect(stack, "a greedy neighbour", greedy)
        bad = [
            SamplingParams(max_tokens=4, logit_bias_ids=(VOCAB,), logit_bias_values=(5.0,)),
            SamplingParams(max_tokens=4, logit_bias_ids=(1, 2), logit_bias_values=(5.0,)),
            SamplingParams(max_tokens=4, logit_bias_ids=(1,), logit_bias_values=(1e9,)),
            SamplingParams(max_tokens=4, logprobs=True, top_logprobs=10_000),
            SamplingParams(max_tokens=4, repetition_penalty=-1.0),
            SamplingParams(max_tokens=4, temperature=1.0, min_p=7.0),
        ]
        results = await asyncio.gather(
            *(collect(stack, "bad", p) for p in bad),
            collect(stack, "a greedy neighbour", greedy),
            return_exceptions=True,
        )
        assert all(isinstance(r, RequestError) for r in results[:-1]), results
        assert results[-1] == want
        assert stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_p=st.sampled_from([1.0, 0.9, 0.05, 1e-6]),
    top_k=st.integers(0, 2 * VOCAB),
    seed=st.none() | st.integers(0, 2**63 - 1),
    max_tokens=st.integers(1, 6),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 20),
    min_p=st.sampled_from([0.0, 0.05, 1.0]),
    logit_bias_ids=st.sampled_from([(), (3,), (0, VOCAB - 1)]),
    presence_penalty=st.sampled_from([0.0, -2.0, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 1.5]),
    repetition_penalty=st.sampled_from([1.0, 0.5, 10.0]),
).map(
    lambda p: SamplingParams(
        **{
            **{f: getattr(p, f) for f in p.__dataclass_fields__},
            "logit_bias_values": tuple(
                100.0 if i % 2 else -100.0 for i in range(len(p.logit_bias_ids))
            ),
        }
    )
)


async def _scenario(stack: Stack, plan: list[tuple[SamplingParams, int | None]]) -> None:
    async def one(p: SamplingParams, cancel_after: int | None) -> None:
        fe = stack.frontend
        n = 0
        async with aclosing(fe.stream(fe.encode_prompt("prop"), p)) as it:
            async for _ in it:
                n += 1
                if cancel_after is not None and n >= cancel_after:
                    break  # the client goes away mid-stream

    await asyncio.gather(*(one(p, c) for p, c in plan))


def test_random_sampling_and_cancellations_never_break_a_later_request(tiny: Path) -> None:
    runner = asyncio.Runner()
    cm = assemble(LocalSpec(tiny), Generation(max_batch_size=4, parallel=4))
    stack = runner.run(cm.__aenter__())
    try:
        greedy = SamplingParams(max_tokens=10)
        want = runner.run(collect(stack, "after the storm", greedy))

        @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(st.lists(st.tuples(params_strategy, st.none() | st.integers(1, 3)), max_size=5))
        def check(plan: list[tuple[SamplingParams, int | None]]) -> None:
            runner.run(_scenario(stack, plan))
            assert runner.run(collect(stack, "after the storm", greedy)) == want
            sampled = SamplingParams(temperature=1.0, top_k=3, max_tokens=3)
            assert runner.run(collect(stack, "still sampling", sampled))[2] in ("length", "stop")

        check()
        runner.run(asyncio.sleep(0.1))
        assert stack.parts.engine.active == 0
    finally:
        runner.run(cm.__aexit__(None, None, None))
        runner.close()
