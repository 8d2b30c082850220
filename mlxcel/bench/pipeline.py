"""``python -m mlxcel bench pipeline``: what pipelining costs, one process vs two stages.

Greedy decode at each ``--streams`` count, in one run: (a) ``single`` -- one process, the
local engine; (b) ``inproc-2`` -- two stage nodes and a coordinator in one process (no
sockets); (c) ``remote-2`` -- two stage processes on 127.0.0.2/127.0.0.3 and a coordinator
here, over the authenticated, encrypted transport; beside (d) plain mlx-lm's own loop and its
two-halves split of the same checkpoint (:mod:`mlxcel.bench.reference`). Pipeline rows carry
per-stage figures (graph build, evaluation, host copy, busy fraction) from the stages' own
timing.

``overhead_ms_per_step`` is measured at the hand-offs of each decode step: the coordinator
times every step from sending its RunEntry to receiving its RunResult, and every stage adds
the time it spent computing that same step to the message it passes on (``compute_us``), so
the final RunResult carries the step's total compute. Overhead = step time - compute, summed
over the measured steps and divided by their number: framing, encryption, the sockets, the
reactors and the hand-offs to and from the compute threads -- never negative, because the
compute happens inside the step. ``wire_bytes_per_token`` (one stream, remote) counts every byte the coordinator and both stages wrote to cluster
connections per additional decoded token.

``saturated_ratio`` is the ratio the row would reach with no idle time at its bottleneck, at
the compute it measured: the busiest stage where stage processes overlap (a micro-batch per
stage), the stages' compute together where they take turns (one stream, or in-process stages
on one compute thread). The gap between it and ``ratio_vs_single`` is what overlap and protocol
still lose; below it, the stages' compute itself is what costs.

``--pin`` compares one device with two on a CPU host (:mod:`mlxcel.bench.pinning`): the
one-process rows run pinned to one core, each stage process of ``remote-2`` to a core of its
own, and the coordinator to the last stage's core (it works when that stage has just answered);
every row says where it ran (``cores``, read back from the kernel).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from mlxcel.base.messages import SamplingParams
from mlxcel.pipeline.coordinator import PipelineCoordinator
from mlxcel.serving.frontend import Frontend, Usage

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
async def loopback_pipeline(
    model: Path,
    streams: int,
    micro_batch_size: int | None = None,
    placement: Any = None,
    unprotected: bool = False,
) -> AsyncIterator[tuple[Any, Any]]:
    """(the cluster, the coordinator stack): two stage processes on 127.0.0.2/127.0.0.3 (or
    where ``placement`` puts them) over the full transport and a coordinator in this process,
    all batching up to ``streams`` rows like the one-process engine they are compared with.
    ``unprotected``: every connection's frames without AES-256-GCM (attribution only, see
    :mod:`mlxcel.bench.unprotected`)."""
    from mlxcel.bench.unprotected import MODULE, frames_unprotected
    from mlxcel.net.secret import load_cluster_secret
    from mlxcel.pipeline.cluster_config import load_cluster_config
    from mlxcel.pipeline.launch import LoopbackCluster
    from mlxcel.serving.assembly import CoordinatorSpec, Generation, assemble

    with (
        tempfile.TemporaryDirectory(prefix="mlxcel-bench-") as tmp,
        frames_unprotected() if unprotected else nullcontext(),
    ):
        batch = ("--max-batch-size", str(streams))
        async with LoopbackCluster(
            model, 2, Path(tmp), spawn_coordinator=False, extra_args=batch, placement=placement,
            module=MODULE if unprotected else "mlxcel",
        ) as cl:  # fmt: skip
            cfg = load_cluster_config(cl.config)
            secret = load_cluster_secret(None, {}, cl.config)
            assert secret is not None
            spec = CoordinatorSpec(
                cfg, cfg.coordinator, model, secret, micro_batch_size=micro_batch_size
            )
            async with assemble(spec, Generation(parallel=streams, max_batch_size=streams)) as rc:
                yield cl, rc


def _stage_rows(
    before: list[tuple[int, int, int, int, int]],
    after: list[tuple[int, int, int, int, int]],
    wall: float,
) -> list[dict[str, float]]:
    """Per stage, between two (compute, build, eval, copy, jobs) snapshots in microseconds:
    ms per job of each part, and the fraction of the wall time the stage computed."""
    out = []
    for b, a in zip(before, after, strict=True):
        jobs = max(1, a[4] - b[4])
        d = [(x - y) / 1e3 for x, y in zip(a[:4], b[:4], strict=True)]
        out.append(
            {
                "compute_ms": round(d[0] / jobs, 3),
                "build_ms": round(d[1] / jobs, 3),
                "eval_ms": round(d[2] / jobs, 3),
                "copy_ms": round(d[3] / jobs, 3),
                "jobs": a[4] - b[4],
                "busy": round(d[0] / 1e3 / wall, 3) if wall > 0 else 0.0,
            }
        )
    return out


async def run_bench(
    model: Path,
    tokens: int,
    json_lines: bool,
    streams: list[int] | None = None,
    micro_batch_size: int | None = None,
    repeats: int = 2,
    reference: bool = True,
    pin: bool = False,
    netns_rate: str | None = None,
    protection_cost: bool = False,
) -> int:
    """Every mode at every stream count in one run, with plain mlx-lm's split as reference.
    ``pin``: one device against two (:mod:`mlxcel.bench.pinning`): every one-process row on
    one core, each stage process of ``remote-2`` on a core of its own, the coordinator on the
    last stage's."""
    import os
    from contextlib import AbstractContextManager

    from mlxcel.bench.pinning import pinned, two_cores

    counts = sorted(set(streams or [1, 8]))
    rows: list[dict[str, Any]] = []

    async def rate(fe: Frontend, n: int) -> float:
        """Decode tok/s of one stream (best of ``repeats``), or aggregate tok/s of ``n``."""
        if n == 1:
            await decode_rate(fe, 8)  # warm-up
            return max([(await decode_rate(fe, tokens))[0] for _ in range(repeats)])
        await aggregate_rate(fe, 8, n)
        return await aggregate_rate(fe, tokens, n)

    cores = two_cores() if pin else None
    if cores is not None:
        os.environ["MLXCEL_BLAS_THREADS"] = "1"  # the stage processes' BLAS: one thread each

    def one_device() -> AbstractContextManager[None]:
        return pinned({cores[0]}) if cores is not None else nullcontext()

    def add(mode: str, n: int, tok_s: float, **extra: Any) -> None:
        if cores is not None and "cores" not in extra:  # where this process ran, as it is now
            extra["cores"] = [sorted(os.sched_getaffinity(0))]
        rows.append({"mode": mode, "streams": n, "tok_per_s": round(tok_s, 2), **extra})

    with one_device():
        await _one_process_rows(model, counts, tokens, reference, rate, add, micro_batch_size)
    with _hosts(netns_rate) as placement:
        await _remote_rows(model, counts, tokens, micro_batch_size, rate, add, cores, placement)
        if protection_cost:  # the same pipeline, frames unprotected: what the AEAD costs
            ends = sorted({counts[0], counts[-1]})
            await _remote_rows(
                model, ends, tokens, micro_batch_size, rate, add, cores, placement, True
            )
    _report(rows, tokens, repeats, model, json_lines)
    return 0


