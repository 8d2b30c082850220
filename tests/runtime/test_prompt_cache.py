"""The prompt cache: a later prompt that starts with an earlier request's tokens prefills only
what is new, gives the same tokens as without the cache, and the cache stays in its bytes."""

from __future__ import annotations

import random
from contextlib import aclosing
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx_lm.models.cache import KVCache

from mlxcel.base.messages import SamplingParams
from mlxcel.runtime.prompt_cache import PromptCache
from mlxcel.serving.assembly import Generation, LocalSpec, assemble
from mlxcel.serving.frontend import Usage
from mlxcel.serving.stack import Stack
from tests.cli.test_cli import run_cli
from tests.conftest import ServerProcess, error_line, until_true

GREEDY = SamplingParams(max_tokens=12)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(n)]


async def turn(stack: Stack, ids: list[int], params: SamplingParams = GREEDY) -> tuple:
    usage = Usage()
    out: list[int] = []
    async with aclosing(stack.frontend.stream(ids, params, [], usage)) as it:
        async for d in it:
            out.extend(d.token_ids)
    return out, usage.cached_tokens


async def chat(stack: Stack, seed: int) -> list[tuple[list[int], int]]:
    """Three turns, each resending the whole history plus new user tokens."""
    history = prompt(150, seed)
    turns = []
    for k in range(3):
        reply, cached = await turn(stack, history)
        turns.append((reply, cached))
        history = history + reply + prompt(20, seed * 10 + k)
    return turns


async def test_later_turns_reuse_the_history_and_generate_the_same_tokens(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=0)) as plain:
        assert plain.parts.engine.runtime.prompt_cache is None
        without = await chat(plain, 1)
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=64 << 20)) as cached:
        with_cache = await chat(cached, 1)
        stats = cached.parts.engine.runtime.prompt_cache.stats()  # type: ignore[union-attr]
        assert cached.parts.engine.active == 0 and cached.parts.engine.batch_cache_rows() == 0
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
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=64 << 20)) as stack:
        first = await turn(stack, ids)
        again = await turn(stack, ids)
        shorter = await turn(stack, ids[:40])
    assert first == (first[0], 0)
    # The cached entry is prompt + reply; its first 79 tokens serve, the last is prefilled.
    assert again == (first[0], 79)
    assert shorter[1] == 39
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=0)) as plain:
        assert await turn(plain, ids[:40]) == (shorter[0], 0)


async def test_the_cache_stays_within_its_bytes_evicting_the_least_recent(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=64 << 20)) as probe:
        await turn(probe, prompt(150, 3))
        one = probe.parts.engine.runtime.prompt_cache.nbytes  # type: ignore[union-attr]
    assert one > 0
    # Room for one conversation's cache, not two.
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=one + one // 2)) as stack:
        pc = stack.parts.engine.runtime.prompt_cache
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
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=1024)) as stack:
        pc = stack.parts.engine.runtime.prompt_cache
        assert pc is not None
        await turn(stack, prompt(150, 5))
        assert (pc.entries, pc.nbytes, pc.too_large) == (0, 0, 1)


async def test_a_cancelled_request_keeps_what_it_computed(tiny: Path) -> None:
    """The frontend cancels a request that hit a stop string, or whose client left: what it
    computed still serves the next prompt, alone or in the batch."""
    for solo in (True, False):
        async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=64 << 20)) as stack:
            stack.parts.engine.runtime.solo_enabled = solo
            ids = prompt(100, 6)
            params = SamplingParams(max_tokens=200)
            async with aclosing(stack.frontend.stream(ids, params, [])) as it:
                async for _ in it:
                    break  # the client went away after one token
            await until_true(lambda: stack.parts.engine.batch_cache_rows() == 0)
            pc = stack.parts.engine.runtime.prompt_cache
            assert pc is not None and pc.entries == 1
            _, cached = await turn(stack, ids + [1, 2, 3])
            assert cached == 100, solo


async def test_a_one_token_prompt_is_a_miss_not_a_hit(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=64 << 20)) as stack:
        pc = stack.parts.engine.runtime.prompt_cache
        assert pc is not None
        await turn(stack, [77])
        assert (await turn(stack, [77]))[1] == 0
        assert (pc.hits, pc.misses, pc.reused_tokens) == (0, 2, 0)


def _kv(tokens: int, heads: int = 2, dim: int = 16) -> KVCache:
    c = KVCache()
    shape = (1, heads, tokens, dim)
    c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    return c


def test_kept_entries_hold_their_own_tokens_only() -> None:
    """A cache taken out of the batch is a view of the whole batch's buffer, and a lone
    sequence's cache grows in 256-token steps: what the store keeps (and counts) is its own
    tokens, and the batch's buffer is freed."""
    pc = PromptCache(64 << 20)
    batch = mx.random.normal((8, 2, 4096, 64))
    mx.eval(batch)
    view = KVCache()
    # as mlx-lm's BatchKVCache.extract gives it: an unevaluated copy of the row's slice
    view.keys = mx.contiguous(batch[2:3, :, :10, :])
    view.values = mx.contiguous(batch[3:4, :, :10, :])
    view.offset = 10
    grown = _kv(5)
    assert grown.keys.shape[2] == 256
    held = mx.get_active_memory()
    batch_bytes = batch.nbytes
    del batch
    pc.store(list(range(10)), [view])
    pc.store([300, 301, 302, 303, 304], [grown])
    for c in (view, grown):
        assert c.keys.shape[2] == c.values.shape[2] == c.offset
    # keys and values, float32: 10 tokens x 2 heads x 64 dims, and 5 x 2 x 16
    assert pc.nbytes == 2 * 4 * (10 * 2 * 64 + 5 * 2 * 16)
    assert mx.get_active_memory() < held - batch_bytes // 2  # the batch buffer went


def test_an_exact_hit_leaves_the_last_token_to_prefill() -> None:
    pc = PromptCache(64 << 20)
    pc.store([1, 2, 3, 4], [_kv(4)])
    for _ in range(2):  # and the stored entry is not cut by the first hit
        cache, n = pc.fetch([1, 2, 3, 4])
        assert cache is not None and n == 3 and cache[0].offset == 3
    assert (pc.hits, pc.reused_tokens) == (2, 6)


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
        (
            [
                "--prompt-cache-bytes",
                "1GiB",
                "--node-role",
                "router",
                "--serving-bind",
                "127.0.0.5:1",
                "--prefill-peers",
                "127.0.0.6:1",
                "--decode-peers",
                "127.0.0.7:1",
            ],
            "a router keeps no cache",
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


def test_a_flood_of_namespaces_leaves_only_those_with_entries() -> None:
    """Every cache_salt is a namespace: one client sending a new salt each time must not grow
    the cache past its entries (mlx-lm's trie keeps an evicted namespace's empty root)."""
    pc = PromptCache(3 * 4 * 8 * 2 * 4 * 4)  # about three 4-token entries
    for i in range(200):
        pc.store([1, 2, 3, 4], [_kv(4)], f"salt-{i}")
    roots = pc._lru._trie._trie
    assert pc.entries <= 3 and len(roots) == pc.entries
    pc.clear()
    assert len(roots) == 0
