"""``python -m mlxcel bench prompt-cache``: what a cached history saves on a chat's next turn,
in every mode that keeps a prompt cache.

Turn 1 sends ``history`` random tokens (seeded) and generates ``tokens`` greedily; turn 2
resends all of it, the reply and ``turn_tokens`` new tokens, as a chat client does. For each
mode (``local``: one process; ``pipeline``: two stages in this process; ``stages``: two stage
processes on 127.0.0.2/127.0.0.3 over the encrypted transport, the coordinator here; ``tp``:
two tensor-parallel ranks, rank 0 here; ``disagg``: a router, a prefill node and a decode
node on 127.0.0.4-6, in this process, the decode node keeping the conversations it finished;
``disagg-prefill``: the same with only the prefill node keeping a cache) and each history length, one run measures the time to first token (TTFT) of:

- turn 1 (nothing cached);
- turn 2 in the same tenant's namespace: its history cached;
- turn 2 again in another tenant's namespace (the same tokens, a cache it cannot read): the
  full prefill, on the same warm process -- the uncached figure;

beside mlx-lm as its own chat loop uses it (one ``make_prompt_cache`` carried from turn 1
into turn 2, which then feeds only what the cache lacks; and turn 2 on a fresh cache).

Each mode's summary row gives ``cached_vs_uncached`` (turn 2 cached / uncached) and
``cached_vs_local`` (its cached turn 2 / the one-process cached turn 2).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

from mlxcel.base.errors import ConfigError
from mlxcel.base.prefix_index import cache_namespace
from mlxcel.bench.engine import mlx_lm_stream

CACHE_BYTES = 4 << 30  # every mode's budget: far above what these chats hold


def _context(model: Path) -> int:
    from mlxcel.base.model_config import context_length

    try:
        return int(context_length(json.loads((model / "config.json").read_text())) or 0)
    except (OSError, ValueError):
        return 0


TENANT = cache_namespace("bench", None)
_strangers = itertools.count()


def _mlx_lm_chat(model: Any, tokenizer: Any, history: list[int], user: list[int], n: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ttft1, reply, _ = mlx_lm_stream(model, tokenizer, history, n, cache)
    second = history + reply + user
    held = int(cache[0].offset)  # what the cache already holds of turn 2's tokens
    ttft2, _, _ = mlx_lm_stream(model, tokenizer, second[held:], n, cache)
    fresh, _, _ = mlx_lm_stream(model, tokenizer, second, n, make_prompt_cache(model))
    return {
        "turn1_ms": ttft1,
        "cached_ms": ttft2,
        "uncached_ms": fresh,
        "prompt_tokens": len(second),
        "cached_tokens": held,
    }


async def _turn(fe: Any, ids: list[int], tokens: int, ns: str) -> tuple[float, list[int], int]:
    from mlxcel.base.messages import SamplingParams
    from mlxcel.serving.frontend import Usage

    u, out = Usage(), []
    params = SamplingParams(max_tokens=tokens)
    async with aclosing(fe.stream(ids, params, usage=u, cache_ns=ns)) as it:
        async for d in it:
            out.extend(d.token_ids)
    assert u.first_token_at is not None
    return (u.first_token_at - u.submitted_at) * 1e3, out, u.cached_tokens


async def _mlxcel_chat(fe: Any, history: list[int], user: list[int], n: int) -> dict:
    ttft1, reply, _ = await _turn(fe, history, n, TENANT)
    second = history + reply + user
    cached_ms, _, cached = await _turn(fe, second, n, TENANT)
    # A tenant of its own for each chat: nothing it ran before can share a token with it.
    stranger = cache_namespace("another tenant", str(next(_strangers)))
    uncached_ms, _, none = await _turn(fe, second, n, stranger)
    assert none == 0, "another tenant's turn reused the cache"
    return {
        "turn1_ms": ttft1,
        "cached_ms": cached_ms,
        "uncached_ms": uncached_ms,
        "prompt_tokens": len(second),
        "cached_tokens": cached,
    }


@asynccontextmanager
async def _frontend(mode: str, model: Path) -> AsyncIterator[Any]:
    from mlxcel.serving.assembly import Generation, LocalSpec, PipelineSpec, assemble

    gen = Generation(prompt_cache_bytes=CACHE_BYTES)
    if mode == "stages":
        async with _stage_processes(model, gen) as fe:
            yield fe
        return
    if mode in ("disagg", "disagg-prefill"):
        async with _disaggregated(model, gen, decode_keeps=mode == "disagg") as fe:
            yield fe
        return
    if mode == "tp":
        from mlxcel.serving.assembly import TensorParallelSpec

        async with assemble(TensorParallelSpec(model, 2), gen) as st:
            yield st.frontend
        return
    spec = LocalSpec(model) if mode == "local" else PipelineSpec(model, 2)
    async with assemble(spec, gen) as st:
        yield st.frontend


@asynccontextmanager
async def _disaggregated(model: Path, gen: Any, decode_keeps: bool) -> AsyncIterator[Any]:
    """A router, a prefill node (keeping its prompt cache) and a decode node (keeping the
    conversations it finished, or nothing), each on its own node in this process over
    authenticated TCP on 127.0.0.4-6."""
    import dataclasses

    from mlxcel.net.network import free_port
    from mlxcel.net.secret import ClusterSecret
    from mlxcel.serving.assembly import DisaggSpec, assemble

    secret = ClusterSecret(os.urandom(32), "bench")
    p, d, r = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (4, 5, 6))
    async with AsyncExitStack() as stack:
        plain = dataclasses.replace(gen, prompt_cache_bytes=0)
        for spec, g in (
            (DisaggSpec("prefill", model, secret, p, (), (d,)), gen),
            (DisaggSpec("decode", model, secret, d), gen if decode_keeps else plain),
        ):
            node = await stack.enter_async_context(assemble(spec, g))
            await node.parts.listener.start()
            stack.push_async_callback(node.parts.listener.close)
        router = DisaggSpec("router", model, secret, r, (p,), (d,), startup_timeout=60)
        rt = await stack.enter_async_context(assemble(router, gen))
        await rt.parts.listener.start()
        stack.push_async_callback(rt.parts.listener.close)
        yield rt.frontend


@asynccontextmanager
async def _stage_processes(model: Path, gen: Any) -> AsyncIterator[Any]:
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.pipeline.cluster_config import load_cluster_config
    from mlxcel.pipeline.launch import LoopbackCluster
    from mlxcel.serving.assembly import CoordinatorSpec, assemble

    with tempfile.TemporaryDirectory(prefix="mlxcel-bench-") as tmp:
        budget = ("--prompt-cache-bytes", str(CACHE_BYTES))
        async with LoopbackCluster(
            model, 2, Path(tmp), spawn_coordinator=False, extra_args=budget
        ) as cl:
            cfg = load_cluster_config(cl.config)
            secret = load_cluster_secret(None, {}, cl.config)
            assert secret is not None
            spec = CoordinatorSpec(cfg, cfg.coordinator, model, secret)
            async with assemble(spec, gen) as rc:
                yield rc.frontend


async def run_bench(model: Path, s: Any) -> int:
    from mlx_lm.utils import load

    from mlxcel.runtime.blas import blas_name

    histories = [int(x) for x in s.history.split(",") if x.strip()]
    context = _context(model)
    for h in histories:
        need = h + s.turn_tokens + 3 * s.tokens
        if context and need > context:
            raise ConfigError(
                "--history",
                f"{h} tokens of history, {s.turn_tokens} more in turn 2 and {s.tokens} "
                f"generated each turn need {need} positions; the model holds {context}",
            )
    ref_model, ref_tok = load(str(model))
    vocab = int(ref_model.args.vocab_size) if hasattr(ref_model, "args") else 256
    modes = [m.strip() for m in s.modes.split(",") if m.strip()]
    rng = random.Random(0)

    def draw(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    # Each engine first runs a whole chat on other tokens (at the first history length: the
    # prompt runs in the same chunks at every length): kernels compile on a shape's first
    # use (10-30 s on a GPU), which is not what a second turn costs.
    chats = {h: (draw(h), draw(s.turn_tokens)) for h in histories}
    warm = (draw(histories[0]), draw(s.turn_tokens))
    rows: list[dict] = []

    def row(engine: str, history: int, r: dict) -> None:
        rows.append(
            {
                "bench": "prompt-cache",
                "engine": engine,
                "history": history,
                **{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()},
                "cached_vs_uncached": round(r["cached_ms"] / r["uncached_ms"], 3),
                "blas": blas_name(),
            }
        )

    _mlx_lm_chat(ref_model, ref_tok, *warm, s.tokens)
    for h, (history, user) in chats.items():
        row("mlx-lm", h, _mlx_lm_chat(ref_model, ref_tok, history, user, s.tokens))
    del ref_model
    for mode in modes:
        async with _frontend(mode, model) as fe:
            await _mlxcel_chat(fe, *warm, s.tokens)
            for h, (history, user) in chats.items():
                row(f"mlxcel {mode}", h, await _mlxcel_chat(fe, history, user, s.tokens))
    local = {r["history"]: r["cached_ms"] for r in rows if r["engine"] == "mlxcel local"}
    for r in rows:
        if r["engine"].startswith("mlxcel") and r["history"] in local:
            r["cached_vs_local"] = round(r["cached_ms"] / local[r["history"]], 3)
    if s.json_lines:
        for r in rows:
            print(json.dumps(r), flush=True)
        return 0
    print(f"model {model} | turn 2 adds {s.turn_tokens} tokens to the history and the reply")
    print(
        f"{'engine':>16} {'history':>7} {'turn 1':>9} {'cached':>9} {'uncached':>9} "
        f"{'cached/unc':>10} {'vs local':>8}  cached tokens"
    )
    for r in rows:
        print(
            f"{r['engine']:>16} {r['history']:>7} {r['turn1_ms']:>7.1f}ms {r['cached_ms']:>7.1f}ms "
            f"{r['uncached_ms']:>7.1f}ms {r['cached_vs_uncached']:>10.3f} "
            f"{r.get('cached_vs_local', float('nan')):>8.3f}  "
            f"{r['cached_tokens']} of {r['prompt_tokens']}"
        )
    return 0
