"""Disaggregated serving with the real model runtime: the KV handoff format, and a router,
a prefill node and a decode node in one process talking over authenticated loopback TCP
(127.0.0.x addresses, so identities are bound to distinct source IPs)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxcel.base.errors import EngineError
from mlxcel.base.messages import ErrorCode, KvHandoff, SamplingParams
from mlxcel.disagg.stack import RoleParts
from mlxcel.net.secret import ClusterSecret
from mlxcel.serving.assembly import DisaggSpec, LocalSpec, assemble
from mlxcel.serving.runner import NodeRunner
from mlxcel.serving.stack import Stack
from tests.conftest import collect, free_port, until_true

PROMPTS = [f"Disaggregated prompt {i}: " + "the quick brown fox " * (1 + i % 4) for i in range(6)]


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict[str, list[list[int]]]:
    async def run() -> dict[str, list[list[int]]]:
        async with assemble(LocalSpec(tiny)) as st:
            greedy = [await collect(st.frontend, p) for p in PROMPTS]
            seeded = [
                await collect(st.frontend, p, temperature=0.9, seed=1234 + i)
                for i, p in enumerate(PROMPTS)
            ]
            return {"greedy": greedy, "seeded": seeded}

    return asyncio.run(run())


@dataclass
class Trio:
    router: Stack[RoleParts]
    prefill: Stack[RoleParts]
    decode: Stack[RoleParts]


@asynccontextmanager
async def trio(model: Path, allowlist: str = "", **router_kw: object) -> AsyncIterator[Trio]:
    secret = ClusterSecret(bytes(range(32)), "test")
    pa, da, ra = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (12, 13, 14))
    async with AsyncExitStack() as stack:
        pre = await stack.enter_async_context(
            assemble(
                DisaggSpec("prefill", model, secret, pa, (), (da,), decode_allowlist=allowlist)
            )
        )
        dec = await stack.enter_async_context(assemble(DisaggSpec("decode", model, secret, da)))
        for node in (pre, dec):
            await node.parts.listener.start()
            stack.push_async_callback(node.parts.listener.close)
        router = DisaggSpec("router", model, secret, ra, (pa,), (da,), startup_timeout=20)
        rt = await stack.enter_async_context(
            assemble(dataclasses.replace(router, **router_kw))  # type: ignore[arg-type]
        )
        await rt.parts.listener.start()
        stack.push_async_callback(rt.parts.listener.close)
        yield Trio(rt, pre, dec)


async def test_handoff_decodes_exactly_what_one_node_decodes(
    tiny: Path, reference: dict[str, list[list[int]]]
) -> None:
    async with trio(tiny) as t:
        fe = t.router.frontend
        greedy = await asyncio.gather(*(collect(fe, p) for p in PROMPTS))
        assert greedy == reference["greedy"]
        # Sampling state travels too: a seeded request continues its PRNG key on the
        # decode node, so it reproduces the single-node stream token for token.
        seeded = await asyncio.gather(
            *(collect(fe, p, temperature=0.9, seed=1234 + i) for i, p in enumerate(PROMPTS))
        )
        assert seeded == reference["seeded"]
        stats = t.router.parts.service.stats(verbose=False)
        assert stats["addresses_redacted"] and all("address" not in n for n in stats["nodes"])
        assert all(n["dispatched"] == 2 * len(PROMPTS) for n in stats["nodes"])
        assert t.prefill.parts.service.prefill.counts["committed"] == 2 * len(PROMPTS)

        # The nodes' figures reach the router with its probes: every handoff and its time,
        # each node's KV cache (nothing held now, room for more).
        def figures() -> dict[str, dict[str, float]]:
            return {n["id"]: n for n in t.router.parts.service.stats(verbose=False)["nodes"]}

        # (A figure is as of the node's last poll: one taken while streams still decoded
        # shows their cache, so wait for a poll after the last one ended.)
        await until_true(
            lambda: (
                figures()["prefill-0"].get("handoffs") == 2 * len(PROMPTS)
                and figures()["decode-0"].get("kv_tokens") == 0
            )
        )
        pre, dec = figures()["prefill-0"], figures()["decode-0"]
        assert 0 < pre["handoff_s"] < 2 * len(PROMPTS) * 10
        assert pre["kv_tokens"] == dec["kv_tokens"] == 0
        assert pre["kv_capacity"] > 0 and dec["kv_capacity"] > 0


async def test_cancellation_frees_the_cache_on_both_nodes(tiny: Path) -> None:
    async with trio(tiny) as t:
        fe = t.router.frontend
        got = 0
        async with aclosing(
            fe.stream(fe.encode_prompt(PROMPTS[0]), SamplingParams(max_tokens=3000))
        ) as it:
            async for d in it:
                got += len(d.token_ids)
                if got >= 3:
                    # The decode node holds the prompt's cache and what it generated.
                    held = t.decode.parts.service.decode.counters()["kv_tokens"]
                    assert held >= len(fe.encode_prompt(PROMPTS[0])) + 1
                    break  # the client goes away mid-stream
        dec, pre = t.decode, t.prefill
        await until_true(
            lambda: (
                dec.parts.service.decode.active == 0
                and dec.parts.engine is not None
                and dec.parts.engine.active == 0
                and not any(x.cache for x in dec.parts.service.decode.slots.values())
                and pre.parts.service.prefill.active == 0
                and pre.parts.engine is not None
                and pre.parts.engine.active == 0
            )
        )
        assert dec.parts.service.decode.counts["cancelled"] == 1
        assert t.router.parts.service.router.active == 0
        # The nodes keep serving.
        assert len(await collect(fe, PROMPTS[1], n=4)) == 4


async def test_a_corrupt_handoff_is_refused_and_reported(tiny: Path) -> None:
    async with trio(tiny) as t:
        real_send = t.prefill.parts.service.endpoint.send

        async def corrupt(dest: str, msg, deadline: float) -> None:  # type: ignore[no-untyped-def]
            if isinstance(msg, KvHandoff):
                k = msg.keys[0]
                bad = dataclasses.replace(k, data=bytes([k.data[0] ^ 1]) + k.data[1:])
                msg = dataclasses.replace(msg, keys=(bad, *msg.keys[1:]))
            await real_send(dest, msg, deadline)

        t.prefill.parts.service.endpoint.send = corrupt  # type: ignore[method-assign]

        t.prefill.parts.service.endpoint.send_now = None  # every send through it
        with pytest.raises(EngineError) as err:
            await collect(t.router.frontend, PROMPTS[0])
        assert err.value.code == ErrorCode.HANDOFF_FAILED
        assert "digest mismatch" in str(err.value)
        assert t.decode.parts.service.decode.reads == type(t.decode.parts.service.decode.reads)()
        await until_true(lambda: t.prefill.parts.service.prefill.active == 0)


async def test_an_expired_lease_is_an_error_and_the_cache_is_never_read(tiny: Path) -> None:
    async with trio(tiny) as t:
        # The decode node's acknowledgements never leave: the lease runs out.
        real_send = t.decode.parts.service.endpoint.send

        async def swallow_acks(dest: str, msg, deadline: float) -> None:  # type: ignore[no-untyped-def]
            if type(msg).__name__ != "HandoffAck":
                await real_send(dest, msg, deadline)

        t.decode.parts.service.endpoint.send = swallow_acks  # type: ignore[method-assign]

        t.decode.parts.service.endpoint.send_now = None  # every send through it
        core = t.prefill.parts.service.prefill
        core.config = dataclasses.replace(core.config, lease=0.5)
        with pytest.raises(EngineError) as err:
            await collect(t.router.frontend, PROMPTS[0])
        assert err.value.code == ErrorCode.HANDOFF_TIMEOUT and "lease expired" in str(err.value)
        await until_true(lambda: t.decode.parts.service.decode.active == 0)
        assert not t.decode.parts.service.decode.reads and not t.decode.parts.service.decode.slots


def test_handoff_pack_check_and_tamper(tiny: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.base.handoff import check
    from mlxcel.runtime.kv_handoff import pack, unpack
    from mlxcel.runtime.model import load_model

    loaded = load_model(tiny)
    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    p = pack(cache, 4, 7)  # the cache may hold more than the prompt: trimmed
    assert all(k.shape[2] == 4 for k in p.keys) and p.keys[0].dtype == "float32"
    from mlxcel.base.handoff import digest_of

    h = KvHandoff("r", 1, "x", 1, 7, SamplingParams(), (), 4, p.keys, p.values, b"")
    h = dataclasses.replace(h, digest=digest_of(h, p.tensors))
    kv_heads, head_dim = p.keys[0].shape[1], p.keys[0].shape[3]
    assert check(h, len(cache), kv_heads, head_dim, head_dim) is None
    restored = unpack(h)
    assert restored[0].offset == 4
    assert check(h, len(cache) + 1, kv_heads, head_dim, head_dim) is not None
    # Every field the decode node acts on is under the digest, not just the tensors.
    for change in (
        {"first_token": 8},
        {"rng_key": (1, 2)},
        {"router": "y"},
        {"nonce": 2},
        {"sampling": SamplingParams(max_tokens=99)},
        {"request_id": "s"},
    ):
        tampered = dataclasses.replace(h, **change)  # type: ignore[arg-type]
        assert "digest mismatch" in (
            check(tampered, len(cache), kv_heads, head_dim, head_dim) or ""
        )


@pytest.fixture(scope="session")
def sliding_llama(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with sliding-window layers: mlx-lm gives it RotatingKVCache layers."""
    out = tmp_path_factory.mktemp("ckpt-swa") / "tiny-llama-swa"
    shutil.copytree(checkpoints["llama"], out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2)
    cfg["sliding_window"] = 16
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_unsupported_reason_names_rotating_caches(tiny: Path, sliding_llama: Path) -> None:
    from mlxcel.runtime.kv_handoff import unsupported_reason
    from mlxcel.runtime.model import load_model

    assert unsupported_reason(load_model(tiny).model, "qwen3") is None
    why = unsupported_reason(load_model(sliding_llama).model, "llama")
    assert why is not None and "RotatingKVCache" in why