async def _one_process_rows(  # type: ignore[no-untyped-def]
    model: Path, counts: list[int], tokens: int, reference: bool, rate, add, micro_batch_size
) -> None:
    """The rows one device runs: mlx-lm's own loop and split, single, inproc-2."""
    import time

    from mlxcel.runtime.compute import ComputeThread
    from mlxcel.serving.assembly import Generation, LocalSpec, PipelineSpec, assemble

    most = max(counts)
    if reference:
        from mlxcel.bench.reference import split_reference

        compute = ComputeThread("mlxcel-reference")
        try:
            ref = await compute.run(split_reference, model, counts, max(16, tokens))
        finally:
            compute.close()
        for n in counts:
            for kind in ("loop", "split", "split_host"):
                add(f"mlx-lm {kind}", n, n * 1e3 / ref[n][kind], ms_per_step=round(ref[n][kind], 3))

    for n in counts:
        async with assemble(LocalSpec(model), Generation(parallel=n, max_batch_size=n)) as st:
            add("single", n, await rate(st.frontend, n))

    pipeline = PipelineSpec(model, 2, micro_batch_size=micro_batch_size)
    async with assemble(pipeline, Generation(parallel=most, max_batch_size=most)) as ps:

        def snap() -> list[tuple[int, int, int, int, int]]:
            return [
                (int(s.stats.compute_s * 1e6), *s.runtime.timing.fields().values())
                for s in ps.parts.stages
            ]

        for n in counts:
            coordinator = ps.parts.coordinator
            before, t0, steps0 = snap(), time.perf_counter(), step_totals(coordinator)
            tok_s = await rate(ps.frontend, n)
            wall = time.perf_counter() - t0
            overhead, compute_ms = per_step_ms(steps0, step_totals(coordinator))
            add(
                "inproc-2",
                n,
                tok_s,
                overhead_ms_per_step=round(overhead, 3),
                stage_compute_ms_per_step=round(compute_ms, 3),
                stages=_stage_rows(before, snap(), wall),
                micro_batch_size=coordinator.coord.micro_batch_size,
                micro_batches=len(coordinator.coord.micro.members),
            )


