"""Rank 0 of a tensor-parallel group: start the local ranks, load the shard, run the engine.

With no hostfile, ``tp_size - 1`` follower processes are started on this host. With
``--tp-hostfile`` the ranks are started by the operator on their hosts (each with
``--tp-rank``). Either way every rank first proves the secret to this one and learns the ring
from it (:mod:`.rendezvous`); this process is rank 0 and owns the bus and the API.
A follower that exits while the group is serving makes the group fatal: in-flight requests
fail with an error and the process exits non-zero instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from loguru import logger

from mlxcel import __version__
from mlxcel.base.errors import ConfigError, TpGroupFailed
from mlxcel.base.messages import EXTENDED_SAMPLING
from mlxcel.base.model_config import context_length
from mlxcel.net.secret import ClusterSecret
from mlxcel.reactor.bus import Node
from mlxcel.runtime.blas import colocated_env
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.devices import device_env, gpu_ids
from mlxcel.runtime.engine import LocalEngine
from mlxcel.runtime.kv_usage import figures
from mlxcel.runtime.model import LoadedModel
from mlxcel.serving.frontend import Frontend
from mlxcel.serving.specs import Generation, TensorParallelSpec
from mlxcel.serving.stack import Serving, Stack
from mlxcel.tp.engine import TpRuntime
from mlxcel.tp.group import (
    check_shardable,
    cleartext_hosts,
    init_group,
    load_sharded,
    pick_backend,
    ring_digest,
    ring_of,
)
from mlxcel.tp.rendezvous import (
    LAUNCH_SECRET_ENV,
    RING_BOUND,
    Meeting,
    Rendezvous,
    launch_secret,
)
from mlxcel.tp.roll_call import RollCall, model_digest
from mlxcel.tp.step_seal import StepSeal


@dataclass
class TpParts:
    loaded: LoadedModel
    engine: LocalEngine
    size: int


HOSTFILE_NEEDS_SECRET = (
    "ranks started by hand need the cluster secret: each proves it to rank 0 before the group "
    "forms; pass --cluster-secret-file (serve) or set MLXCEL_CLUSTER_SECRET_FILE, the same on "
    "every rank"
)


def _group_size(spec: TensorParallelSpec) -> tuple[int, list[str] | None]:
    """The group's size (a hostfile's rank count wins) and the hostfile's ring addresses,
    checked before any weights load."""
    config = json.loads((spec.model / "config.json").read_text())
    size, listed = spec.size, None
    if spec.hostfile is not None:
        listed = ring_of(spec.hostfile)
        warning = cleartext_hosts([[a] for a in listed], spec.allow_cleartext)
        if warning:
            logger.warning("{}", warning)
        if spec.secret is None:
            raise ConfigError("--tp-hostfile", HOSTFILE_NEEDS_SECRET)
        if size not in (1, len(listed)):
            raise TpGroupFailed(f"--tp-hostfile lists {len(listed)} ranks but --tp-size is {size}")
        size = len(listed)
    check_shardable(config, size)
    gpus = gpu_ids()
    if spec.hostfile is None and pick_backend(spec.backend) == "nccl" and size > len(gpus):
        raise ConfigError(
            "--tp-size", f"{size} ranks but {len(gpus)} GPUs here: NCCL needs a GPU per rank"
        )
    return size, listed


async def _spawn_followers(
    spec: TensorParallelSpec,
    gen: Generation,
    rendezvous: str,
    size: int,
    followers: list[asyncio.subprocess.Process],
    secret: ClusterSecret,
) -> None:
    """Ranks 1..size-1 on this host, each a ``mlxcel.tp.follower`` process, appended to
    ``followers`` as each starts (a start cancelled midway still reaps those)."""
    for rank in range(1, size):
        args = {
            "--model": spec.model,
            "--rank": rank,
            "--rendezvous": rendezvous,
            "--max-batch-size": gen.max_batch_size,
            "--prefill-step-size": gen.prefill_step_size,
            "--startup-timeout": spec.startup_timeout,
        }
        argv = [str(x) for pair in args.items() for x in pair]
        followers.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "mlxcel.tp.follower",
                *argv,
                # The launch secret travels in the environment (readable only by this user),
                # never on the command line (readable by anyone on the host).
                env={
                    **device_env(rank, colocated_env(size)),
                    LAUNCH_SECRET_ENV: secret.value.hex(),
                },
            )
        )


async def _meet(
    spec: TensorParallelSpec,
    gen: Generation,
    size: int,
    listed: list[str] | None,
    followers: list[asyncio.subprocess.Process],
) -> Meeting:
    """Every rank proves the secret to this one and learns the ring (:mod:`.rendezvous`):
    the ranks this process starts meet it on a loopback port under a fresh launch secret,
    ranks started by hand at rank 0's hostfile address under the cluster secret."""
    if listed is None:
        secret, listen, digest = launch_secret(), "127.0.0.1:0", ""
    else:
        secret, listen, digest = spec.secret, listed[0], ring_digest(listed)
    roll = RollCall(size, model_digest(spec.model), digest, __version__)
    async with Rendezvous(secret, listen, roll) as rv:
        if listed is None:
            await _spawn_followers(spec, gen, rv.address, size, followers, secret)
        own = listed[0] if listed is not None else None
        return await _while_ranks_live(
            rv.meet(own, pick_backend(spec.backend), gen.prompt_cache_bytes),
            followers,
            rv.waiting_for,
            spec.startup_timeout,
        )


