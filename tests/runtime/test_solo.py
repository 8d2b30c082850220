"""A sequence that starts on an idle engine decodes alone (runtime/solo.py) and joins the
batch when another arrives: the tokens (greedy or seeded sampling) and logprobs are those it
would have had in the batch from the start."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mlx_lm.models.cache import make_prompt_cache

from mlxcel.base.messages import SamplingParams
from mlxcel.runtime.model import load_model
from mlxcel.runtime.sampling import make_sampler
from mlxcel.runtime.solo import Solo
from mlxcel.serving.assembly import Generation, LocalSpec, assemble
from mlxcel.serving.frontend import Usage
from mlxcel.serving.stack import Stack
from tests.runtime.test_engine import PROMPTS, collect, wait_for

# Long enough that the second request arrives while the first still decodes.
GREEDY = SamplingParams(max_tokens=300)
SEEDED = SamplingParams(max_tokens=300, temperature=0.9, top_p=0.95, seed=7, logprobs=True)


def _record(stack: Stack, name: str) -> list[str]:
    """Wrap the engine runtime's ``name`` (a compute-thread method whose first argument is a solo or
    an insert); the list gets the request id of each call."""
    seen: list[str] = []
    inner = getattr(stack.parts.engine.runtime, name)

    def recorded(first: object, *a: object) -> object:
        rid = getattr(first, "request_id", None) or first.entry.request_id  # type: ignore[attr-defined]
        seen.append(rid)
        return inner(first, *a)

    setattr(stack.parts.engine.runtime, name, recorded)
    return seen


async def lone_and_joined(stack: Stack, params: SamplingParams) -> tuple:
    alone = await collect(stack, PROMPTS[4], params)
    # The same request again, with a second one arriving while it decodes alone.
    handed = _record(stack, "_hand_over")
    usage = Usage()
    first = asyncio.create_task(collect(stack, PROMPTS[4], params, usage=usage))
    await wait_for(lambda: usage.completion_tokens >= 1)
    other = await collect(stack, PROMPTS[2], SamplingParams(max_tokens=5))
    assert not first.done(), "the first request was still decoding when the other joined"
    joined = await first
    assert other[2] == "length" and len(handed) == 1
    return alone, joined


async def test_a_lone_request_decodes_alone_and_keeps_its_tokens_when_another_joins(
    tiny: Path,
) -> None:
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=4, parallel=4)) as stack:
        # Short runs: the second request lands mid-sequence.
        stack.parts.engine.runtime.run_steps = 2
        for params in (GREEDY, SEEDED):
            alone, joined = await lone_and_joined(stack, params)
            assert joined == alone
        assert stack.parts.engine.active == 0 and stack.parts.engine.batch_cache_rows() == 0
        # The batch generator from the start: the same tokens again.
        stack.parts.engine.runtime.solo_enabled = False
        batched = await collect(stack, PROMPTS[4], SEEDED)
        assert batched == alone


async def test_logprobs_alone_equal_logprobs_in_the_batch(tiny: Path) -> None:
    params = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=3)

    async def logprobs(stack: Stack) -> list:
        fe, out = stack.frontend, []
        async for d in fe.stream(fe.encode_prompt(PROMPTS[0]), params):
            assert d.logprobs is not None and d.top is not None
            assert len(d.token_ids) == len(d.logprobs) == len(d.top)  # one each per token
            out.extend(zip(d.token_ids, d.logprobs, d.top, strict=True))
        return out

    async with assemble(LocalSpec(tiny)) as stack:
        alone = await logprobs(stack)
        stack.parts.engine.runtime.solo_enabled = False
        batched = await logprobs(stack)
    assert len(alone) == len(batched) == 8
    for (ta, la, pa), (tb, lb, pb) in zip(alone, batched, strict=True):
        # Exactly equal: alone, the prompt is fed in the batch generator's order (all but
        # the last token in chunks, then the last alone), so a CPU BLAS rounds alike.
        assert (ta, la, pa) == (tb, lb, pb)


async def test_penalties_and_busy_engines_use_the_batch(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(max_batch_size=4, parallel=4)) as stack:
        alone = _record(stack, "_start_solo")
        await collect(stack, PROMPTS[3], SamplingParams(max_tokens=2))
        assert len(alone) == 1  # the control: a plain request on an idle engine
        penalised = asyncio.create_task(
            collect(stack, PROMPTS[0], SamplingParams(max_tokens=300, repetition_penalty=1.3))
        )
        await wait_for(lambda: stack.parts.engine.tokens_generated >= 4)
        # mlx-lm's processors need the sequence's tokens: the batch generator keeps them
        assert not stack.parts.engine.decoding_alone and stack.parts.engine.batch_cache_rows() == 1
        plain = await collect(stack, PROMPTS[1], SamplingParams(max_tokens=3))
        assert plain[2] == "length" and not penalised.done()
        assert len(alone) == 1  # neither went alone: one had penalties, one found it busy
        penalised.cancel()
        await asyncio.gather(penalised, return_exceptions=True)
        await wait_for(lambda: stack.parts.engine.batch_cache_rows() == 0)


def _decode(s: Solo, n: int) -> list[int]:
    """Step ``s`` until it has returned ``n`` tokens (prefill chunks return none)."""
    got: list[int] = []
    while len(got) < n:
        t = s.step()
        if t is not None:
            got.append(t.token)
    return got


def test_a_hand_over_continues_the_sequence_exactly(tiny: Path) -> None:
    """Solo on its own: whatever state it is handed over in (mid-prompt, mid-decode, on its
    last token), the hand-over carries the cache and the token already sampled."""
    loaded = load_model(tiny)
    prompt = loaded.tokenizer.encode(PROMPTS[4])
    assert len(prompt) > 5  # more than one prefill chunk of 4

    def solo(max_tokens: int) -> Solo:
        sampler = make_sampler(SamplingParams(temperature=0.8, seed=3))
        cache = make_prompt_cache(loaded.model)
        return Solo(loaded.model, "r", -1, prompt, cache, [], sampler, max_tokens, set(), 4)

    whole = _decode(solo(6), 6)
    # Mid-prompt: nothing sampled yet, the rest of the prompt goes to the batch generator.
    s = solo(6)
    assert s.step() is None
    tok, rest = s.hand_over()
    assert tok is None and rest is not None
    assert rest.fed + rest.prompt == prompt and rest.max_tokens == 6
    assert rest.cache[0].offset == len(rest.fed) == 4
    # Right after the first token, which no step has fed yet: the batch generator feeds it.
    s = solo(6)
    got = _decode(s, 1)
    tok, rest = s.hand_over()
    assert tok is None and rest is not None
    assert got == whole[:1] and rest.prompt == got and rest.max_tokens == 5
    assert rest.fed == prompt and rest.cache[0].offset == len(prompt)
    # Mid-decode: the sampled token comes out with the hand-over; the cache holds the rest.
    s = solo(6)
    got = _decode(s, 2)
    tok, rest = s.hand_over()
    assert tok is not None and rest is not None and tok.finish is None
    assert got + [tok.token] == whole[:3]
    assert rest.prompt == [tok.token] and rest.max_tokens == 3
    assert rest.fed == prompt + got and rest.cache[0].offset == len(rest.fed)
    # On its last token: nothing is left to hand over.
    s = solo(3)
    got = _decode(s, 2)
    tok, rest = s.hand_over()
    assert rest is None and tok is not None and tok.finish == "length"
    assert got + [tok.token] == whole[:3]


def test_the_first_token_is_read_before_the_next_step_is_queued(tiny: Path) -> None:
    """On a GPU, queueing a step is milliseconds of host time (its graph, its kernel
    launches): the first token is returned with nothing queued behind it, and the next step
    feeds it. The cache's offset moves as a forward is built, so it shows what is queued."""
    loaded = load_model(tiny)
    prompt = loaded.tokenizer.encode(PROMPTS[4])
    s = Solo(
        loaded.model, "r", -1, prompt, make_prompt_cache(loaded.model), [], None, 4, set(), 512
    )
    assert s.step() is None  # all prompt tokens but the last, in one chunk
    first = s.step()
    assert first is not None and first.first
    assert s.cache[0].offset == len(prompt)  # no forward built behind the first token
    second = s.step()
    assert second is not None and not second.first
    assert s.cache[0].offset == len(prompt) + 2  # the first token fed, the next one queued
    assert s.fed == prompt + [first.token, second.token]
