"""Disaggregated serving remembers a conversation. A decode node keeps each conversation it
finished (the prompt the handoff brought plus what it generated), and the router sends the
next turn there: that node prefills only the new part, with no prefill node and no handoff.
Without a decode node that keeps it, prefill nodes keep the prompts they ran, and the router
sends the turn to the prefill node whose cache holds its history. Either way from the nodes'
own reports, within the tenant's namespace only; a decode node that evicted the conversation
answers "not cached" and the turn goes the usual way, never wrong tokens."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from mlxcel.base.messages import SamplingParams
from mlxcel.base.prefix_index import cache_namespace, tenant_of
from mlxcel.net.secret import ClusterSecret
from mlxcel.serving.assembly import DisaggSpec, Generation, LocalSpec, assemble
from tests.conftest import free_port
from tests.pipeline.test_pipeline_prompt_cache import turn, words

ALICE = cache_namespace(tenant_of("key-alice"), None)
BOB = cache_namespace(tenant_of("key-bob"), None)
GREEDY = SamplingParams(max_tokens=10)


@pytest.mark.parametrize("decode_keeps", [True, False], ids=["decode-keeps", "prefill-keeps"])
async def test_next_turns_go_where_their_history_is_cached_and_reuse_it(
    tiny: Path, decode_keeps: bool
) -> None:
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=0)) as one:
        histories = [words(300, 40 + c) for c in range(4)]
        want = []
        for h in histories:
            reply, _ = await turn(one, h)
            second = h + reply + words(20, 90)
            reply2 = (await turn(one, second))[0]
            third = second + reply2 + words(30, 91)
            want.append((reply, second, reply2, third, (await turn(one, third))[0]))
    secret = ClusterSecret(bytes(range(32)), "test")
    p1, p2, d, r = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (22, 23, 24, 25))
    cache = Generation(prompt_cache_bytes=64 << 20)
    async with AsyncExitStack() as stack:
        prefills = []
        for p in (p1, p2):
            node = await stack.enter_async_context(
                assemble(DisaggSpec("prefill", tiny, secret, p, (), (d,)), cache)
            )
            prefills.append(node)
        dec = await stack.enter_async_context(
            assemble(DisaggSpec("decode", tiny, secret, d), cache if decode_keeps else Generation())
        )
        for node in (*prefills, dec):
            await node.parts.listener.start()
            stack.push_async_callback(node.parts.listener.close)
        rt = await stack.enter_async_context(
            assemble(DisaggSpec("router", tiny, secret, r, (p1, p2), (d,), startup_timeout=20))
        )
        await rt.parts.listener.start()
        stack.push_async_callback(rt.parts.listener.close)
        firsts = [await turn(rt, h, ALICE) for h in histories]
        await turn(rt, words(50, 7), BOB)  # round robin alone would now send each turn astray
        seconds = [await turn(rt, w[1], ALICE) for w in want]
        # Another tenant's identical second turn: nothing of alice's anywhere.
        stranger = [await turn(rt, w[1], BOB) for w in want[:2]]
        core = rt.parts.service.core
        routed = dict(core.counts)
        if decode_keeps:  # the decode node lost what it kept (a restart, an eviction)
            engine = dec.parts.service.engine
            await engine.compute.run(engine.runtime.prompt_cache.clear)
        thirds = [await turn(rt, w[3], ALICE) for w in want[:2]]
        misses = core.counts["continue_missed"]
    assert [f for f, _ in firsts] == [w[0] for w in want]
    assert [s for s, _ in seconds] == [w[2] for w in want]
    assert all(c == 0 for _, c in firsts)
    for (_, cached), w in zip(seconds, want, strict=True):
        assert cached >= 0.8 * len(w[1]), (cached, len(w[1]))
    assert [c for _, c in stranger] == [0, 0]
    assert [s for s, _ in stranger] == [w[2] for w in want[:2]]
    # The third turns: the same tokens whether or not the decode node still kept them.
    assert [t for t, _ in thirds] == [w[4] for w in want[:2]]
    if decode_keeps:
        # Every second turn ran on the decode node from its own cache: it held the prompt
        # and the reply, so all but the new user tokens came from there.
        assert routed["continued"] == 4 and routed.get("cache_routed", 0) == 0
        for (_, cached), w in zip(seconds, want, strict=True):
            assert cached >= len(w[1]) - 21, (cached, len(w[1]))
        # What it no longer held: "not cached", then a prefill node ran the turn; nothing
        # was prefilled on the decode node, and the prefill nodes' caches still helped.
        assert misses == 2
        assert all(c > 0 for _, c in thirds)
        assert dec.parts.service.decode.counts["not_cached"] == 2
    else:
        # Every second turn went where its first was kept, though round robin alone would
        # have sent half of them to the other node.
        assert routed["cache_routed"] == 4 and routed.get("continued", 0) == 0
        hits = [n.parts.service.engine.runtime.prompt_cache.hits for n in prefills]
        assert sum(hits) >= 4


async def test_distinct_conversations_evict_old_entries_and_no_node_passes_its_budget(
    tiny: Path,
) -> None:
    import mlx.core as mx

    budget = 2 << 20
    secret = ClusterSecret(bytes(range(32)), "test")
    p, d, r = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (26, 27, 28))
    cache = Generation(prompt_cache_bytes=budget)
    async with AsyncExitStack() as stack:
        nodes = []
        for spec in (
            DisaggSpec("prefill", tiny, secret, p, (), (d,)),
            DisaggSpec("decode", tiny, secret, d),
        ):
            node = await stack.enter_async_context(assemble(spec, cache))
            await node.parts.listener.start()
            stack.push_async_callback(node.parts.listener.close)
            nodes.append(node)
        rt = await stack.enter_async_context(
            assemble(DisaggSpec("router", tiny, secret, r, (p,), (d,), startup_timeout=20))
        )
        await rt.parts.listener.start()
        stack.push_async_callback(rt.parts.listener.close)
        await turn(rt, words(400, 99))
        engines = [n.parts.service.engine for n in nodes]
        # Both nodes live in this process: MLX's live arrays (not its free list) are theirs.
        held = await engines[0].compute.run(mx.get_active_memory)
        for seed in range(24):
            await turn(rt, words(400, 100 + seed), ALICE)
        grown = await engines[0].compute.run(mx.get_active_memory) - held
        assert grown <= 2 * budget, f"{grown} bytes more after 24 distinct conversations"
        for e in engines:
            pc = e.runtime.prompt_cache
            assert pc is not None and 0 < pc.nbytes <= budget and pc.entries < 24