def _serving(
    node: Node, fe: Frontend, engine: LocalEngine, loaded: LoadedModel, size: int
) -> Serving:
    async def health() -> dict[str, object]:
        ranks: dict[str, object] = {"ranks": size}
        if engine.failed.is_set():
            ranks["error"] = engine.failure
        return {"ready": not engine.failed.is_set(), "tensor_parallel": ranks}

    # The group failing stops the runner like a signal does.
    return Serving(
        node,
        fe,
        lambda: engine.active,
        health,
        done=engine.failed,
        # Not response_format: the grammar's matcher would have to cross the handoff (or
        # run on every rank): refused by name.
        sampling=EXTENDED_SAMPLING - {"response_format"},
        label="tensor parallel",
        kv=lambda: figures(engine.kv_tokens(), loaded.config, loaded.n_layers, size),
    )


@asynccontextmanager
async def tp_stack(spec: TensorParallelSpec, gen: Generation) -> AsyncIterator[Stack[TpParts]]:
    size, listed = _group_size(spec)
    compute = ComputeThread()
    followers: list[asyncio.subprocess.Process] = []
    stopping = startup_failed = False
    engine: LocalEngine | None = None
    try:
        meeting = await _meet(spec, gen, size, listed, followers)
        group, loaded = await _join(compute, followers, meeting, spec, size)
        async with Node("tensor-parallel") as node:
            runtime = TpRuntime(
                loaded,
                max_batch_size=gen.max_batch_size,
                prefill_step_size=gen.prefill_step_size,
                prompt_cache_bytes=meeting.prompt_cache_bytes,
                group=group,
                seal=StepSeal(meeting.step_key),
            )
            engine = LocalEngine(
                node, loaded, compute, max_sequences=max(gen.parallel, 1), runtime=runtime
            )
            await engine.attach()
            for rank, proc in enumerate(followers, start=1):
                node.spawn(_watch(proc, rank, engine, lambda: stopping), name=f"tp-rank-{rank}")
            fe = Frontend.attached(node, loaded.tokenizer, gen, context_length(loaded.config))
            summary = (
                f"tensor-parallel group of {size} ranks; decode path: batched forward on "
                f"every rank, up to {gen.max_batch_size} sequence(s) per step"
            )
            eng = engine
            yield Stack(
                "tensor-parallel",
                _serving(node, fe, eng, loaded, size),
                loaded.name,
                summary,
                TpParts(loaded, eng, size),
                lambda: eng.failure or None,
            )
            stopping = True
            if not engine.failed.is_set():
                await compute.run(runtime.stop_followers)
    except TpGroupFailed:
        startup_failed = engine is None
        raise
    finally:
        stopping = True
        # A group that never formed has nothing to wait for: its followers go at once.
        await _reap(followers, patient=engine is not None)
        # A failed group's compute thread may sit in a dead collective: do not join it.
        if startup_failed or (engine is not None and engine.failed.is_set()):
            compute.abandon()
        else:
            compute.close()


async def _join(
    compute: ComputeThread,
    followers: list[asyncio.subprocess.Process],
    meeting: Meeting,
    spec: TensorParallelSpec,
    size: int,
) -> tuple[Any, LoadedModel]:
    """Rank 0 forms the group and loads its shard, failing early when a follower exits."""
    group = await _while_ranks_live(
        compute.run(init_group, 0, meeting.ring, meeting.backend, RING_BOUND, meeting.step_key),
        followers,
        lambda: "the ranks to form the group",
        RING_BOUND + 5,  # the watchdog in init_group ends it first
    )
    if group.size() != size:
        raise TpGroupFailed(f"the group has {group.size()} ranks, --tp-size is {size}")
    loaded = await _while_ranks_live(
        compute.run(load_sharded, spec.model, group),
        followers,
        lambda: "the ranks to load the shards",
        max(spec.startup_timeout, 120.0),
    )
    return group, loaded


async def _reap(followers: list[asyncio.subprocess.Process], patient: bool) -> None:
    for proc in followers:
        try:
            await asyncio.wait_for(proc.wait(), 10 if patient else 0)
        except TimeoutError:
            proc.kill()
            await proc.wait()


PROGRESS_EVERY = 5.0  # seconds between "still waiting" lines


async def _while_ranks_live(  # type: ignore[no-untyped-def]
    work, followers: list[asyncio.subprocess.Process], what: Callable[[], str], timeout: float
):
    """Await ``work`` unless a follower exits first or it takes longer than ``timeout``;
    say every few seconds what is being waited for (``what()``)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    exits = [asyncio.ensure_future(p.wait()) for p in followers]
    start = loop.time()
    try:
        while True:
            left = start + timeout - loop.time()
            if left <= 0:
                break
            done, _ = await asyncio.wait(
                [task, *exits],
                timeout=min(PROGRESS_EVERY, left),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if task in done:
                return task.result()
            for rank, e in enumerate(exits, start=1):
                if e in done:
                    raise TpGroupFailed(
                        f"rank {rank} exited with status {e.result()} while waiting for {what()}"
                    )
            logger.info(
                "tensor parallel: waiting for {} ({:.0f}s of {:g}s)",
                what(),
                loop.time() - start,
                timeout,
            )
        raise TpGroupFailed(
            f"gave up waiting for {what()} after {timeout:g}s (--startup-timeout); "
            "is every rank of the hostfile started, with the same cluster secret?"
        )
    finally:
        task.cancel()
        for e in exits:
            e.cancel()


async def _watch(
    proc: asyncio.subprocess.Process, rank: int, engine: LocalEngine, stopping: Callable[[], bool]
) -> None:
    code = await proc.wait()
    if not stopping():
        engine.abort(f"rank {rank} exited with status {code}")
