"""Disaggregated serving remembers a conversation: prefill nodes keep the prompts they ran, and
the router sends a conversation's next turn to the prefill node whose cache holds its history
(from the nodes' own reports), within its tenant's namespace only."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

from mlxcel.base.messages import SamplingParams
from mlxcel.base.prefix_index import cache_namespace, tenant_of
from mlxcel.net.secret import ClusterSecret
from mlxcel.serving.assembly import DisaggSpec, Generation, LocalSpec, assemble
from tests.conftest import free_port
from tests.pipeline.test_pipeline_prompt_cache import turn, words

ALICE = cache_namespace(tenant_of("key-alice"), None)
BOB = cache_namespace(tenant_of("key-bob"), None)
GREEDY = SamplingParams(max_tokens=10)


async def test_next_turns_go_where_their_history_is_cached_and_reuse_it(tiny: Path) -> None:
    async with assemble(LocalSpec(tiny), Generation(prompt_cache_bytes=0)) as one:
        histories = [words(300, 40 + c) for c in range(4)]
        want = []
        for h in histories:
            reply, _ = await turn(one, h)
            second = h + reply + words(20, 90)
            want.append((reply, second, (await turn(one, second))[0]))
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
        dec = await stack.enter_async_context(assemble(DisaggSpec("decode", tiny, secret, d)))
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
        seconds = [await turn(rt, second, ALICE) for _, second, _ in want]
        # Another tenant's identical second turn: nothing of alice's anywhere.
        stranger = [await turn(rt, second, BOB) for _, second, _ in want[:2]]
        core = rt.parts.service.core
    assert [f for f, _ in firsts] == [reply for reply, _, _ in want]
    assert [s for s, _ in seconds] == [w for _, _, w in want]
    assert all(c == 0 for _, c in firsts)
    for (_, cached), (_, second, _) in zip(seconds, want, strict=True):
        assert cached >= 0.8 * len(second), (cached, len(second))
    assert [c for _, c in stranger] == [0, 0]
    assert [s for s, _ in stranger] == [w for _, _, w in want[:2]]
    # Every second turn went where its first was kept, though round robin alone would have
    # sent half of them to the other node.
    assert core.counts["cache_routed"] == 4
    hits = [n.parts.service.engine.runtime.prompt_cache.hits for n in prefills]
    assert sum(hits) == 4