async def test_unsupported_family_fails_each_request_cleanly_and_keeps_serving(
    sliding_llama: Path,
) -> None:
    async with trio(sliding_llama) as t:
        for _ in range(2):
            with pytest.raises(EngineError) as err:
                await collect(t.router.frontend, PROMPTS[0])
            assert err.value.code == ErrorCode.UNSUPPORTED_MODEL
            assert "RotatingKVCache" in str(err.value)
        # No prefill work ran for them, and the node still answers its probes.
        assert t.prefill.parts.engine is not None and t.prefill.parts.engine.prompt_tokens == 0
        assert t.router.parts.service.router.online("prefill")


async def test_router_runner_serves_stats_over_http(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiohttp

    from mlxcel.config.settings import router_stats_verbose
    from mlxcel.serving.runner import HttpOptions

    secret = ClusterSecret(bytes(range(32)), "test")
    pa, da, ra = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (15, 16, 17))
    async with AsyncExitStack() as stack:
        for spec in (
            DisaggSpec("prefill", tiny, secret, pa, decode_peers=(da,)),
            DisaggSpec("decode", tiny, secret, da),
        ):
            node = await stack.enter_async_context(assemble(spec))
            runner = NodeRunner(node.serving)
            await runner.start()
            stack.push_async_callback(runner.stop)
        node = await stack.enter_async_context(
            assemble(
                DisaggSpec(
                    "router", tiny, secret, ra, (pa,), (da,), verbose_stats=router_stats_verbose
                )
            )
        )
        runner = NodeRunner(node.serving, HttpOptions(port=0))
        await runner.setup()
        urls = await runner.start()
        stack.push_async_callback(runner.stop)
        async with aiohttp.ClientSession() as http:
            for env, redacted in (("", True), ("YES", False), ("on", False), ("0", True)):
                monkeypatch.setenv("MLXCEL_ROUTER_STATS_VERBOSE", env)
                async with http.get(urls["http"] + "/router/stats") as resp:
                    body = await resp.json()
                assert body["addresses_redacted"] is redacted
                text = json.dumps(body)
                assert (pa in text and da in text) is not redacted
                assert (pa not in text and da not in text) is redacted
                assert [n["id"] for n in body["nodes"]] == ["prefill-0", "decode-0"]
            async with http.get(urls["http"] + "/health") as resp:
                assert resp.status == 200


