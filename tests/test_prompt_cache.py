"""The prompt cache: a later prompt that starts with an earlier request's tokens prefills only
what is new, gives the same tokens as without the cache, and the cache stays in its bytes."""

from __future__ import annotations

import asyncio
import random
from contextlib import aclosing
from pathlib import Path

import openai
import pytest

from mlxcel.frontend import Usage
from mlxcel.messages import SamplingParams
from mlxcel.server.run import LocalStack, local_stack
from tests.conftest import ServerProcess, error_line, until_true
from tests.test_cli import run_cli

GREEDY = SamplingParams(max_tokens=12)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(n)]


async def turn(stack: LocalStack, ids: list[int], params: SamplingParams = GREEDY) -> tuple:
    usage = Usage()
    out: list[int] = []
    async with aclosing(stack.frontend.stream(ids, params, [], usage)) as it:
        async for d in it:
            out.extend(d.token_ids)
    return out, usage.cached_tokens


async def chat(stack: LocalStack, seed: int) -> list[tuple[list[int], int]]:
    """Three turns, each resending the whole history plus new user tokens."""
    history = prompt(150, seed)
    turns = []
    for k in range(3):
        reply, cached = await turn(stack, history)
        turns.append((reply, cached))
        history = history + reply + prompt(20, seed * 10 + k)
    return turns


async def test_later_turns_reuse_the_history_and_generate_the_same_tokens(tiny: Path) -> None:
    async with local_stack(tiny, prompt_cache_bytes=0) as plain:
        assert plain.engine.prompt_cache is None
        without = await chat(plain, 1)
    async with local_stack(tiny, prompt_cache_bytes=64 << 20) as cached:
        with_cache = await chat(cached, 1)
        stats = cached.engine.prompt_cache.stats()  # type: ignore[union-attr]
        assert cached.engine.active == 0 and cached.engine.batch_cache_rows() == 0
    assert [r for r, _ in with_cache] == [r for r, _ in without]
    assert [c for _, c in without] == [0, 0, 0]
    # Turn k+1 reuses everything turn k saw and generated: its prompt and its reply.
    assert with_cache[0][1] == 0
    assert with_cache[1][1] == 150 + 12
    assert with_cache[2][1] == 150 + 12 + 20 + 12
    assert stats["hits"] == 2 and stats["misses"] == 1
    assert stats["reused_tokens"] == with_cache[1][1] + with_cache[2][1]
    # A trimmable cache keeps only the longest sequence of a conversation: one entry.
    assert stats["entries"] == 1 and 0 < stats["bytes"] <= 64 << 20


async def test_a_repeated_prompt_still_prefills_its_last_token(tiny: Path) -> None:
    ids = prompt(80, 2)
    async with local_stack(tiny, prompt_cache_bytes=64 << 20) as stack:
        first = await turn(stack, ids)
        again = await turn(stack, ids)
        shorter = await turn(stack, ids[:40])
    assert first == (first[0], 0)
    # The cached entry is prompt + reply; its first 79 tokens serve, the last is prefilled.
    assert again == (first[0], 79)
    assert shorter[1] == 39
    async with local_stack(tiny, prompt_cache_bytes=0) as plain:
        assert await turn(plain, ids[:40]) == (shorter[0], 0)


