"""``python -m mlxcel bench pipeline``: what pipelining costs, one process vs two stages.

Greedy decode of one stream, in one run: (a) ``single`` -- one process, the local engine;
(b) ``inproc-2`` -- two stage nodes and a coordinator in one process (no sockets);
(c) ``remote-2`` -- two stage processes on 127.0.0.2/127.0.0.3 and a coordinator here, over the
authenticated, encrypted transport.

``overhead_ms_per_token`` is measured at the hand-offs of each decode step: the coordinator
times every step from sending its RunEntry to receiving its RunResult, and every stage adds
the time it spent computing that same step to the message it passes on (``compute_us``), so
the final RunResult carries the step's total compute. Overhead = step time - compute, summed
over the measured steps and divided by their number: framing, encryption, the sockets, the
reactors and the hand-offs to and from the compute threads -- never negative, because the
compute happens inside the step. ``vs_single_ms_per_token`` is the whole difference to the
one-process step (it also holds per-stage work the one-process engine does not have).
``wire_bytes_per_token`` counts every byte the coordinator and both stages wrote to cluster
connections per additional decoded token.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

from mlxcel.frontend import Frontend, Usage
from mlxcel.messages import SamplingParams
from mlxcel.pipeline.coordinator import PipelineCoordinator

PROMPT = "Pipeline benchmark: the quick brown fox jumps over the lazy dog"


async def decode_rate(fe: Frontend, tokens: int) -> tuple[float, int]:
    """(decode tok/s after the first token, tokens generated) for one greedy stream."""
    u = Usage()
    async with aclosing(
        fe.stream(fe.encode_prompt(PROMPT), SamplingParams(max_tokens=tokens), usage=u)
    ) as it:
        async for _ in it:
            pass
    assert u.first_token_at is not None and u.last_token_at is not None
    span = u.last_token_at - u.first_token_at
    return ((u.completion_tokens - 1) / span if span > 0 else 0.0), u.completion_tokens


async def aggregate_rate(fe: Frontend, tokens: int, streams: int) -> float:
    """Aggregate tok/s of ``streams`` concurrent greedy streams (all tokens over wall time)."""
    import asyncio
    import time

    async def one(i: int) -> int:
        u = Usage()
        ids = fe.encode_prompt(f"{PROMPT} ({i})")
        async with aclosing(fe.stream(ids, SamplingParams(max_tokens=tokens), usage=u)) as it:
            async for _ in it:
                pass
        return u.completion_tokens

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(counts) / (time.perf_counter() - t0)


def step_totals(c: PipelineCoordinator) -> tuple[int, float, float]:
    core = c.coord
    return core.decode_steps, core.decode_wall_s, core.decode_compute_s


def per_step_ms(
    before: tuple[int, float, float], after: tuple[int, float, float]
) -> tuple[float, float]:
    """(protocol ms per decode step, stage compute ms per decode step) between two snapshots."""
    steps = after[0] - before[0]
    wall, compute = after[1] - before[1], after[2] - before[2]
    return 1e3 * (wall - compute) / steps, 1e3 * compute / steps


@asynccontextmanager
async def loopback_pipeline(model: Path, streams: int) -> AsyncIterator[tuple[Any, Any]]:
    """(the cluster, the coordinator stack): two stage processes on 127.0.0.2/127.0.0.3 over
    the full transport and a coordinator in this process, all batching up to ``streams`` rows
    like the one-process engine they are compared with."""
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.pipeline.cluster_config import load_cluster_config
    from mlxcel.pipeline.launch import LoopbackCluster
    from mlxcel.pipeline.remote import remote_coordinator

    with tempfile.TemporaryDirectory(prefix="mlxcel-bench-") as tmp:
        batch = ("--max-batch-size", str(streams))
        async with LoopbackCluster(
            model, 2, Path(tmp), spawn_coordinator=False, extra_args=batch
        ) as cl:
            cfg = load_cluster_config(cl.config)
            secret = load_cluster_secret(None, {}, cl.config)
            assert secret is not None
            async with remote_coordinator(
                cfg, cfg.coordinator, model, secret, parallel=streams, max_batch_size=streams
            ) as rc:
                yield cl, rc


async def run_bench(
    model: Path, tokens: int, json_lines: bool, repeats: int = 2, streams: int = 8
) -> int:
    from mlxcel.pipeline.inproc import pipeline_stack
    from mlxcel.runtime.blas import blas_name
    from mlxcel.server.run import local_stack

    rows = []

    async def measure(fe: Frontend) -> float:
        await decode_rate(fe, 8)  # warm-up
        return max([(await decode_rate(fe, tokens))[0] for _ in range(repeats)])

    concurrent: dict[str, float] = {}
    async with local_stack(model, max_batch_size=1, parallel=1, name="bench-single") as st:
        single = await measure(st.frontend)
    async with local_stack(
        model, max_batch_size=streams, parallel=streams, name="bench-batch"
    ) as st:
        await aggregate_rate(st.frontend, 8, streams)  # warm-up
        concurrent["single"] = await aggregate_rate(st.frontend, tokens, streams)
    rows.append(
        {
            "mode": "single",
            "tok_per_s": single,
            "overhead_ms_per_token": 0.0,
            "wire_bytes_per_token": 0,
        }
    )

    async with pipeline_stack(model, 2, parallel=streams, max_batch_size=streams) as ps:
        before = step_totals(ps.coordinator)
        inproc = await measure(ps.frontend)
        overhead, compute_ms = per_step_ms(before, step_totals(ps.coordinator))
        concurrent["inproc-2"] = await aggregate_rate(ps.frontend, tokens, streams)
    rows.append(
        {
            "mode": "inproc-2",
            "tok_per_s": inproc,
            "overhead_ms_per_token": overhead,
            "wire_bytes_per_token": 0,
            "stage_compute_ms_per_token": round(compute_ms, 3),
            "vs_single_ms_per_token": round(1e3 / inproc - 1e3 / single, 3),
        }
    )

    async with loopback_pipeline(model, streams) as (_cluster, rc):
        await decode_rate(rc.frontend, 8)

        async def wire_total() -> int:
            states = await rc.coordinator.query_states()
            return rc.endpoint.wire_bytes + sum(s.wire_bytes_out for s in states)

        rates = []
        for _ in range(repeats):
            before = step_totals(rc.coordinator)
            rate, _n = await decode_rate(rc.frontend, tokens)
            rates.append((rate, *per_step_ms(before, step_totals(rc.coordinator))))
        # Bytes per *decoded* token: the marginal cost of a longer run of the same prompt
        # (the prompt's prefill activation is paid once per request, not per token).
        half = tokens // 2
        w0 = await wire_total()
        await decode_rate(rc.frontend, half)
        w1 = await wire_total()
        await decode_rate(rc.frontend, tokens)
        w2 = await wire_total()
        per_token_wire = ((w2 - w1) - (w1 - w0)) / (tokens - half)
        concurrent["remote-2"] = await aggregate_rate(rc.frontend, tokens, streams)
    remote, overhead, compute_ms = max(rates)
    rows.append(
        {
            "mode": "remote-2",
            "tok_per_s": remote,
            "overhead_ms_per_token": overhead,
            "wire_bytes_per_token": round(per_token_wire),
            "stage_compute_ms_per_token": round(compute_ms, 3),
            "vs_single_ms_per_token": round(1e3 / remote - 1e3 / single, 3),
        }
    )
    for r in rows:
        r[f"tok_per_s_{streams}_streams"] = round(concurrent[str(r["mode"])], 2)
        r["tok_per_s"] = round(float(r["tok_per_s"]), 2)
        r["overhead_ms_per_token"] = round(float(r["overhead_ms_per_token"]), 3)
        r["ratio_vs_single"] = round(float(r["tok_per_s"]) / single, 3)
        r["tokens"] = tokens
        r["blas"] = blas_name()
        if json_lines:
            print(json.dumps(r), flush=True)
    if not json_lines:
        print(f"model {model} | {tokens} greedy tokens per run, best of {repeats}")
        col = f"tok/s x{streams} streams"
        print(
            f"{'mode':<10}{'tok/s':>9}{'x single':>10}{'overhead ms/tok':>17}{'wire B/tok':>12}{col:>22}"
        )
        for r in rows:
            print(
                f"{r['mode']:<10}{r['tok_per_s']:>9}{r['ratio_vs_single']:>10}"
                f"{r['overhead_ms_per_token']:>17}{r['wire_bytes_per_token']:>12}"
                f"{r[f'tok_per_s_{streams}_streams']:>22}"
            )
    return 0