@contextmanager
def _hosts(rate: str | None) -> Iterator[Any]:
    """With ``rate``: two network-namespace hosts whose links are shaped to it, this thread (the
    coordinator's) on the second, beside the last stage; yields where the stages go."""
    if rate is None:
        yield None
        return
    from mlxcel.base.errors import ConfigError
    from mlxcel.bench.netns import Hosts, unavailable
    from mlxcel.bench.netns_nodes import in_netns
    from mlxcel.pipeline.launch import Placement

    why = unavailable()
    if why is not None:
        raise ConfigError("--netns-rate", why)
    with Hosts(2, net=78) as hosts:
        for i in range(2):
            hosts.slow(i, rate, burst="512kb")  # a gigabit link needs a tick's worth of burst
        with in_netns(hosts.names[1]):
            yield Placement([hosts.ip(i) for i in range(2)], hosts.command)


async def _remote_rows(  # type: ignore[no-untyped-def]
    model: Path,
    counts: list[int],
    tokens: int,
    micro_batch_size,
    rate,
    add,
    cores,
    placement,
    unprotected: bool = False,
) -> None:
    """remote-2: two stage processes over the transport (each on a core of its own when
    ``cores``), the coordinator in this process; ``unprotected``: the row
    ``remote-2 unprotected``, the same with frames unprotected."""
    import os
    import time

    from mlxcel.bench.pinning import affinity, pin

    link = {} if placement is None else {"hosts": list(placement.ips)}
    mode = "remote-2 unprotected" if unprotected else "remote-2"
    async with loopback_pipeline(model, max(counts), micro_batch_size, placement, unprotected) as (
        cluster,
        rc,
    ):
        pinned_to: dict[str, Any] = {}
        here = os.getpid()
        home = affinity(here)
        if cores is not None:
            stages = [proc for node, proc, _ in cluster.procs if node != "coordinator"]
            for core, proc in zip(cores, stages, strict=True):
                pin(proc.pid, {core})
            # The coordinator shares the last stage's core: it works when that stage has just
            # answered (a step's tokens) and never takes the entry stage's core from under the
            # step it has just sent. Left free, the kernel often ran it there.
            pin(here, {cores[-1]})
            # Where each process's threads are now allowed: the pinning, read back.
            pinned_to["cores"] = [sorted(affinity(p.pid)) for p in stages]
            pinned_to["coordinator_cores"] = sorted(affinity(here))
        await decode_rate(rc.frontend, 8)
        rcoord, rendpoint = rc.parts.coordinator, rc.parts.endpoint

        async def rsnap() -> list[tuple[int, int, int, int, int]]:
            states = await rcoord.query_states()
            return [(s.compute_us, s.build_us, s.eval_us, s.copy_us, s.jobs) for s in states]

        async def wire_total() -> int:
            states = await rcoord.query_states()
            return rendpoint.wire_bytes + sum(s.wire_bytes_out for s in states)

        for n in counts:
            before, t0, steps0 = await rsnap(), time.perf_counter(), step_totals(rcoord)
            tok_s = await rate(rc.frontend, n)
            wall = time.perf_counter() - t0
            after = await rsnap()
            overhead, compute_ms = per_step_ms(steps0, step_totals(rcoord))
            extra: dict[str, Any] = {}
            if n == 1:
                # Bytes per *decoded* token: the marginal cost of a longer run of the same
                # prompt (the prompt's activation is paid once per request, not per token).
                half = tokens // 2
                w0 = await wire_total()
                await decode_rate(rc.frontend, half)
                w1 = await wire_total()
                await decode_rate(rc.frontend, tokens)
                w2 = await wire_total()
                extra["wire_bytes_per_token"] = round(((w2 - w1) - (w1 - w0)) / (tokens - half))
            add(
                mode,
                n,
                tok_s,
                overhead_ms_per_step=round(overhead, 3),
                stage_compute_ms_per_step=round(compute_ms, 3),
                stages=_stage_rows(before, after, wall),
                micro_batch_size=rcoord.coord.micro_batch_size,
                micro_batches=len(rcoord.coord.micro.members),
                **extra,
                **pinned_to,
                **link,
            )
        pin(here, home)


