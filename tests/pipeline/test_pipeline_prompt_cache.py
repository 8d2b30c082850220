"""A pipeline remembers a conversation: the coordinator indexes cached prefixes, each stage keeps
the KV of its own layers under the same entry ids, and a later turn prefills only what is new
-- with the same greedy tokens as one process, and never another tenant's entry."""

from __future__ import annotations

import asyncio
import random
from contextlib import aclosing
from pathlib import Path

import pytest

from mlxcel.base.messages import SamplingParams
from mlxcel.base.prefix_index import cache_namespace, tenant_of
from mlxcel.serving.assembly import Generation, LocalSpec, PipelineSpec, assemble
from mlxcel.serving.frontend import Usage
from mlxcel.serving.stack import Stack
from tests.conftest import until_true

GREEDY = SamplingParams(max_tokens=10)
ALICE = cache_namespace(tenant_of("key-alice"), None)
BOB = cache_namespace(tenant_of("key-bob"), None)


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(n)]


async def turn(stack: Stack, ids: list[int], ns: str = "") -> tuple[list[int], int]:
    usage, out = Usage(), []
    fe = stack.frontend
    async with aclosing(fe.stream(ids, GREEDY, [], usage, cache_ns=ns)) as it:
        async for d in it:
            out.extend(d.token_ids)
    return out, usage.cached_tokens


async def chat(
    stack: Stack, seed: int, ns: str = "", turns: int = 3
) -> list[tuple[list[int], int]]:
    """Turns that each resend the whole history plus new user tokens."""
    history, out = words(300, seed), []
    for k in range(turns):
        reply, cached = await turn(stack, history, ns)
        out.append((reply, cached))
        history = history + reply + words(20, seed * 10 + k)
    return out


@pytest.fixture(scope="module")
def one_process(tiny: Path) -> list[tuple[list[int], int]]:
    async def run() -> list[tuple[list[int], int]]:
        async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=0)) as st:
            return await chat(st, 7)

    return asyncio.run(run())


async def test_later_turns_reuse_the_history_on_every_stage_with_the_same_tokens(
    tiny: Path, one_process: list[tuple[list[int], int]]
) -> None:
    gen = Generation(prompt_cache_bytes=64 << 20, prefill_step_size=64)
    async with assemble(PipelineSpec(tiny, 2), gen) as st:
        got = await chat(st, 7)
        index = st.parts.coordinator.coord.prefixes
        stores = [s.runtime.prefixes for s in st.parts.stages]
        assert index is not None and all(p is not None for p in stores)
        # One entry per conversation: each turn's entry replaced the one before it.
        assert len(index) == 1 and all(len(p) == 1 for p in stores)  # type: ignore[arg-type]
        assert [p.loaded for p in stores] == [2, 2]  # type: ignore[union-attr]
    assert [r for r, _ in got] == [r for r, _ in one_process]
    history = 300
    for k, (reply, cached) in enumerate(got):
        if k == 0:
            assert cached == 0
        else:  # the whole earlier turn (its prompt and reply, but the last token fed)
            assert cached >= 0.8 * history, (k, cached, history)
        history += len(reply) + 20


async def test_a_tenant_never_starts_from_another_tenants_entry(tiny: Path) -> None:
    gen = Generation(prompt_cache_bytes=64 << 20)
    async with assemble(PipelineSpec(tiny, 2), gen) as st:
        ids = words(200, 3)
        assert (await turn(st, ids, ALICE))[1] == 0
        assert (await turn(st, ids, BOB))[1] == 0  # the same prompt: nothing of alice's
        assert (await turn(st, ids, ""))[1] == 0
        assert (await turn(st, ids, ALICE))[1] == len(ids) - 1
        assert (await turn(st, ids, BOB))[1] == len(ids) - 1  # bob's own, from his first


async def test_a_stage_that_lost_its_entry_answers_not_cached_and_the_turn_prefills_in_full(
    tiny: Path, one_process: list[tuple[list[int], int]]
) -> None:
    async with assemble(PipelineSpec(tiny, 2), Generation(prompt_cache_bytes=64 << 20)) as st:
        first, _ = await turn(st, words(300, 7))
        # Stage 1 forgets everything (a restart, or its budget refused the entry): the index
        # still names the entry, so turn 2 asks for it and stage 1 answers not cached.
        stage = st.parts.stages[1]
        await stage.compute.run(stage.runtime.drop_prefixes, "coordinator")
        second = words(300, 7) + first + words(20, 70)
        reply, cached = await turn(st, second)
        coord = st.parts.coordinator.coord
        assert coord.refilled == 1 and cached == 0
        assert reply == one_process[1][0]  # the same tokens, prefilled in full
        # The entry was evicted everywhere; the finished turn is the new one.
        assert coord.prefixes is not None and len(coord.prefixes) == 1
        stores = [s.runtime.prefixes for s in st.parts.stages]
        await until_true(lambda: [len(p) for p in stores] == [1, 1])  # type: ignore[arg-type]
        assert all(not s.seqs for s in st.parts.stages)


async def test_distinct_prompts_evict_old_entries_and_no_stage_passes_its_budget(
    tiny: Path,
) -> None:
    import mlx.core as mx

    budget = 2 << 20
    async with assemble(PipelineSpec(tiny, 2), Generation(prompt_cache_bytes=budget)) as st:
        index = st.parts.coordinator.coord.prefixes
        assert index is not None
        await turn(st, words(400, 99))
        compute = st.parts.stages[0].compute
        held = await compute.run(mx.get_active_memory)  # MLX's live arrays, not its free list
        for seed in range(24):
            await turn(st, words(400, 100 + seed))
        grown = await compute.run(mx.get_active_memory) - held
        assert grown <= budget, f"{grown} bytes more after 24 distinct prompts"
        stores = [s.runtime.prefixes for s in st.parts.stages]
        await until_true(lambda: all(len(p) == len(index) for p in stores))  # type: ignore[arg-type]
        assert index.evicted > 0 and len(index) < 24
        for s in stores:
            assert s is not None and 0 < s.nbytes <= s.max_bytes
            assert len(s) == len(index)  # evicted everywhere, never half-present


def test_a_store_refuses_past_its_budget_and_serves_only_its_owner() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.runtime.prefix_store import PrefixStore

    def kv(n: int) -> list[KVCache]:
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
        return [c]

    one = 2 * 2 * 8 * 4  # keys and values of one position, float32
    store = PrefixStore(max_bytes=10 * one)
    assert store.keep("c", 1, kv(6), 6) is None
    assert store.nbytes == 6 * one  # compacted to its positions, not the 256-step buffer
    assert "not 5" in (store.keep("c", 3, kv(6), 5) or "")
    why = store.keep("c", 4, kv(11), 11)
    assert why is not None and "whole budget" in why and len(store) == 1
    cache, _ = store.load("c", 1, 4)
    assert cache is not None and cache[0].offset == 4
    assert store.load("eve", 1, 4) == (None, "prompt-cache entry 1 is not held here")
    assert store.load("c", 1, 7)[0] is None
    # An entry that does not fit makes room: the least recently used goes (an eviction the
    # index's plan did not foresee; asked for later, it answers not cached).
    assert store.keep("c", 2, kv(3), 3) is None and len(store) == 2
    store.load("c", 1, 6)  # 1 is now the most recently used
    assert store.keep("c", 5, kv(4), 4) is None
    assert store.load("c", 2, 3)[0] is None and store.load("c", 1, 6)[0] is not None
    assert (store.made_room, store.nbytes) == (1, 10 * one)
    store.drop("c", (1,))
    store.drop("c")
    assert (len(store), store.nbytes) == (0, 0)