async def test_a_cache_that_cannot_be_packed_fails_its_request_with_the_reason(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlxcel.runtime.engine_runtime as engine_mod

    def broken(*_a: object) -> None:
        raise ValueError("layer cache RotatingKVCache does not hold the whole prompt")

    monkeypatch.setattr(engine_mod, "pack", broken)
    async with trio(tiny) as t:
        with pytest.raises(EngineError) as err:
            await collect(t.router.frontend, PROMPTS[0])
        assert "could not pack the KV cache" in str(err.value)
        await until_true(lambda: t.prefill.parts.service.prefill.active == 0)


async def test_a_decode_target_outside_the_allowlist_fails_and_the_cache_never_leaves(
    tiny: Path,
) -> None:
    async with trio(tiny, allowlist="127.0.0.99:1, decode.example:2") as t:
        with pytest.raises(EngineError) as err:
            await collect(t.router.frontend, PROMPTS[0])
        assert err.value.code == ErrorCode.DECODE_TARGET_REFUSED
        assert "MLXCEL_DECODE_ALLOWLIST" in str(err.value) and "127.0.0.13" not in str(err.value)
        pre, dec = t.prefill, t.decode
        assert (
            pre.parts.engine is not None and pre.parts.engine.prompt_tokens == 0
        )  # no prefill work
        assert pre.parts.service.prefill.counts["handed_off"] == 0
        assert (
            dec.parts.service.decode.counts == type(dec.parts.service.decode.counts)()
        )  # nothing arrived


async def test_a_handoff_split_into_several_messages_decodes_the_same(
    tiny: Path, reference: dict[str, list[list[int]]]
) -> None:
    async with trio(tiny) as t:
        core = t.prefill.parts.service.prefill
        core.config = dataclasses.replace(core.config, part_bytes=20 << 10)  # a few layers a part
        got = [await collect(t.router.frontend, p) for p in PROMPTS]
        assert got == reference["greedy"]
        counts = t.decode.parts.service.decode.counts
        assert counts["committed"] == len(PROMPTS) and counts["parts"] > len(PROMPTS)


async def test_the_openai_client_script_gets_what_one_node_gives_every_parameter(
    tiny: Path,
) -> None:
    """logprobs and top_logprobs (carried back from the prefill and decode nodes), min_p,
    logit_bias, the penalties (the handoff carries the prompt's tail they look back on),
    seed, stop and tools: the same script, the same answers as one node."""
    from mlxcel.base.messages import EXTENDED_SAMPLING
    from mlxcel.serving.runner import Serving
    from tests import parity

    want = await parity.one_node(tiny)
    async with trio(tiny) as t:
        r = t.router
        got = await parity.served(
            Serving(r.node, r.frontend, sampling=EXTENDED_SAMPLING, label="disaggregated router")
        )
    parity.assert_same(got, want, "disaggregated")


async def test_a_structured_output_request_is_refused_by_name_by_the_router(tiny: Path) -> None:
    """The grammar's matcher would have to cross the KV handoff: the router says so."""
    import openai

    from mlxcel.serving.runner import HttpOptions, NodeRunner

    secret = ClusterSecret(bytes(range(32)), "test")
    pa, da, ra = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (18, 19, 20))
    async with AsyncExitStack() as stack:
        for spec in (
            DisaggSpec("prefill", tiny, secret, pa, decode_peers=(da,)),
            DisaggSpec("decode", tiny, secret, da),
            DisaggSpec("router", tiny, secret, ra, (pa,), (da,)),
        ):
            node = await stack.enter_async_context(assemble(spec))
            runner = NodeRunner(node.serving, HttpOptions(port=0, model_name="tiny"))
            await runner.setup()
            urls = await runner.start()
            stack.push_async_callback(runner.stop)
        c = openai.AsyncOpenAI(base_url=urls["http"] + "/v1", api_key="x", max_retries=0)
        stack.push_async_callback(c.close)
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                response_format={"type": "json_object"},
            )  # fmt: skip
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "response_format"
    assert "not supported by this server's mode" in body["message"]