async def test_the_cache_stays_within_its_bytes_evicting_the_least_recent(tiny: Path) -> None:
    async with local_stack(tiny, prompt_cache_bytes=64 << 20) as probe:
        await turn(probe, prompt(150, 3))
        one = probe.engine.prompt_cache.nbytes  # type: ignore[union-attr]
    assert one > 0
    # Room for one conversation's cache, not two.
    async with local_stack(tiny, prompt_cache_bytes=one + one // 2) as stack:
        pc = stack.engine.prompt_cache
        assert pc is not None
        a, b = prompt(150, 3), prompt(150, 4)
        reply_a, _ = await turn(stack, a)
        await turn(stack, b)
        assert pc.entries == 1 and pc.nbytes <= pc.max_bytes
        _, cached_b = await turn(stack, b + [5, 6, 7])
        _, cached_a = await turn(stack, a + reply_a + [5, 6, 7])
    # b's entry (b + its reply) is cut back to the 150 tokens b + [5, 6, 7] shares with it;
    # a was evicted for b: a's prompt finds only the few first tokens it shares with b.
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    assert cached_a == shared < 10 and cached_b == 150


async def test_an_entry_larger_than_the_whole_cache_is_not_kept(tiny: Path) -> None:
    async with local_stack(tiny, prompt_cache_bytes=1024) as stack:
        pc = stack.engine.prompt_cache
        assert pc is not None
        await turn(stack, prompt(150, 5))
        assert (pc.entries, pc.nbytes, pc.too_large) == (0, 0, 1)


async def test_a_cancelled_request_keeps_what_it_computed(tiny: Path) -> None:
    """The frontend cancels a request that hit a stop string, or whose client left: what it
    computed still serves the next prompt, alone or in the batch."""
    for solo in (True, False):
        async with local_stack(tiny, prompt_cache_bytes=64 << 20) as stack:
            stack.engine.solo = solo
            ids = prompt(100, 6)
            params = SamplingParams(max_tokens=200)
            async with aclosing(stack.frontend.stream(ids, params, [])) as it:
                async for _ in it:
                    break  # the client went away after one token
            await until_true(lambda: stack.engine.batch_cache_rows() == 0)
            pc = stack.engine.prompt_cache
            assert pc is not None and pc.entries == 1
            _, cached = await turn(stack, ids + [1, 2, 3])
            assert cached == 100, solo


async def test_a_one_token_prompt_is_a_miss_not_a_hit(tiny: Path) -> None:
    async with local_stack(tiny, prompt_cache_bytes=64 << 20) as stack:
        pc = stack.engine.prompt_cache
        assert pc is not None
        await turn(stack, [77])
        assert (await turn(stack, [77]))[1] == 0
        assert (pc.hits, pc.misses, pc.reused_tokens) == (0, 2, 0)


async def test_cached_entries_hold_exactly_their_bytes(tiny: Path) -> None:
    """An entry taken out of the batch must not keep the batch's buffer alive, nor a lone
    sequence's 256-token growth steps: the bound counts what is really held."""
    async with local_stack(tiny, max_batch_size=8, parallel=8, prompt_cache_bytes=64 << 20) as st:
        await turn(st, prompt(20, 1))  # alone
        await asyncio.gather(*(turn(st, prompt(300 + 50 * k, 10 + k)) for k in range(4)))
        pc = st.engine.prompt_cache
        assert pc is not None and pc.entries == 5

        def held() -> int:
            entries = [e.prompt_cache for e in _entries(pc)]
            arrays = [a for cache in entries for c in cache for a in (c.keys, c.values)]
            assert all(
                a.shape[2] == c.offset for cache in entries for c in cache for a in (c.keys,)
            )
            return sum(a.nbytes for a in arrays)

        assert held() == pc.nbytes


def _entries(pc: object) -> list:
    lru = pc._lru  # type: ignore[attr-defined]
    return [lru._trie.get(m, t) for m, t in _pairs(lru)]


def _pairs(lru: object) -> list:
    return [p for q in lru._lru._lrus.values() for p in q]  # type: ignore[attr-defined]


def test_the_server_reports_cached_tokens_and_counts_hits(
    tiny: Path, start_server: type[ServerProcess]
) -> None:
    import urllib.request

    srv = start_server(["-m", str(tiny), "--prompt-cache-bytes", "32MiB"])
    assert "prompt cache: 32.0MiB" in srv.output
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    history = [{"role": "user", "content": "Tell me about pipeline stages and activations."}]
    first = client.chat.completions.create(model="tiny-qwen3", messages=history, max_tokens=8)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And tensor parallelism?"},
    ]
    second = client.chat.completions.create(model="tiny-qwen3", messages=history, max_tokens=8)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # At least the first turn's prompt came from the cache, and never the whole second one.
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "mlxcel_prompt_cache_hits_total 1.0" in metrics
    assert "mlxcel_prompt_cache_misses_total 1.0" in metrics
    assert f"mlxcel_prompt_cache_reused_tokens_total {float(cached)}" in metrics


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prompt-cache-bytes", "lots"], "could not parse"),
        (["--prompt-cache-bytes", "-1"], "could not parse"),
        (["--prompt-cache-bytes", "1.5XB"], "byte unit: XB"),
        (["--prompt-cache-bytes", "1.5"], "at least 1MiB"),
        (["--prompt-cache-bytes", "1GiB", "--pp-size", "2"], "one-process serving"),
        (["--prompt-cache-bytes", "0", "--tp-size", "2"], "one-process serving"),
        (
            [
                "--prompt-cache-bytes",
                "1GiB",
                "--node-role",
                "decode",
                "--serving-bind",
                "127.0.0.5:1",
            ],
            "one-process serving",
        ),
    ],
)
def test_a_bad_cache_size_or_mode_is_refused_naming_the_flag(
    tiny: Path, argv: list[str], needle: str
) -> None:
    r = run_cli("serve", "-m", str(tiny), *argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = error_line(r.stderr)
    assert "--prompt-cache-bytes" in line and needle in line