def _saturation(row: dict[str, Any]) -> float:
    """The fraction of the run the pipeline's bottleneck computed. Stage processes with a
    micro-batch each to work on overlap, so the bottleneck is the busiest stage; with fewer
    micro-batches than stages (one stream), or stages sharing one compute thread (in-process),
    they take turns, and the bottleneck is their compute together. Dividing by it gives where
    the row would stand with no idle time at all, at the compute it measured."""
    busy = [st["busy"] for st in row.get("stages", ())]
    if not busy:
        return 0.0
    # Requests join the emptiest micro-batch: this many have work at once.
    batches = min(row["streams"], row.get("micro_batches", 1))
    overlap = row["mode"].startswith("remote-2") and batches >= len(busy)
    return max(busy) if overlap else sum(busy)


def _report(
    rows: list[dict[str, Any]], tokens: int, repeats: int, model: Path, json_lines: bool
) -> None:
    from mlxcel.runtime.blas import blas_name

    single = {r["streams"]: r["tok_per_s"] for r in rows if r["mode"] == "single"}
    protected = {r["streams"]: r["tok_per_s"] for r in rows if r["mode"] == "remote-2"}
    for r in rows:
        r["ratio_vs_single"] = round(r["tok_per_s"] / single[r["streams"]], 3)
        if r["mode"] == "remote-2 unprotected" and r["streams"] in protected:
            # What frame protection costs end to end: 1 - protected / unprotected tok/s.
            r["protection_cost"] = round(1 - protected[r["streams"]] / r["tok_per_s"], 4)
        bound = _saturation(r)
        if bound > 0:
            r["saturated_ratio"] = round(r["tok_per_s"] / bound / single[r["streams"]], 3)
        r["tokens"] = tokens
        r["blas"] = blas_name()
        if json_lines:
            print(json.dumps(r), flush=True)
    if not json_lines:
        _print_table(model, tokens, repeats, rows)


def _print_table(model: Path, tokens: int, repeats: int, rows: list[dict[str, Any]]) -> None:
    print(f"model {model} | {tokens} greedy tokens per stream; one stream: best of {repeats}")
    print(
        f"{'mode':<22}{'streams':>8}{'tok/s':>10}{'x single':>10}{'saturated':>10}"
        f"{'protocol ms':>13}  per stage ms/job: compute (build+eval+copy) busy"
    )
    for r in rows:
        stages = "  ".join(
            f"{s['compute_ms']:.2f} ({s['build_ms']:.2f}+{s['eval_ms']:.2f}+{s['copy_ms']:.2f})"
            f" {s['busy']:.2f}"
            for s in r.get("stages", ())
        )
        proto, sat = r.get("overhead_ms_per_step"), r.get("saturated_ratio", "")
        print(
            f"{r['mode']:<22}{r['streams']:>8}{r['tok_per_s']:>10}{r['ratio_vs_single']:>10}"
            f"{sat:>10}{'' if proto is None else proto:>13}  {stages}"
        )
    for r in rows:
        if "protection_cost" in r:
            print(
                f"frame protection (AES-256-GCM) costs remote-2 {100 * r['protection_cost']:.1f}% "
                f"of its tok/s at {r['streams']} stream(s)"
            )
